"""OpenRLHF's PPO actor with its actor loss inside grpo_fast's vocabulary sweep: in
`ActorPPOTrainer.training_step`, the actor call (`self.actor(...)`, which forms and upcasts the full fp32 logits)
and the loss call (`self.actor_loss_fn(...)`) plus its KL and entropy terms become one fused pass, 3 GEMM passes
over the response tokens and no (tokens, vocab) logits.

    python -m grpo_fast.integrations.openrlhf <the arguments of openrlhf.cli.train_ppo_ray>

starts Ray with `install` as every worker's setup hook and runs OpenRLHF's own entry point; in a process of
your own, `import grpo_fast.integrations.openrlhf` installs it (OpenRLHF 0.11).

The rest of training_step is OpenRLHF's, unchanged: it runs with its actor and loss served from the fused pass
(values and metrics from OpenRLHF's own PolicyLoss on the sweep's log-probs; the whole gradient, policy term, KL
and entropy bonus together, carried by the policy loss), so its backward, optimizer step, EMA and metrics are
its own. Inside the sweep, each chunk's gradient is OpenRLHF's own loss composition (PolicyLoss with its clamps,
dual clip and IS corrections, compute_approx_kl, aggregate_loss with its dp_size and global counts: the same
calls training_step makes) differentiated at the chunk's log-probs, the others held fixed: exact for its
token-separable losses. A DeepSpeed ZeRO-3 head is gathered for the sweep, which runs inside the model's forward
(as the TRL drop-in does). Left to OpenRLHF, with one warning naming the reason: gspo (a sequence-level ratio),
packed samples (ring attention and flash-attention's varlen path), a mixture-of-experts aux loss and
vision-language inputs.
"""

from __future__ import annotations

import importlib.metadata
import types
import warnings
from typing import Optional

import torch

from grpo_fast.integrations import peer_import_error
from grpo_fast.models import backbone, gathered_lm_head, lm_head, unwrap
from grpo_fast.token_loss import batch_token_loss, fused_token_loss

try:
    import openrlhf
    from openrlhf.models.loss import aggregate_loss
    from openrlhf.models.utils import compute_approx_kl
    from openrlhf.trainer.ray import ppo_actor
    from openrlhf.utils.loss_utils import get_loss_batch_info
except ImportError as error:
    raise peer_import_error(
        error, __name__, peer="OpenRLHF", package="openrlhf",
        install="grpo_fast.integrations.openrlhf needs openrlhf (pip install --no-deps 'openrlhf==0.11.2', see "
                "docs/openrlhf.md)",
        dependencies="pip install -r requirements-openrlhf.txt installs those OpenRLHF 0.11.2 needs, as tested; see "
                     "docs/openrlhf.md") from error

TESTED_OPENRLHF = ("0.11.",)
OPENRLHF_VERSION = getattr(openrlhf, "__version__", None) or importlib.metadata.version("openrlhf")
if not OPENRLHF_VERSION.startswith(TESTED_OPENRLHF):
    raise ImportError(f"grpo_fast.integrations.openrlhf is tested with OpenRLHF 0.11.x, got {OPENRLHF_VERSION}: "
                      f"training_step, which it patches, changes between minor releases")

_warned: set = set()


def unfusable(trainer, experience) -> Optional[str]:
    """None where the fused training_step applies, else why not (one line)."""
    if trainer.actor_loss_fn.policy_loss_type != "ppo":
        return f"policy_loss_type {trainer.actor_loss_fn.policy_loss_type!r} is not token-separable"
    if getattr(trainer.actor, "packing_samples", False):
        return "packed samples (ring attention / flash-attention varlen) are OpenRLHF's own forward"
    if trainer.aux_loss:
        return "a mixture-of-experts aux loss (aux_loss_coef > 0)"
    if getattr(trainer.actor, "is_vlm", False) and getattr(experience, "mm_train_inputs", None):
        return "vision-language inputs"
    return None


def loss_composition(trainer, experience, kl_ctl, loss_batch_info):
    """loss(logp, entropy) -> the scalar training_step builds from the actor's (B, A) action log-probs and
    entropies (None without entropy_coef) before its backward: OpenRLHF's own calls, in training_step's order
    (without the aux loss)."""
    args = trainer.args
    mask = experience.action_mask

    def loss(logp, entropy):
        action_log_probs = logp * mask.float()                    # as Actor.forward returns them
        total = trainer.actor_loss_fn(action_log_probs, experience.action_log_probs, experience.advantages,
                                      action_mask=mask, rollout_log_probs=experience.rollout_log_probs,
                                      **loss_batch_info)[0]
        if args.algo.kl.use_loss and args.algo.kl.init_coef > 0:
            kl = compute_approx_kl(action_log_probs, experience.base_action_log_probs,
                                   log_probs_old=experience.action_log_probs, kl_estimator=args.algo.kl.estimator,
                                   unbiased_gradient=args.algo.kl.unbiased_gradient)
            total = total + aggregate_loss(kl, mask, **loss_batch_info) * kl_ctl
        if entropy is not None and args.actor.entropy_coef != 0:    # as training_step adds it
            total = total - aggregate_loss(entropy, mask, **loss_batch_info) * args.actor.entropy_coef
        return total
    return loss


def _sweep_forward(self, sequences, attention_mask=None, position_ids=None, grpo_fast_loss=None, **kwargs):
    """The HF model's forward while a fused training_step runs: the backbone, then grpo_fast_loss(hidden, head)
    with the head gathered (ZeRO-3), inside this forward so DeepSpeed's hooks see the head's use."""
    hidden = backbone(self)(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
    with gathered_lm_head(self), torch.autocast(hidden.device.type, enabled=False):
        head = lm_head(self)
        return grpo_fast_loss(hidden.to(head.weight.dtype), head)


class _FusedPass:
    """One micro-batch's fused sweep, then served to training_step as its actor call and its loss call."""

    def __init__(self, trainer, experience, kl_ctl, loss_batch_info):
        self.trainer = trainer
        actor = trainer.actor
        sequences, mask = experience.sequences, experience.action_mask
        num_actions = mask.shape[1]
        self.with_entropy = trainer.args.actor.entropy_coef is not None
        # every token starts at its old log-prob (ratio 1); the sweep writes its own in (batch_token_loss)
        self.logp = experience.action_log_probs.detach().float().clone()
        self.entropy = torch.zeros_like(self.logp) if self.with_entropy else None
        token_loss = batch_token_loss(loss_composition(trainer, experience, kl_ctl, loss_batch_info), self.logp,
                                      self.entropy)

        def head_loss(hidden, head):
            # Actor.forward's positions: the logits at S - 1 - A .. S - 2 predict the A action tokens
            window = hidden[:, -num_actions - 1:-1]
            return fused_token_loss(window, head.weight, sequences[:, -num_actions:], token_loss, mask=mask.bool(),
                                    bias=head.bias, transform=head.transform(actor.temperature),
                                    with_entropy=self.with_entropy)

        model = unwrap(actor.model)
        position_ids = experience.attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(experience.attention_mask == 0, 1)
        model.forward = types.MethodType(_sweep_forward, model)
        try:        # through the (DeepSpeed-wrapped) model's own call, so its forward hooks run
            self.carrier = actor.model(sequences, attention_mask=experience.attention_mask, position_ids=position_ids,
                                       grpo_fast_loss=head_loss)
        finally:
            del model.forward
        self.logp = self.logp * mask.float()
        if self.entropy is not None:
            self.entropy = self.entropy * mask.float()

    def actor_call(self, sequences, action_mask, **kwargs):
        """What training_step's self.actor(...) returns: (B, A) action log-probs and an output with .entropy
        over the sequence's next-token positions (B, S - 1), the action window filled."""
        output = types.SimpleNamespace(aux_loss=None)
        if self.entropy is not None:
            entropy = self.logp.new_zeros(sequences.shape[0], sequences.shape[1] - 1)
            entropy[:, -action_mask.shape[1]:] = self.entropy
            output.entropy = entropy
        return self.logp, output

    def loss_call(self, *args, **kwargs):
        """OpenRLHF's PolicyLoss on the sweep's log-probs (values and metrics), its loss carrying the sweep's
        gradient of the whole training loss."""
        loss_fn = self.trainer.actor_loss_fn
        loss, *rest = type(loss_fn).forward(loss_fn, *args, **kwargs)      # its own forward, not this one
        return (loss + (self.carrier - self.carrier.detach()).to(loss.dtype), *rest)


_original_training_step = None


def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
    """OpenRLHF's ActorPPOTrainer.training_step with the actor and loss calls served by one fused pass."""
    reason = unfusable(self, experience)
    if reason is not None:
        message = f"grpo_fast.integrations.openrlhf: the actor loss runs as OpenRLHF's own because {reason}"
        if message not in _warned:
            _warned.add(message)
            warnings.warn(message, stacklevel=2)
        return _original_training_step(self, experience, kl_ctl, step, loss_batch_info)
    if loss_batch_info is None:               # as training_step computes it
        loss_batch_info = get_loss_batch_info(self.strategy, experience.action_mask, replay_buffer=self.replay_buffer,
                                              step=step, dynamic_batch=self.args.train.dynamic_batch_enable)
    self.actor.train()
    fused = _FusedPass(self, experience, kl_ctl, loss_batch_info)
    # the two modules' forwards answered by the fused pass (instance attributes, removed after): the actor and the
    # loss stay OpenRLHF's objects, which its strategy's backward and step expect
    self.actor.forward, self.actor_loss_fn.forward = fused.actor_call, fused.loss_call
    try:
        return _original_training_step(self, experience, kl_ctl, step, loss_batch_info)
    finally:
        del self.actor.forward, self.actor_loss_fn.forward


def install() -> None:
    """Patch OpenRLHF's ActorPPOTrainer.training_step (see the module docstring); calling it again changes
    nothing. Also Ray's worker setup hook of `python -m grpo_fast.integrations.openrlhf`."""
    global _original_training_step
    trainer = ppo_actor.ActorPPOTrainer
    if trainer.training_step is not training_step:
        _original_training_step = trainer.training_step
        trainer.training_step = training_step


install()


def ray_runtime_env(env_vars: Optional[dict] = None) -> dict:
    """Ray's runtime_env that installs the patch in every worker process (its worker_process_setup_hook), with
    OpenRLHF's own default environment variables (and `env_vars`)."""
    import os

    defaults = {"TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
                "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
                "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")}
    return {"worker_process_setup_hook": "grpo_fast.integrations.openrlhf.install",
            "env_vars": {**defaults, **(env_vars or {})}}


def main(argv=None) -> None:
    """OpenRLHF's train_ppo_ray entry point with `install` in every Ray worker and in this driver (Ray started
    here: OpenRLHF's own entry point starts it only when it is not running)."""
    import runpy
    import sys

    import ray

    ray.init(runtime_env=ray_runtime_env())
    sys.argv = ["openrlhf.cli.train_ppo_ray", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")


if __name__ == "__main__":
    main()
