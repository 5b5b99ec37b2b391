"""Every method the benchmarks compare, behind one interface: `step(batch) -> (loss, d_hidden, d_weight)`.

All compute the same loss (dapo with the k3 KL, `LOSS` below) forward and backward through hidden and the
LM-head weight, on the same inputs; they differ only in how the LM head and log-softmax are executed.
Peers (TRL, Liger, verl) are optional: when one is not importable its rows say so instead of failing the run.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import grpo_fast as gf
from grpo_fast import reference
from grpo_fast.kept import KeptSet
from grpo_fast.variants import LossConfig, policy_loss

LOSS = dict(loss_type="dapo", beta=0.04, epsilon_low=0.2, epsilon_high=0.28)
TRL_VOCAB_CHUNK = 32768        # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16


@dataclass
class Batch:
    hidden: torch.Tensor       # (B, T, H), requires grad
    weight: torch.Tensor       # (V, H), requires grad
    targets: torch.Tensor      # (B, T)
    mask: torch.Tensor         # (B, T) bool
    advantages: torch.Tensor   # (B,)
    old_logps: torch.Tensor    # (B, T) fp32
    ref_logps: torch.Tensor    # (B, T) fp32
    kept_ids: Optional[torch.Tensor] = None       # the CSR kept set of every token (top-k / top-p rows), or None
    kept_offsets: Optional[torch.Tensor] = None

    @property
    def kept(self) -> dict:
        """The kept_ids / kept_offsets keywords of the full-logits loss (grpo_fast.reference), or none."""
        return {} if self.kept_ids is None else {"kept_ids": self.kept_ids, "kept_offsets": self.kept_offsets}

    @property
    def kept_set(self) -> Optional[KeptSet]:
        """The kept sets as grpo_fast's loss takes them (LogitTransform(kept=...)), or None."""
        return None if self.kept_ids is None else KeptSet(self.kept_ids, self.kept_offsets)

    @property
    def num_items(self) -> torch.Tensor:
        return self.mask.sum()


@dataclass(frozen=True)
class Implementation:
    name: str
    step: Callable                              # Batch -> (loss or None, d_hidden, d_weight)
    requires: tuple = ()                        # modules that must be importable
    devices: tuple = ("cpu", "cuda")
    description: str = ""
    kept: int = 0                               # ids per token in the batch's kept sets (0: whole vocabulary)
    missing: Optional[Callable] = None          # () -> why the installed packages cannot run it, or None

    def unavailable(self, device: str) -> Optional[str]:
        """Why this implementation cannot run here, or None."""
        if device.split(":")[0] not in self.devices:
            return f"not for {device}"
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"{module} not installed"
        return None if self.missing is None else self.missing()


KEPT = 512                     # a top_k = 512 sampler's kept set


def kept_set(targets: torch.Tensor, vocab: int, k: int) -> tuple:
    """(kept_ids, kept_offsets): k ids per token, (target + j * (V // k)) mod V for j < k (distinct, target
    first), min(k, V) when k > V."""
    k = min(k, vocab)
    step = vocab // k
    flat = targets.reshape(-1).clamp(min=0)
    ids = (flat[:, None] + torch.arange(k, device=flat.device) * step) % vocab
    return ids.reshape(-1), torch.arange(0, flat.numel() * k + 1, k, device=flat.device)


def backward(loss, batch):
    d_hidden, d_weight = torch.autograd.grad(loss, (batch.hidden, batch.weight))
    return loss.detach(), d_hidden, d_weight


def loss_math(logp, entropy, batch):
    """The same per-token loss and reduction for every two-stage method (log-probs first, then this)."""
    config = LossConfig(**LOSS)
    loss, _ = policy_loss(logp, entropy, batch.mask.float(), batch.advantages[:, None].float(),
                          old_logps=batch.old_logps, ref_logps=batch.ref_logps,
                          num_items_in_batch=batch.num_items, config=config)
    return loss


def grpo_fast_fused(backend, chunk_bytes=None):
    """The fused loss on `backend`; chunk_bytes: the chunk budget (None: the loss's default). Over the batch's
    kept sets when it has them."""
    def step(batch):
        loss, _ = gf.grpo_loss(batch.hidden, batch.weight, batch.targets, batch.advantages, batch.mask,
                               old_logps=batch.old_logps, ref_logps=batch.ref_logps, config=LossConfig(**LOSS),
                               transform=gf.LogitTransform(kept=batch.kept_set),
                               weights=gf.TokenWeights(num_items_in_batch=batch.num_items),
                               execution=gf.Execution(chunk_bytes=chunk_bytes, backend=backend))
        return backward(loss, batch)
    return step


def grpo_fast_two_phase(batch):
    """token_logprobs (4 GEMM passes with its backward) followed by the plain loss math."""
    logp = gf.token_logprobs(batch.hidden, batch.weight, batch.targets.clamp(min=0))
    return backward(loss_math(logp, None, batch), batch)


def naive(batch):
    """Full logits, fp32 log-softmax and gather, then the loss math: what TRL did before its fused head."""
    loss, _ = reference.grpo_loss(batch.hidden, batch.weight, batch.targets, batch.advantages, batch.mask,
                                  old_logps=batch.old_logps, ref_logps=batch.ref_logps, config=LossConfig(**LOSS),
                                  transform=gf.LogitTransform(kept=batch.kept_set),
                                  weights=gf.TokenWeights(num_items_in_batch=batch.num_items))
    return backward(loss, batch)


def trl(batch):
    """TRL 1.16's fused LM head (ChunkedLogProbFunction, as GRPOTrainer calls it) and then the loss math."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    mask = batch.mask
    logp, entropy, *_ = ChunkedLogProbFunction.apply(
        batch.hidden[mask], batch.weight, None, batch.targets[mask], 1.0, TRL_VOCAB_CHUNK, None, 1.0, ("entropy",))
    logp = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
    entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
    return backward(loss_math(logp, entropy, batch), batch)


def liger(compiled):
    modules = {}

    def step(batch):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        if "loss" not in modules:
            modules["loss"] = LigerFusedLinearGRPOLoss(
                beta=LOSS["beta"], compiled=compiled, use_ref_model=True, epsilon_low=LOSS["epsilon_low"],
                epsilon_high=LOSS["epsilon_high"], loss_type=LOSS["loss_type"])
        loss, _ = modules["loss"](batch.hidden, batch.weight, batch.targets.clamp(min=0), batch.mask.long(),
                                  batch.advantages, ref_per_token_logps=batch.ref_logps,
                                  old_per_token_logps=batch.old_logps, num_items_in_batch=batch.num_items)
        return backward(loss, batch)
    return step


def torch_linear_cross_entropy_missing() -> Optional[str]:
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return f"torch {torch.__version__} has no chunked linear_cross_entropy (torch >= 2.13)"
    return None


def torch_linear_cross_entropy(batch):
    """PyTorch's own chunked LM head + cross-entropy (torch >= 2.13): per-token log-probs as
    -linear_cross_entropy(reduction="none") on its chunked path (LinearCrossEntropyOptions()), then the loss math.
    Its chunked path warns when it falls back to full logits: that fails the row instead of timing the fallback."""
    import warnings

    import torch.nn.functional as F

    hidden = batch.hidden[batch.mask]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logp = -F.linear_cross_entropy(hidden, batch.weight, batch.targets[batch.mask], reduction="none",
                                       options=torch.nn.LinearCrossEntropyOptions())
    full = torch.zeros(batch.mask.shape, dtype=logp.dtype, device=logp.device).masked_scatter(batch.mask, logp)
    return backward(loss_math(full.float(), None, batch), batch)


def verl_fused(batch):
    """verl 0.9's fused LM head (FusedLinearForPPO, its torch backend: log-probs and entropies in chunks of
    tokens, the logits recomputed in backward), then the loss math."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    mask = batch.mask
    logp, entropy = FusedLinearForPPO().forward(batch.hidden[mask][None], batch.weight, batch.targets[mask][None])
    logp = logp.new_zeros(mask.shape).masked_scatter(mask, logp[0])
    entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy[0])
    return backward(loss_math(logp.float(), entropy.float(), batch), batch)


def floor(batch):
    """The three GEMMs no method can skip: logits, d(hidden), d(weight) (no loss)."""
    hidden = batch.hidden.detach()[batch.mask]
    weight = batch.weight.detach()
    logits = hidden @ weight.t()
    return None, logits @ weight, logits.t() @ hidden


IMPLEMENTATIONS = {impl.name: impl for impl in [
    Implementation("floor", floor, description="three plain matmuls of the same shapes"),
    Implementation("grpo_fast", grpo_fast_fused("torch"), description="fused loss, torch backend"),
    Implementation("grpo_fast[triton]", grpo_fast_fused("triton"), requires=("triton",), devices=("cuda",),
                   description="fused loss, Triton backend"),
    Implementation("grpo_fast_kept512", grpo_fast_fused("torch"), kept=KEPT,
                   description="fused loss over kept sets of 512 ids per token (top_k 512), torch backend"),
    Implementation("grpo_fast_kept512[triton]", grpo_fast_fused("triton"), requires=("triton",), devices=("cuda",),
                   kept=KEPT, description="fused loss over kept sets of 512 ids per token, Triton backend"),
    Implementation("grpo_fast_two_phase", grpo_fast_two_phase, description="token_logprobs, then the loss math"),
    Implementation("naive", naive, description="full logits, fp32 log-softmax, gather"),
    Implementation("trl", trl, requires=("trl",), description="TRL 1.16 ChunkedLogProbFunction + loss math"),
    Implementation("liger", liger(compiled=False), requires=("liger_kernel",),
                   description="LigerFusedLinearGRPOLoss, eager"),
    Implementation("liger_compiled", liger(compiled=True), requires=("liger_kernel",),
                   description="LigerFusedLinearGRPOLoss, torch.compile"),
    Implementation("torch_linear_ce", torch_linear_cross_entropy, missing=torch_linear_cross_entropy_missing,
                   description="torch.nn.functional.linear_cross_entropy, chunked, reduction='none'"),
    Implementation("verl", verl_fused, requires=("verl",),
                   description="verl 0.9 FusedLinearForPPO (torch backend) + loss math"),
]}
