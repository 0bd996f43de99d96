"""Memory readings for the plots: nvml (when a driver answers), torch CUDA, and the process."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MemoryReading:
    nvml_used: int | None = None
    nvml_total: int | None = None
    nvml_status: str = "no NVIDIA driver"
    torch_allocated: int | None = None
    torch_reserved: int | None = None
    process_rss: int = 0
    system_available: int | None = None  # the machine's MemAvailable: the "device" of a CPU run

    @property
    def device_free(self) -> int | None:
        """What the device could still give: nvml's free memory, else the machine's available RAM."""
        if self.nvml_total is not None and self.nvml_used is not None:
            return self.nvml_total - self.nvml_used
        return self.system_available


def system_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemoryProbe:
    """Call from the engine's thread (torch.cuda memory is per thread's current device)."""

    @classmethod
    def for_device(cls, device: str, max_age_s: float = 0.0) -> MemoryProbe:
        """A probe for an engine's device as ``SourceInfo.device`` names it ("cpu", "cuda", "cuda:1")."""
        return cls(
            int(device.split(":")[1]) if device.startswith("cuda:") else (0 if device == "cuda" else None), max_age_s
        )

    def __init__(self, device_index: int | None, max_age_s: float = 0.0) -> None:
        self.device_index = device_index
        # A reading is reused for this long: nvml and /proc cost ~0.3 ms a read, a quarter of a small
        # model's step, while memory moves on the scale of the window's redraws (~30 a second).
        self.max_age_s = max_age_s
        self._last: tuple[float, MemoryReading] | None = None
        self._handle = None
        self.status = "no NVIDIA driver"
        try:
            import pynvml  # provided by nvidia-ml-py

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index or 0)
            self.status = pynvml.nvmlDeviceGetName(self._handle)
            if isinstance(self.status, bytes):
                self.status = self.status.decode()
        except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound and friends
            self._handle = None
            self.status = "no NVIDIA driver" if "NotFound" in type(e).__name__ else f"nvml: {e}"

    def read(self) -> MemoryReading:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.max_age_s:
            return self._last[1]
        reading = self._read()
        self._last = (now, reading)
        return reading

    def _read(self) -> MemoryReading:
        used = total = alloc = reserved = None
        if self._handle is not None:
            import pynvml

            info = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
            used, total = int(info.used), int(info.total)
        if self.device_index is not None:
            import torch

            alloc = torch.cuda.memory_allocated(self.device_index)
            reserved = torch.cuda.memory_reserved(self.device_index)
        return MemoryReading(used, total, self.status, alloc, reserved, process_rss(), system_available())
