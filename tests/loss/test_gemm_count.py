"""GEMM work, counted by a dispatch mode that sees mm / addmm in their functional, out= and in-place forms."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast.benchmarks.profiling import GemmCounter
from tests.helpers import grouped

N, H, V = 96, 32, 200
ONE_PASS = 2 * N * H * V


def make(weight_grad=True):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, N // 2, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, requires_grad=weight_grad)
    targets = torch.randint(0, V, (2, N // 2), generator=gen)
    return hidden, weight, targets, torch.randn(2, generator=gen), torch.ones(2, N // 2, dtype=torch.bool)


def passes(fn):
    with GemmCounter() as counter:
        fn()
    return counter.flops / ONE_PASS


def test_counter_sees_out_and_inplace_forms():
    a, b, c = torch.randn(4, 5), torch.randn(5, 6), torch.zeros(4, 6)
    with GemmCounter() as counter:
        torch.mm(a, b, out=c)
        c.addmm_(a, b)
        torch.addmm(c, a, b, out=c)
    assert counter.flops == 3 * 2 * 4 * 5 * 6 and counter.calls == 3


@pytest.mark.parametrize("chunk_bytes", [None, 20_000])
def test_fused_loss_is_three_passes(chunk_bytes):
    hidden, weight, targets, adv, mask = make()
    loss_passes = passes(lambda: gf.grpo_loss(hidden, weight, targets, adv, mask, ref_logps=-torch.ones(
        2, N // 2), **grouped(beta=0.1, chunk_bytes=chunk_bytes, backend="torch"))[0].backward())
    assert loss_passes == 3


def test_frozen_weight_is_two_passes():
    hidden, weight, targets, adv, mask = make(weight_grad=False)
    assert passes(lambda: gf.grpo_loss(hidden, weight, targets, adv, mask,
                                       **grouped(backend="torch"))[0].backward()) == 2


def test_masked_tokens_cost_nothing():
    hidden, weight, targets, adv, mask = make()
    mask[:, N // 4:] = False
    assert passes(lambda: gf.grpo_loss(hidden, weight, targets, adv, mask,
                                       **grouped(backend="torch"))[0].backward()) == 1.5


def test_sequence_level_is_four_passes():
    hidden, weight, targets, adv, mask = make()
    assert passes(lambda: gf.grpo_loss(hidden, weight, targets, adv, mask, **grouped(
        loss_type="luspo", importance_sampling_level="sequence", backend="torch"))[0].backward()) == 4


def test_vespo_is_four_passes():
    """VESPO weighs each token by its whole sequence's ratio: two phases, like the sequence-level variants."""
    hidden, weight, targets, adv, mask = make()
    old = -torch.ones(2, N // 2)
    assert passes(lambda: gf.grpo_loss(hidden, weight, targets, adv, mask, old_logps=old,
                                       **grouped(loss_type="vespo", backend="torch"))[0].backward()) == 4


def test_token_logprobs_no_grad_is_one_pass():
    hidden, weight, targets, _, _ = make()
    with torch.no_grad():
        assert passes(lambda: gf.token_logprobs(hidden, weight, targets, return_entropy=True,
                                                **grouped(backend="torch"))) == 1


def test_token_logprobs_with_grad_is_four_passes():
    hidden, weight, targets, _, _ = make()
    assert passes(lambda: gf.token_logprobs(hidden, weight, targets, **grouped(backend="torch")).sum().backward()) == 4


def test_loss_under_no_grad_is_one_pass():
    hidden, weight, targets, adv, mask = make()
    with torch.no_grad():
        assert passes(lambda: gf.grpo_loss(hidden, weight, targets, adv, mask, **grouped(backend="torch"))) == 1
