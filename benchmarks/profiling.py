"""Measuring tools shared by tests and benchmarks: GEMM FLOP counting and peak memory."""

from __future__ import annotations

import os
import platform
import resource
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Overload packets cover the functional, out= and dtype forms (aten.mm.out, aten.addmm.dtype_out, ...);
# the in-place forms are packets of their own. torch.utils.flop_counter misses the in-place and out= forms.
_MM = {aten.mm, aten.addmm, aten.addmm_}
_BMM = {aten.bmm, aten.baddbmm, aten.baddbmm_}


class GemmCounter(TorchDispatchMode):
    """Counts matmul FLOPs (2 * m * k * n per product) of everything run inside it.

    with GemmCounter() as counter:
        loss.backward()
    counter.flops, counter.calls
    """

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _MM or packet in _BMM:
            a, b = (args[0], args[1]) if packet in (aten.mm, aten.bmm) else (args[1], args[2])
            batch = a.shape[0] if packet in _BMM else 1
            m, k = a.shape[-2], a.shape[-1]
            n = b.shape[-1]
            self.flops += 2 * batch * m * k * n
            self.calls += 1
        return func(*args, **kwargs)


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak_rss() -> bool:
    """Restart the peak-RSS count at the current RSS (Linux: /proc/self/clear_refs); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or since the last `reset_peak_rss`."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def start_peak_rss() -> int:
    """Reset the peak count and return the baseline to subtract from a later `peak_rss_bytes()`."""
    if reset_peak_rss():
        return rss_bytes()
    return max(rss_bytes(), peak_rss_bytes())   # without a reset the peak so far is the only safe baseline


def machine_name(device: str) -> str:
    """The GPU's name, or the CPU model and core count, for result tables."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores"
