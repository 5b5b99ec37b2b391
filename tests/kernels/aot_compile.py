"""Compile the Triton kernels ahead of time for sm_90 and sm_80 exactly as the JIT would specialize them at run time.

python tests/aot_compile.py     prints one JSON line per (kernel, variant, arch): registers, spills, shared memory,
                                facts read off the PTX (vector widths of global loads and stores, barriers
                                inside loops, cp.async, special-function instructions, the source lines of the
                                NaN-dropping max / min and of the contracted fma instructions) and, where
                                cuobjdump is found, the SASS instructions per element of the main loop.

Each variant calls the kernel's public launcher on CPU tensors of the real vocabulary size with the launch
intercepted: the arguments the launcher passes go through Triton's own binder for a CUDA target, so the
divisibility attributes (16-byte aligned pointers, integers divisible by 16) are those a GPU run gets. Run it
without TRITON_INTERPRET (the interpreter replaces the kernels with Python functions).
"""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from grpo_fast.kernels.launch import RowStats
from grpo_fast.variants import LossConfig, TokenTerms

# The kernel modules (the package re-exports their launchers under the same names).
dlogits = importlib.import_module("grpo_fast.kernels.dlogits")
logprob_forward = importlib.import_module("grpo_fast.kernels.logprob_forward")
policy_grad = importlib.import_module("grpo_fast.kernels.policy_grad")
kept_logprob_forward = importlib.import_module("grpo_fast.kernels.kept_logprob_forward")
kept_dlogits = importlib.import_module("grpo_fast.kernels.kept_dlogits")

# Shared memory per block available to a kernel, per architecture.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
ARCHS = (90, 80)


@contextmanager
def captured(kernel):
    """Within the block, `kernel[grid](...)` records (args, kwargs) instead of launching."""
    calls = []
    kernel.run = lambda *args, grid, warmup, **kwargs: calls.append((args, kwargs))
    try:
        yield calls
    finally:
        del kernel.run


def compile_like_jit(kernel, args, kwargs, arch):
    """The kernel compiled for sm_<arch> with the signature, constants and attributes the JIT derives."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    return compiled, attrs


def _buffer(rows, vocab, dtype, padded):
    """A (rows, vocab) logits view; padded: rows 16-element aligned as grpo_fast.chunked allocates them."""
    width = -(-vocab // 16) * 16 if padded else vocab
    return torch.randn(rows, width).to(dtype)[:, :vocab]


def variants():
    """(kernel name, variant label, kernel, launch) with launch() calling the public launcher once."""
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for vocab, padded in ((151936, False), (50257, False), (50257, True)):
            for softcap in (None, 30.0):
                label = f"{dtype_name}/V={vocab}{'/padded' if padded else ''}/softcap={softcap is not None}"
                targets = torch.randint(0, vocab, (4,))

                def stats(vocab=vocab, padded=padded, softcap=softcap, targets=targets, dtype=dtype):
                    logprob_forward.logprob_forward(_buffer(4, vocab, dtype, padded), targets, softcap=softcap,
                                                    temperature=0.7, padded=padded)

                def grad(vocab=vocab, padded=padded, softcap=softcap, targets=targets, dtype=dtype):
                    vectors = torch.rand(7, 4)
                    dlogits.dlogits_(_buffer(4, vocab, dtype, padded), targets, RowStats(*vectors[:6]), vectors[6],
                                     g_entropy=vectors[3], softcap=softcap, temperature=0.7, padded=padded)

                yield "logprob_forward", label, logprob_forward._logprob_forward_kernel, stats
                yield "dlogits", label, dlogits._dlogits_kernel, grad
                if padded or vocab != 151936:
                    continue

                def stats_with_sum_pi_squared(vocab=vocab, softcap=softcap, targets=targets, dtype=dtype):
                    logprob_forward.logprob_forward(_buffer(4, vocab, dtype, False), targets, softcap=softcap,
                                                    temperature=0.7, compute_sum_pi_squared=True)

                # the optional fifth running sum (verl's optimal token baseline): its own variant of the kernel
                yield ("logprob_forward", f"sum_pi_squared/{label}", logprob_forward._logprob_forward_kernel,
                       stats_with_sum_pi_squared)
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for vocab, padded in ((151936, False), (50257, True)):
            for softcap in (None, 30.0):
                label = f"{dtype_name}/V={vocab}{'/padded' if padded else ''}/softcap={softcap is not None}"
                kept_ids = torch.randint(0, vocab, (4 * 512,))
                kept_offsets = torch.arange(0, 4 * 512 + 1, 512)
                targets = kept_ids[::512].clone()

                def kept_stats(vocab=vocab, padded=padded, softcap=softcap, targets=targets, dtype=dtype,
                               kept_ids=kept_ids, kept_offsets=kept_offsets):
                    kept_logprob_forward.kept_logprob_forward(_buffer(4, vocab, dtype, padded), targets, kept_ids,
                                                              kept_offsets, softcap=softcap, temperature=0.7)

                def kept_grad(vocab=vocab, padded=padded, softcap=softcap, targets=targets, dtype=dtype,
                              kept_ids=kept_ids, kept_offsets=kept_offsets):
                    vectors = torch.rand(7, 4)
                    kept_dlogits.kept_dlogits_(_buffer(4, vocab, dtype, padded), targets, kept_ids, kept_offsets,
                                               RowStats(*vectors[:6]), vectors[6], g_entropy=vectors[3],
                                               softcap=softcap, temperature=0.7, padded=padded)

                yield "kept_logprob_forward", label, kept_logprob_forward._kept_logprob_forward_kernel, kept_stats
                yield "kept_dlogits", label, kept_dlogits._kept_dlogits_kernel, kept_grad
    for objective in policy_grad.OBJECTIVES:
        def epilogue(objective=objective):
            n = 3000
            v = torch.rand(5, n)
            config = LossConfig(loss_type={"clip": "dapo", "cispo": "cispo", "sapo": "sapo"}[objective],
                                delta=1.5, beta=0.04, use_bias_correction_kl=True, log_ratio_clamp=20.0,
                                kl_clamp=10.0)
            terms = TokenTerms(config, advantages=v[0], weights=v[1], old_logps=-v[2], ref_logps=-v[3],
                               is_ratio=v[4])
            policy_grad.policy_grad(-v[2].clone(), terms)

        yield "policy_grad", f"{objective}/all-terms", policy_grad._policy_grad_kernel, epilogue


def loop_bodies(ptx: str):
    """The PTX lines of each loop: from a label to a later branch back to it."""
    lines = ptx.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        match = re.match(r"^\s*(\$L__\w+):", line)
        if match:
            labels[match.group(1)] = i
    bodies = []
    for i, line in enumerate(lines):
        match = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if match and match.group(1) in labels and labels[match.group(1)] < i:
            bodies.append(lines[labels[match.group(1)]:i + 1])
    return bodies


def ptx_facts(ptx: str) -> dict:
    """Counts of the instructions that decide whether a streaming kernel runs at memory bandwidth."""
    def access_bytes(op):                 # ld.global.v4.b32 -> 16, ld.global.L1::evict_last.b16 -> 2
        lanes = re.search(r"\.v(\d)\b", op)
        return int(lanes.group(1) if lanes else 1) * int(re.search(r"(\d+)$", op).group(1)) // 8

    loads = [access_bytes(op) for op in re.findall(r"\bld\.global[\w.:]*", ptx)]
    stores = [access_bytes(op) for op in re.findall(r"\bst\.global[\w.:]*", ptx)]
    loops = loop_bodies(ptx)
    return {
        "load_bytes": sorted(set(loads)),
        "store_bytes": sorted(set(stores)),
        "global_loads": len(loads),
        "cp_async_bytes": sorted({int(size, 0) for size in re.findall(
            r"\bcp\.async\.c[ag]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)", ptx)}),
        "loops": len(loops),
        "barriers_in_loops": max((sum("bar.sync" in line or "barrier.sync" in line for line in body)
                                  for body in loops), default=0),
        "shuffles_in_loops": max((sum("shfl.sync" in line for line in body) for body in loops), default=0),
        "ex2": len(re.findall(r"\bex2\.approx", ptx)),
        "div": len(re.findall(r"\bdiv\.(?:full|rn|approx)\.f32", ptx)),
    }


KERNEL_DIR = os.path.dirname(dlogits.__file__)
KERNEL_FILES = {name for name in os.listdir(KERNEL_DIR) if name.endswith(".py")}


def instruction_sources(ptx: str):
    """(opcode, "file.py:line") of each PTX instruction, the line being the innermost one of grpo_fast's kernel
    files in its .loc's inlining chain: a tl.max reduction is Triton's standard.py inlined at the kernel's line,
    which is the one reported; code at line 0 (the compiler's own) is reported at the real line before it. Triton
    3.6 writes the chain in a comment (`.loc 2 21 25 // transform.py:21:25 @[ dlogits.py:60:19 @[ ... ] ]`); 3.9
    one level per .loc (`.loc 3 196 12, function_name ..., inlined_at 3 216 16`), the parent's own parent on an
    earlier .loc of that location."""
    files = {number: os.path.basename(path) for number, path in re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx,
                                                                            re.M)}
    parents = {}                                  # (file, line, column) -> where it was inlined (3.9's form)
    for here, parent in re.findall(r"\.loc\s+(\d+ \d+ \d+), [^\n]*?inlined_at (\d+ \d+ \d+)", ptx):
        parents.setdefault(tuple(here.split()), tuple(parent.split()))

    def chain_of(loc_line):
        inlined = re.search(r"\.loc\s+(\d+ \d+ \d+), [^\n]*?inlined_at (\d+ \d+ \d+)", loc_line)
        if inlined is None:                       # 3.6: the chain in the comment
            return re.findall(r"([\w.]+\.py):(\d+):\d+", loc_line.split("//", 1)[-1])
        chain, at, seen = [], tuple(inlined.group(1).split()), set()
        parent = tuple(inlined.group(2).split())
        while at is not None and at not in seen:
            seen.add(at)
            chain.append((files.get(at[0], "?"), at[1]))
            at, parent = parent, None
            if at is not None:
                parent = parents.get(at)
        return chain

    source = None
    for line in ptx.splitlines():
        if re.match(r"\s*\.loc\s", line):
            # Line 0 is code the compiler made without a line of its own (a libdevice function's body inlined at
            # a call, the branch after a loop): it belongs to the real line before it, so that an fma or a maxnum
            # there is checked against a line that says what it may be, never against an empty one.
            real = next((f"{name}:{number}" for name, number in chain_of(line) if name in KERNEL_FILES), None)
            if real is None or not real.endswith(":0"):
                source = real
            continue
        op = re.match(r"\s*([a-z][\w.:]*)\s", line)
        if op and source is not None:
            yield op.group(1), source


def arithmetic_sources(ptx: str) -> dict:
    """The source lines of the instructions whose GPU semantics differ from the interpreter's: max / min that drop a
    NaN operand (max.f32 / min.f32, not max.NaN.f32), and fused multiply-adds (contracted a * b + c)."""
    maxnum, fma, nan_propagating = set(), set(), 0
    for op, source in instruction_sources(ptx):
        if op in ("max.f32", "min.f32", "max.ftz.f32", "min.ftz.f32"):
            maxnum.add(source)
        elif op in ("max.NaN.f32", "min.NaN.f32"):
            nan_propagating += 1
        elif op.startswith("fma.") and op.endswith(".f32"):
            fma.add(source)
    return {"maxnum_lines": sorted(maxnum), "fma_lines": sorted(fma), "nan_max_min": nan_propagating}


def ptxas_report(ptx: str, arch: int) -> dict:
    # The ptxas Triton itself runs for this arch: Triton 3.9 writes PTX 9.4 for sm_90, which only its bundled
    # CUDA 13 ptxas (`ptxas-blackwell`) reads, where 3.6 uses that one for sm_100 alone.
    ptxas = get_ptxas(arch).path
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


def cuobjdump():
    """Triton ships cuobjdump beside ptxas; else one on PATH; None where there is none."""
    shipped = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return shipped if os.path.exists(shipped) else shutil.which("cuobjdump")


def sass_instructions(cubin: bytes):
    """(instructions in the longest loop, in the whole kernel) of a cubin's SASS, or None without cuobjdump. A loop
    runs from a backward branch's target to the branch."""
    tool = cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    addresses = [int(a, 16) for a in re.findall(r"^\s*/\*([0-9a-f]{4,})\*/\s+\S", sass, re.M)]
    loops = []
    for at, target in re.findall(r"^\s*/\*([0-9a-f]{4,})\*/[^;\n]*\bBRA\s+(?:`\()?0x([0-9a-f]+)", sass, re.M):
        at, target = int(at, 16), int(target, 16)
        if target < at:
            loops.append(sum(target <= a <= at for a in addresses))
    return max(loops, default=0), len(addresses)


def per_thread_elements(kernel_name, kwargs) -> int:
    """Columns one thread handles per loop iteration (logprob_forward, the kept-set kernels' id loop) or per
    program (dlogits)."""
    if kernel_name == "policy_grad":
        return kwargs["BLOCK"] // (32 * kwargs["num_warps"])
    if kernel_name.startswith("kept_"):
        return max(1, kwargs["BLOCK_K"] // (32 * kwargs["num_warps"]))
    return kwargs["BLOCK_V"] // (32 * kwargs["num_warps"])


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    for kernel_name, variant, kernel, launch in variants():
        with captured(kernel) as calls:
            launch()
        (args, kwargs), = calls
        for arch in ARCHS:
            compiled, attrs = compile_like_jit(kernel, args, kwargs, arch)
            divisible = sorted(kernel.arg_names[path[0]] for path, values in attrs.items()
                               if ["tt.divisibility", 16] in values)
            report = {"kernel": kernel_name, "variant": variant, "arch": f"sm_{arch}",
                      "divisible_by_16": divisible, "num_warps": compiled.metadata.num_warps,
                      "shared_bytes": compiled.metadata.shared, "shared_limit": SHARED_LIMIT[arch],
                      "cubin_bytes": len(compiled.asm["cubin"]), **ptxas_report(compiled.asm["ptx"], arch),
                      **ptx_facts(compiled.asm["ptx"]), **arithmetic_sources(compiled.asm["ptx"])}
            counts = sass_instructions(compiled.asm["cubin"])
            elements = per_thread_elements(kernel_name, kwargs)
            # per element: of the main loop where there is one, else of the whole kernel (one tile per program)
            report["sass_per_element"] = None if counts is None else (counts[0] or counts[1]) / elements
            print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
