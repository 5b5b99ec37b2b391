"""Compile every Triton kernel ahead of time for sm_90 and sm_80 on a machine without a GPU.

python tests/aot_compile.py   prints one JSON line per (kernel, variant, arch): registers, spills, shared memory.
Run without TRITON_INTERPRET (the interpreter replaces the kernels with Python functions).
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from grpo_fast.kernels.dlogits import _dlogits_kernel
from grpo_fast.kernels.logprob_forward import _logprob_forward_kernel
from grpo_fast.kernels.policy_grad import OBJECTIVES, _policy_grad_kernel
from grpo_fast.kernels.tuning import DLOGITS, LOGPROB_FORWARD, POLICY_GRAD

# Shared memory per block available to a kernel without opt-in, and with it, per architecture.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
DTYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


def variants():
    for name, ptr in DTYPES.items():
        for softcap in (False, True):
            yield ("logprob_forward", f"{name}/softcap={softcap}", _logprob_forward_kernel, {
                "Logits": ptr, "Targets": "*i64", "Lse": "*fp32", "Logp": "*fp32", "Entropy": "*fp32",
                "V": "i32", "stride_row": "i64", "scale": "fp32", "inv_temperature": "fp32", "softcap": "fp32",
                "BLOCK_V": "constexpr", "HAS_SOFTCAP": "constexpr", "COMPUTE_ENTROPY": "constexpr",
            }, {"BLOCK_V": LOGPROB_FORWARD["BLOCK_V"], "HAS_SOFTCAP": softcap, "COMPUTE_ENTROPY": True},
                LOGPROB_FORWARD["num_warps"])
            yield ("dlogits", f"{name}/softcap={softcap}", _dlogits_kernel, {
                "Logits": ptr, "Targets": "*i64", "Lse": "*fp32", "Entropy": "*fp32", "GradLogp": "*fp32",
                "GradEntropy": "*fp32", "V": "i32", "stride_row": "i64", "scale": "fp32",
                "inv_temperature": "fp32", "softcap": "fp32",
                "BLOCK_V": "constexpr", "HAS_SOFTCAP": "constexpr", "HAS_GRAD_ENTROPY": "constexpr",
            }, {"BLOCK_V": DLOGITS["BLOCK_V"], "HAS_SOFTCAP": softcap, "HAS_GRAD_ENTROPY": True},
                DLOGITS["num_warps"])


    for objective, code in OBJECTIVES.items():
        yield ("policy_grad", f"{objective}/all-terms", _policy_grad_kernel, {
            "Logp": "*fp32", "Old": "*fp32", "Ref": "*fp32", "Adv": "*fp32", "IsRatio": "*fp32", "Weights": "*fp32",
            "GradLogp": "*fp32", "n": "i32", "eps_low": "fp32", "eps_high": "fp32", "delta": "fp32", "beta": "fp32",
            "sapo_temperature_pos": "fp32", "sapo_temperature_neg": "fp32", "BLOCK": "constexpr",
            "OBJECTIVE": "constexpr", "HAS_OLD": "constexpr", "HAS_DELTA": "constexpr", "HAS_IS_RATIO": "constexpr",
            "HAS_KL": "constexpr", "BIAS_CORRECTION": "constexpr",
        }, {"BLOCK": POLICY_GRAD["BLOCK"], "OBJECTIVE": code, "HAS_OLD": True, "HAS_DELTA": True,
            "HAS_IS_RATIO": True, "HAS_KL": True, "BIAS_CORRECTION": True}, POLICY_GRAD["num_warps"])


def ptxas_report(ptx: str, arch: int) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{'a' if arch == 90 else ''}", f.name,
                              "-o", os.devnull], capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    registers = int(re.search(r"Used (\d+) registers", out).group(1))
    spill_stores, spill_loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                                   out).groups())
    return {"registers": registers, "spill_stores": spill_stores, "spill_loads": spill_loads}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    for kernel_name, variant, fn, signature, constexprs, num_warps in variants():
        for arch in (90, 80):
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
            report = {"kernel": kernel_name, "variant": variant, "arch": f"sm_{arch}",
                      "shared_bytes": compiled.metadata.shared, "shared_limit": SHARED_LIMIT[arch],
                      "cubin_bytes": len(compiled.asm["cubin"]), **ptxas_report(compiled.asm["ptx"], arch)}
            print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
