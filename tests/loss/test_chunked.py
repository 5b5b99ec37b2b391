"""The chunk loop's d(weight) accumulation (paths, no zero-fill, one chunk written directly) and its budget."""

import types
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_fast as gf
from grpo_fast import chunked, reference
from tests.helpers import assert_close, flat, grouped

N, H, V = 48, 16, 200


def inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.3).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, targets


def weight_grad(dtype, chunk_bytes):
    hidden, weight, targets = inputs(dtype)
    chunked.reset_weight_grad_paths()
    loss, _ = gf.grpo_loss(hidden, weight, targets, torch.tensor(1.0), torch.ones(N, dtype=torch.bool),
                           **grouped(chunk_bytes=chunk_bytes, backend="torch"))
    grad = torch.autograd.grad(loss, weight)[0]
    exact_weight = weight.detach().double().requires_grad_()
    ref_loss, _ = flat(reference.grpo_loss)(hidden.detach().double(), exact_weight, targets, torch.tensor(1.0),
                                      torch.ones(N, dtype=torch.bool))
    return grad, torch.autograd.grad(ref_loss, exact_weight)[0], chunked.weight_grad_paths()


@pytest.mark.parametrize("dtype,chunk_bytes,path,rtol", [
    (torch.float32, None, "direct", 1e-5),
    (torch.float32, 4000, "fp32", 1e-5),
    (torch.bfloat16, None, "direct", 2e-2),
    (torch.bfloat16, 4000, "upcast", 2e-2),
])
def test_weight_grad_paths_on_cpu(dtype, chunk_bytes, path, rtol):
    grad, exact, paths = weight_grad(dtype, chunk_bytes)
    assert paths == {path: 1}
    assert grad.dtype == dtype
    assert_close(grad, exact, rtol, name="dweight")


def chunks(dtype, count=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [((torch.randn(12, V, generator=gen) * 0.1).to(dtype), torch.randn(12, H, generator=gen).to(dtype))
            for _ in range(count)]


def exact_sum(parts):
    return sum(d.double().t() @ h.double() for d, h in parts)


def test_half_gemm_fallback_accumulates_in_fp32():
    parts = chunks(torch.bfloat16)
    grad = chunked.WeightGrad((V, H), torch.bfloat16, torch.device("cpu"), single_chunk=False)
    grad.path = "half-gemm+fp32-add"                     # the CUDA fallback, run here on CPU GEMMs
    for d, h in parts:
        grad.add(d, h)
    assert grad.value.dtype == torch.float32
    assert_close(grad.result(), exact_sum(parts), 1e-2, name="dweight")


def test_missing_fp32_output_gemm_falls_back_with_one_warning(monkeypatch):
    # CPU builds have no out_dtype GEMM: the path that CUDA takes first fails here exactly as on a build without it.
    monkeypatch.setitem(chunked._FP32_OUT_GEMM, "available", True)
    parts = chunks(torch.bfloat16)
    grad = chunked.WeightGrad((V, H), torch.bfloat16, torch.device("cpu"), single_chunk=False)
    grad.path = "fp32-out-gemm"
    with pytest.warns(UserWarning, match="fp32-output GEMM unavailable") as caught:
        for d, h in parts:
            grad.add(d, h)
    assert len(caught) == 1 and grad.path == "half-gemm+fp32-add"
    assert chunked._FP32_OUT_GEMM["available"] is False
    assert_close(grad.result(), exact_sum(parts), 1e-2, name="dweight")


class FullSizeWrites(TorchDispatchMode):
    """Records every op that writes a (V, H)-sized tensor other than a GEMM."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and out.numel() == V * H and name not in ("mm", "addmm", "addmm_", "t",
                                                                                     "detach", "view"):
            self.ops.append(name)
        return out


@pytest.mark.parametrize("dtype,chunk_bytes,expected", [
    (torch.float32, None, []),                    # one chunk: the GEMM writes d(weight)
    (torch.float32, 4000, []),                    # chunks: the first GEMM writes, the others add in place
    (torch.bfloat16, None, []),                   # one chunk: written in bf16 by the GEMM
    (torch.bfloat16, 4000, ["_to_copy"]),         # chunks: fp32 accumulator, one cast to bf16 at the end
])
def test_no_zero_fill_and_no_copy_of_the_weight_gradient(dtype, chunk_bytes, expected):
    hidden, weight, targets = inputs(dtype)
    with FullSizeWrites() as writes:
        loss, _ = gf.grpo_loss(hidden, weight, targets, torch.tensor(1.0), torch.ones(N, dtype=torch.bool),
                               **grouped(chunk_bytes=chunk_bytes, backend="torch"))
    assert writes.ops == expected                 # no zeros / fill_ / zero_ before the first GEMM


def test_an_out_of_memory_error_propagates_and_keeps_the_fp32_output_gemm(monkeypatch):
    """A transient OOM in the fp32-output GEMM is not a missing GEMM: it reaches the caller, and neither this
    accumulator nor the process switches to the slower path. A retry then goes through the same path."""
    monkeypatch.setitem(chunked._FP32_OUT_GEMM, "available", True)
    real_mm, calls = torch.mm, []

    def mm_out_of_memory_once(*args, **kwargs):
        if "out_dtype" in kwargs and not calls:
            calls.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        if "out_dtype" in kwargs:           # CPU has no out_dtype GEMM: compute it as one would on CUDA
            kwargs.pop("out_dtype")
            return real_mm(args[0].float(), args[1].float())
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", mm_out_of_memory_once)
    parts = chunks(torch.bfloat16, count=1)
    grad = chunked.WeightGrad((V, H), torch.bfloat16, torch.device("cpu"), single_chunk=False)
    grad.path = "fp32-out-gemm"
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # no "unavailable" warning either
        with pytest.raises(torch.OutOfMemoryError):
            grad.add(*parts[0])
        assert grad.path == "fp32-out-gemm" and chunked._FP32_OUT_GEMM["available"] is True
        grad.add(*parts[0])                 # the caller's retry
    assert grad.path == "fp32-out-gemm" and chunked._FP32_OUT_GEMM["available"] is True
    assert_close(grad.result(), exact_sum(parts), 1e-2, name="dweight")


@pytest.mark.parametrize("error,unsupported", [
    (TypeError("mm() got an unexpected keyword argument 'out_dtype'"), True),
    (NotImplementedError("Could not run 'aten::mm.dtype' with arguments from the 'CPU' backend"), True),
    (RuntimeError("out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("CUDA error: out of memory"), False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
])
def test_only_an_unsupported_gemm_counts_as_missing(error, unsupported):
    assert chunked.fp32_out_gemm_unsupported(error) is unsupported


@pytest.mark.parametrize("total_gib,free_gib,expected", [
    (139.7, 130, 8 * 2**30),               # H200: the cap
    (79.1, 3, 8 * 2**30 * 79.1 / 128),     # 80 GB card, little free: the same budget as with all of it free
    (79.1, 70, 8 * 2**30 * 79.1 / 128),
    (22.0, 20, 22.0 * 2**30 / 16),
    (8.0, 7, 2**30),                       # small cards: the floor
])
def test_cuda_chunk_budget_depends_on_the_device_not_on_free_memory(monkeypatch, total_gib, free_gib, expected):
    total = int(total_gib * 2**30)
    props = types.SimpleNamespace(total_memory=total, name="fake")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * 2**30), total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2**29)
    budget = chunked.default_chunk_bytes(torch.device("cuda", 0))
    assert budget == int(expected), (total_gib, free_gib, budget, int(expected))
    # the same again whatever is free by the next call: the chunk rows of a shape are fixed per device model
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**28, total))
    assert chunked.default_chunk_bytes(torch.device("cuda", 0)) == budget
    assert chunked.default_chunk_bytes(torch.device("cpu")) == chunked.DEFAULT_CHUNK_BYTES_CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uninitialized_memory_never_reaches_the_gradients(dtype, monkeypatch):
    """Every torch.empty is NaN-filled: no value the loss returns may come from memory it did not write. The chunk
    buffer's rows are padded (1000 -> 1008 columns here), and a CPU bf16 GEMM (oneDNN with AMX) reads that padding
    when it multiplies the buffer by the weight: left uninitialized, it once put NaN into d(hidden) at random."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        return tensor

    generator = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 64, 64, 1000
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(dtype).requires_grad_(True)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.1).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    advantages, mask = torch.tensor(1.0), torch.ones(tokens, dtype=torch.bool)
    monkeypatch.setattr(torch, "empty", poisoned_empty)
    loss, _ = gf.grpo_loss(hidden, weight, targets, advantages, mask, **grouped(backend="torch"))
    loss.backward()
    monkeypatch.undo()
    expected = [hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)]
    expected_loss, _ = flat(reference.grpo_loss)(*expected, targets, advantages, mask)
    expected_loss.backward()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(loss, expected_loss, rtol=tolerance, name="loss")
    assert_close(hidden.grad, expected[0].grad, rtol=tolerance, atol=tolerance * 1e-2, name="d(hidden)")
    assert_close(weight.grad, expected[1].grad, rtol=tolerance, atol=tolerance * 1e-2, name="d(weight)")


def test_balanced_chunks_are_as_few_as_the_budget_allows_and_the_last_is_up_to_chunks_minus_one_short():
    """chunked.balanced_rows against its definition, exhaustively on small sizes: the fewest chunks of at most
    `rows` tokens, all of one size but the last, which falls short by less than the number of chunks (and by
    exactly that bound less one somewhere: the bound is tight, not one token)."""
    shortfalls = set()
    for tokens in range(1, 200):
        for rows in range(1, 64):
            size = chunked.balanced_rows(tokens, rows)
            chunks = -(-tokens // size)
            last = tokens - (chunks - 1) * size
            assert size <= rows and chunks == -(-tokens // rows), (tokens, rows, size)
            assert 0 <= size - last <= chunks - 1, (tokens, rows, size, last)
            shortfalls.add((chunks, size - last))
    assert (4, 3) in shortfalls and chunked.balanced_rows(913, 304) == 229
