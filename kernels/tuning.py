"""Fixed launch configurations of the kernels (one place, so kernels stay free of tuning logic).

Both kernels stream a (C, V) buffer and are memory-bound; wide blocks keep each load coalesced and the loop
count small at V ~ 150k-260k. Checked for register spills by tests/test_aot_compile.py on sm_80 and sm_90.
"""

LOGPROB_FORWARD = {"BLOCK_V": 2048, "num_warps": 8}
DLOGITS = {"BLOCK_V": 2048, "num_warps": 8}
POLICY_GRAD = {"BLOCK": 1024, "num_warps": 4}
