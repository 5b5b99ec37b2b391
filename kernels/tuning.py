"""Fixed launch configurations of the kernels (one place, so kernels stay free of tuning logic).

All three stream memory. logprob_forward keeps three fp32 accumulators per lane, so its tile stays at 2048 (one
16-byte vector per thread and stage in bf16, 40-64 registers) and its loop is pipelined 3 deep through shared
memory (cp.async), so that about three tiles per program are in flight. dlogits has no loop: 4096-wide tiles give
each thread two 16-byte vectors to load and to store (31-64 registers). tests/test_aot_compile.py checks the
compiled sm_90 / sm_80 code for vector widths, cp.async, barriers in loops and spills.
"""

LOGPROB_FORWARD = {"BLOCK_V": 2048, "num_warps": 8, "num_stages": 3}
DLOGITS = {"BLOCK_V": 4096, "num_warps": 8}
POLICY_GRAD = {"BLOCK": 1024, "num_warps": 4}
