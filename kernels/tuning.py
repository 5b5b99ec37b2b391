"""Fixed launch configurations of the kernels (one place, so kernels stay free of tuning logic).

The three full-vocabulary passes stream memory. logprob_forward keeps four fp32 accumulators per 16-byte group
of columns; a 4096-wide tile gives each thread two groups per iteration (16 bf16 columns), which halves the loop's
bookkeeping per element (13.3 SASS instructions per bf16 element, 27.4 with a soft-cap, at 40-64 registers), and
its loop is pipelined 3 deep through shared memory (cp.async), so that about three tiles per program are in
flight. dlogits has no loop: 4096-wide tiles give each thread two 16-byte vectors to load and to store (31-64
registers).
tests/kernels/test_aot_compile.py checks the compiled sm_90 / sm_80 code for vector widths, cp.async, barriers in
loops, spills and SASS instructions per element.
"""

LOGPROB_FORWARD = {"BLOCK_V": 4096, "num_warps": 8, "num_stages": 3}
DLOGITS = {"BLOCK_V": 4096, "num_warps": 8}
POLICY_GRAD = {"BLOCK": 1024, "num_warps": 4}
# The kept-set passes gather K ids per row (K <= top_k, typically <= 1024) and clear the row in 4096-wide stores.
KEPT = {"BLOCK_K": 256, "BLOCK_V": 4096, "num_warps": 4}
