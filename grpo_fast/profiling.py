"""Measuring tools shared by tests and benchmarks: GEMM FLOP counting and peak memory."""

from __future__ import annotations

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


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
