"""Which torch device a configuration names, refused with one line when it is not there."""

from __future__ import annotations

import torch


class DeviceNotAvailableError(ValueError, RuntimeError):
    """The configured device does not exist here: a bad configuration (a ``ValueError``;
    also a ``RuntimeError``, which it was before, for callers that catch that)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceNotAvailableError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceNotAvailableError(
            f"--device cuda was asked for, but CUDA is not available here (torch {torch.__version__}); use --device cpu"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceNotAvailableError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev
