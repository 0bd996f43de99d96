"""Whether kvscope's probe package (``kvscope_vllm_probe``, in ``probe/``) is here, and one line when it is not.

kvscope needs it only to read a probed vLLM (``--probe``) or a probe's recording (a ``--replay`` of one, the vLLM
labs): everything else runs without it, so nothing outside those paths imports it. It is not on PyPI; it installs
from a kvscope checkout, into kvscope's environment and into vLLM's.
"""

from __future__ import annotations

INSTALL = "pip install ./probe from a kvscope checkout"


def probe_installed() -> bool:
    try:
        import kvscope_vllm_probe.wire  # noqa: F401 - the wire is what kvscope reads a probe with
    except ImportError:
        return False
    return True


def require_probe(what: str) -> None:
    """Raises ``ValueError`` (one line: what needs it and how to install it) unless the probe's package is here."""
    if not probe_installed():
        raise ValueError(f"{what} needs kvscope's probe package (kvscope-vllm-probe), not installed here: {INSTALL}")
