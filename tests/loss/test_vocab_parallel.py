"""A vocabulary-parallel LM head over a gloo process group: every loss type, log-probs and entropies, forward
and backward, equal the unsharded computation (2 and 3 ranks, uneven slices, several chunks per pass), also over
kept sets (top-k / top-p) whose ids fall in several slices."""


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import grpo_fast as gf
from grpo_fast.kept import kept_set_from_mask
from tests.helpers import exact_token_grads, free_port, grouped

CASES = [dict(loss_type=name) for name in ("grpo", "bnpo", "dapo", "cispo", "sapo")] + [
    dict(loss_type="dr_grpo", max_completion_length=8, beta=0.1, entropy_coef=0.01),
    dict(loss_type="dapo", importance_sampling_level="sequence", temperature=0.7, logit_softcap=5.0),
    dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.05),
]


def inputs(vocab=37, hidden_size=8, batch=3, seq=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
    bias = torch.randn(vocab, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, vocab, (batch, seq), generator=generator)
    mask = torch.rand(batch, seq, generator=generator) > 0.25
    old = torch.where(mask, -3 * torch.rand(batch, seq, generator=generator, dtype=torch.float64), 0.0)
    ref = torch.where(mask, -3 * torch.rand(batch, seq, generator=generator, dtype=torch.float64), 0.0)
    advantages = torch.randn(batch, generator=generator, dtype=torch.float64)
    return hidden, weight, bias, targets, mask, old, ref, advantages


def sharded_equals_full(batch, kwargs, sizes, rank, group):
    """grpo_loss of this rank's slice of the head equals the unsharded loss: value, metrics and gradients."""
    hidden, weight, bias, targets, mask, _, _, advantages = batch
    start, size = sum(sizes[:rank]), sizes[rank]
    h_full, w_full, b_full = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    expected, expected_metrics = gf.grpo_loss(h_full, w_full, targets, advantages, mask, bias=b_full,
                                              **grouped(**kwargs))
    expected.backward()

    h, w, b = hidden.clone().requires_grad_(), weight[start:start + size].clone().requires_grad_(), \
        bias[start:start + size].clone().requires_grad_()
    loss, metrics = gf.grpo_loss(h, w, targets, advantages, mask, bias=b, **grouped(process_group=group, **kwargs))
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h.grad, h_full.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w.grad, w_full.grad[start:start + size], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(b.grad, b_full.grad[start:start + size], rtol=1e-9, atol=1e-12)
    for name, value in expected_metrics.items():
        torch.testing.assert_close(metrics[name], value, rtol=1e-9, atol=1e-12, msg=name)


def run_case(case, sizes, rank, group):
    batch = inputs()
    old, ref = batch[5], batch[6]
    sharded_equals_full(batch, dict(old_logps=old, ref_logps=ref, backend="torch", chunk_bytes=512, **case), sizes,
                        rank, group)


def run_logprobs(sizes, rank, group):
    hidden, weight, _, targets, _, _, _, _ = inputs(seed=1)
    start, size = sum(sizes[:rank]), sizes[rank]
    h_full, w_full = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = gf.token_logprobs(h_full, w_full, targets, return_entropy=True, **grouped(chunk_bytes=512))
    (logp.sum() + 0.3 * entropy.sum()).backward()
    h, w = hidden.clone().requires_grad_(), weight[start:start + size].clone().requires_grad_()
    logp_s, entropy_s = gf.token_logprobs(h, w, targets, return_entropy=True, **grouped(chunk_bytes=512,
                                                                                        process_group=group))
    (logp_s.sum() + 0.3 * entropy_s.sum()).backward()
    torch.testing.assert_close(logp_s, logp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(entropy_s, entropy, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h.grad, h_full.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w.grad, w_full.grad[start:start + size], rtol=1e-9, atol=1e-12)
    with torch.no_grad():                                        # the one-pass form under no_grad
        torch.testing.assert_close(gf.token_logprobs(hidden, weight[start:start + size], targets,
                                                     **grouped(process_group=group)), logp.detach())
        # sum_v p_v^2 of the slices' distribution equals the unsharded one's
        _, sum_pi_squared = gf.token_logprobs(hidden, weight, targets, return_sum_pi_squared=True)
        _, sum_pi_squared_s = gf.token_logprobs(hidden, weight[start:start + size], targets, return_sum_pi_squared=True,
                                                **grouped(chunk_bytes=512, process_group=group))
        torch.testing.assert_close(sum_pi_squared_s, sum_pi_squared, rtol=1e-10, atol=1e-12)


def kept_sets(targets, vocab, mask=None, seed=2):
    """Random CSR kept sets holding each target; empty where mask is 0 (the loss skips those tokens)."""
    generator = torch.Generator().manual_seed(seed)
    keep = torch.rand(targets.numel(), vocab, generator=generator) < 0.3
    keep.scatter_(1, targets.reshape(-1, 1).clamp(min=0), True)
    if mask is not None:
        keep &= mask.reshape(-1, 1)
    return kept_set_from_mask(keep)


def run_kept(sizes, rank, group):
    """Kept sets split across the slices: loss, log-probs, entropies and gradients equal the unsharded ones."""
    batch = inputs(seed=3)
    hidden, weight, bias, targets, mask, old, ref, advantages = batch
    start, size = sum(sizes[:rank]), sizes[rank]
    kept_ids, kept_offsets = kept_sets(targets, weight.shape[0], mask)
    sharded_equals_full(batch, dict(old_logps=old, ref_logps=ref, backend="torch", chunk_bytes=512, beta=0.1,
                                    entropy_coef=0.02, logit_softcap=4.0, temperature=0.8, kept_ids=kept_ids,
                                    kept_offsets=kept_offsets), sizes, rank, group)

    full_ids, full_offsets = kept_sets(targets, weight.shape[0])
    logp, entropy = gf.token_logprobs(hidden, weight, targets, return_entropy=True, **grouped(kept_ids=full_ids,
                                                                                              kept_offsets=full_offsets))
    logp_s, entropy_s = gf.token_logprobs(hidden, weight[start:start + size], targets, return_entropy=True,
                                          **grouped(kept_ids=full_ids, kept_offsets=full_offsets, chunk_bytes=512,
                                                    process_group=group))
    torch.testing.assert_close(logp_s, logp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(entropy_s, entropy, rtol=1e-10, atol=1e-12)
    _, sum_pi_squared = gf.token_logprobs(hidden, weight, targets, return_sum_pi_squared=True,
                                          **grouped(kept_ids=full_ids, kept_offsets=full_offsets))
    _, sum_pi_squared_s = gf.token_logprobs(hidden, weight[start:start + size], targets, return_sum_pi_squared=True,
                                            **grouped(kept_ids=full_ids, kept_offsets=full_offsets, chunk_bytes=512,
                                                      process_group=group))
    torch.testing.assert_close(sum_pi_squared_s, sum_pi_squared, rtol=1e-10, atol=1e-12)

    # a caller's own token-separable loss, inside the sweep of each slice
    token_loss = gf.autograd_token_loss(lambda logp, entropy, index: (logp * advantages.repeat_interleave(8)[index]
                                                                      - 0.1 * entropy).sum())
    h_full, w_full = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    own = gf.fused_token_loss(h_full, w_full, targets, token_loss, mask=mask, with_entropy=True,
                              **grouped(chunk_bytes=512))
    own.backward()
    h, w = hidden.clone().requires_grad_(), weight[start:start + size].clone().requires_grad_()
    own_s = gf.fused_token_loss(h, w, targets, token_loss, mask=mask, with_entropy=True, **grouped(chunk_bytes=512,
                                                                                                   process_group=group))
    own_s.backward()
    torch.testing.assert_close(own_s, own, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h.grad, h_full.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w.grad, w_full.grad[start:start + size], rtol=1e-9, atol=1e-12)


def run_sure_tokens(sizes, rank, group):
    """fp32 rows peaked at 15 ... 40 through this rank's slice of an identity head (d(hidden) = dL/dlogits): each
    row's gradient within 1e-4 of its own exact float64 value, as on one device (the slices' statistics are
    relative to the global max, so a sure token's 1 - p resolves below ulp(1))."""
    gen = torch.Generator().manual_seed(4)
    vocab = sum(sizes)
    y = torch.randn(5, vocab, generator=gen, dtype=torch.float64)
    targets = torch.tensor([0, 5, 20, vocab - 1, 14])         # in the first, the middle and the last slice
    y[torch.arange(5), targets] = torch.tensor([15.0, 20.0, 25.0, 30.0, 40.0], dtype=torch.float64)
    y = y.float()
    for transform in (gf.LogitTransform(), gf.LogitTransform(temperature=0.05)):
        g_logp, g_entropy = torch.randn(2, 5, generator=gen)
        hidden = (y * transform.temperature).requires_grad_()
        start, size = sum(sizes[:rank]), sizes[rank]
        logp, entropy = gf.token_logprobs(hidden, torch.eye(vocab)[start:start + size], targets, transform=transform,
                                          return_entropy=True, execution=gf.Execution(process_group=group))
        ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
        expected, expected_logp = exact_token_grads(hidden.detach(), targets, transform, g_logp, g_entropy)
        errors = (hidden.grad.double() - expected).abs().amax(1) / expected.abs().amax(1)
        assert errors.max() <= 1e-4, errors
        assert ((logp.double() - expected_logp).abs() <= 1e-5 * expected_logp.abs()).all(), (logp, expected_logp)


def worker(rank, world, port, sizes):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for case in CASES:
            run_case(case, sizes, rank, dist.group.WORLD)
        run_logprobs(sizes, rank, dist.group.WORLD)
        run_kept(sizes, rank, dist.group.WORLD)
        run_sure_tokens(sizes, rank, dist.group.WORLD)
        with pytest.raises(ValueError, match=r"targets must lie in \[0, V\) = \[0, 37\)"):
            hidden, weight, _, targets, _, _, _, _ = inputs()
            start, size = sum(sizes[:rank]), sizes[rank]
            gf.token_logprobs(hidden, weight[start:start + size], targets + 37,
                              **grouped(process_group=dist.group.WORLD))
        with pytest.raises(ValueError, match="backend 'torch' or 'auto'"):
            gf.token_logprobs(hidden, weight[:size], targets, **grouped(backend="triton",
                                                                        process_group=dist.group.WORLD))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes", [[20, 17], [13, 12, 12]], ids=["2 ranks", "3 ranks"])
def test_vocab_parallel_equals_unsharded(sizes):
    mp.spawn(worker, args=(len(sizes), free_port(), sizes), nprocs=len(sizes), join=True)
