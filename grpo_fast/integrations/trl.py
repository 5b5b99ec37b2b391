"""TRL's GRPOTrainer with grpo_fast computing every per-token log-prob and entropy (training, old, reference).

    from grpo_fast.integrations.trl import FastGRPOTrainer      # same constructor as trl.GRPOTrainer
    trainer = FastGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)

or, for a trainer that already exists, `patch_grpo_trainer(trainer)` (log-probs only). TRL 1.16 scores
completions through a fused LM head it patches onto the model (`model(..., labels=..., fused_lm_head=True)`);
this replaces that head with grpo_fast's under the same contract, so the old, reference and training log-probs
and entropies come from grpo_fast. FastGRPOTrainer also computes the training loss itself, fused (3 GEMM passes;
4 for vespo, whose weights need whole sequences), wherever TRL's options allow it
(`FastGRPOTrainer.fused_loss_unsupported` says when not), reproducing TRL's formulas, normalizers and logged
metrics, with a mixture-of-experts model's load-balancing loss computed as the model computes it, and with a
vision-language model's images going through its own multimodal forward, and under DeepSpeed ZeRO-3; otherwise
TRL's own loss code runs on grpo_fast's log-probs, with one warning at construction.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import warnings

import torch

from grpo_fast import packed_attention as attention
from grpo_fast.fields import check_value, hints
from grpo_fast.integrations import peer_import_error
from grpo_fast.logprobs import token_logprobs
from grpo_fast.loss import checked_policy_loss
from grpo_fast.models import backbone, gathered_lm_head, lm_head, unwrap
from grpo_fast.options import TokenWeights
from grpo_fast.variants import LOSS_TYPES, LossConfig, clip_flags, importance_ratio, k3_kl, masked_mean, vespo_weights

try:
    from trl import GRPOTrainer
    from trl.trainer.utils import FusedCausalLMOutput, nanmax, nanmin
except (ImportError, RuntimeError) as error:
    # trl loads GRPOTrainer lazily and reports an ImportError there as a RuntimeError raised from it
    cause = error if isinstance(error, ImportError) else error.__cause__
    if not isinstance(cause, ImportError):
        raise
    raise peer_import_error(
        cause, __name__, peer="trl", package="trl",
        install="grpo_fast.integrations.trl needs trl (pip install 'trl==1.16.0')",
        dependencies="pip install 'trl==1.16.0' installs those trl declares") from error

# Decoders whose only token mixing is causal self-attention (RoPE, so a shifted position changes nothing), the ones
# whose training forward may pack each group's prompt once (grpo_fast.packed_attention.SharedPrompts); a model
# that mixes tokens anywhere else (recurrent or convolutional layers, as hybrids have) must see whole sequences.
SHARED_PROMPT_MODELS = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")

_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "spatial_shapes",
                    "image_position_ids", "token_type_ids", "mm_token_type_ids")


def router_aux_loss(model, router_logits, attention_mask) -> torch.Tensor:
    """The load-balancing loss exactly as the model's own forward computes it: its modeling module's
    `load_balancing_loss_func` (Mixtral's where the module has none) with the model's expert counts."""
    loss_func = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if loss_func is None:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as loss_func
    config = model.config.get_text_config()
    num_experts = getattr(model, "num_experts", None) or getattr(config, "num_experts", None) or \
        config.num_local_experts
    top_k = getattr(model, "num_experts_per_tok", None) or config.num_experts_per_tok
    return loss_func(router_logits, num_experts, top_k, attention_mask)


def add_grpo_fast_lm_head(model, temperature: float, cast_lm_head_to_fp32: bool = False):
    """Make `model(..., labels=labels, fused_lm_head=True)` return grpo_fast's log-probs and entropies.

    `model` is a transformers causal LM whose forward TRL has already patched (`add_fused_lm_head`); calls
    without `fused_lm_head=True` go to that forward unchanged. A DeepSpeed ZeRO-3 head is gathered for the
    head's work, which runs inside the model's forward, so ZeRO-3's hooks hand its gradient back to the
    partitions (`grpo_fast.models.gathered_lm_head`, as TRL's head does). With
    `grpo_fast_loss=fn` the forward returns `(fn(hidden, weight, bias, head), aux_loss)` instead, hidden being the
    next-token-aligned (B, L - 1, H) states: the whole loss then runs inside the model's (wrapped) forward. With
    `hidden_index=index` as well (B, C), hidden is the (B, C, H) states at those flat positions of the decoder's
    output, for a packed row (grpo_fast.packed_attention.shared_prompt_row's `predicting`).
    Mixture-of-experts models get router logits from the backbone when the call (`output_router_logits=True`, as
    TRL's training loss passes it) or else the config asks for them, and the output's aux_loss is then the model's
    own load-balancing loss (`router_aux_loss`), as TRL's head returns it; None otherwise.
    """
    trl_forward = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                grpo_fast_loss=None, hidden_index=None, **kwargs):
        if hidden_index is not None and grpo_fast_loss is None:
            raise ValueError("hidden_index (a packed row's predicting positions) needs grpo_fast_loss")
        if not fused_lm_head:
            return trl_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        if getattr(self.config.get_text_config(), "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)       # as the model's own forward does
        outputs = backbone(self)(*args, **kwargs)
        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = router_aux_loss(self, outputs.router_logits, kwargs.get("attention_mask"))
        hidden = outputs.last_hidden_state
        if hidden_index is not None:
            hidden = attention.states_at(hidden, hidden_index)
        elif shift_labels is None:
            hidden = hidden[:, :-1]
            labels = None if labels is None else labels[:, 1:]
        else:
            labels = shift_labels
        with gathered_lm_head(self), torch.autocast(hidden.device.type, enabled=False):
            head = lm_head(self)
            weight, bias = head.weight, head.bias
            hidden = hidden.to(weight.device)
            if cast_lm_head_to_fp32:
                hidden, weight = hidden.float(), weight.float()
                bias = None if bias is None else bias.float()
            elif hidden.dtype != weight.dtype:          # under autocast the head runs in the activations' dtype
                weight = weight.to(hidden.dtype)
                bias = None if bias is None else bias.to(hidden.dtype)
            if grpo_fast_loss is not None:
                return grpo_fast_loss(hidden, weight, bias, head), aux_loss
            labels = labels.to(weight.device)
            mask = labels != -100
            logp, entropy = token_logprobs(hidden[mask], weight, labels[mask], bias=bias,
                                           transform=head.transform(temperature), return_entropy=True)
        # masked_scatter keeps an all-masked micro-batch connected to the graph (a differentiable zero).
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        if aux_loss is not None:
            loss = loss + getattr(self.config.get_text_config(), "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask,
                                   aux_loss=aux_loss)

    model.forward = types.MethodType(forward, model)
    return model


def patch_grpo_trainer(trainer: GRPOTrainer) -> GRPOTrainer:
    """Route an existing GRPOTrainer's log-prob and entropy computations through grpo_fast."""
    if getattr(trainer, "_grpo_fast_patched", False):
        return trainer
    cast = trainer.args.cast_lm_head_to_fp32
    add_grpo_fast_lm_head(unwrap(trainer.model), trainer.temperature, cast)
    if trainer.ref_model is not None:
        add_grpo_fast_lm_head(unwrap(trainer.ref_model), trainer.temperature, cast)
    trainer._grpo_fast_patched = True
    return trainer


def truncated_sampling_bias(args) -> str | None:
    """The warning for a GRPOConfig whose vLLM importance-sampling correction runs under truncated sampling
    (top_p < 1, top_k > 0 or min_p > 0), or None. vLLM's sampled-token log-probs are then over each token's kept
    set and TRL 1.16's over the whole vocabulary, and TRL hands the trainer no kept sets (vLLM's sampling mask)
    to compute over: every ratio carries its token's kept mass."""
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False)):
        return None
    truncation = [f"{name}={value}" for name, value, off in (("top_p", args.top_p, 1.0), ("top_k", args.top_k, 0),
                                                             ("min_p", args.min_p, None))
                  if value not in (off, None, 0, 0.0, -1)]
    if not truncation:
        return None
    return ("grpo_fast: vLLM samples with " + ", ".join(truncation) + ", so its log-probs are over each token's "
            "kept set, while the trainer's are over the whole vocabulary: TRL hands over no kept sets (vLLM's "
            "sampling mask), so vllm_importance_sampling_correction's ratio exp(trainer - vLLM) is biased low by "
            "each token's kept mass (0.90 on average at top_p 0.9 on the tiny model, see docs/engines.md). Sample "
            "with top_p=1.0, top_k=0 and min_p=None, or train with grpo_fast's trainer, whose log-probs follow the "
            "engine's kept sets (grpo_fast.grpo_loss(..., transform=LogitTransform(kept=KeptSet(ids, offsets)))).")


class FastGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` (same constructor) with grpo_fast's log-probs, entropies and, where TRL's options allow,
    its fused loss: the gradient computed with the logits, 3 GEMM passes over the LM head instead of 4.

    The fused loss serves every loss type of `grpo_fast.LOSS_TYPES` at token level (vespo, and GSPO's sequence
    level, in two phases: 4 GEMM passes), KL, delta, the vLLM importance-sampling ratio, the entropy bonus (static
    or adaptive), gradient accumulation, rollouts replayed or cut into several optimizer steps (num_iterations,
    steps_per_generation: TRL's old log-probs and its generation batch's token count, tested by
    test_trl_dropin.py's test_steps_per_generation_matches_grpo_trainer), mixture-of-experts models (router aux
    loss), vision-language inputs (pixel values through the model's own forward) and DeepSpeed ZeRO-3. What remains
    (`fallback_reasons` lists it, and the constructor warns once) runs TRL's own loss on grpo_fast log-probs.
    Options the loss type never reads are ignored, as TRL ignores them; a value grpo_fast refuses is refused by the
    constructor, in one line.

    share_prompts (default False: on SmolLM2 it pays at short completions, 0.46x of TRL's update at 64 tokens
    against 0.80x padded, but not at 256, where its runs' generation was slower, unexplained; see docs/trl.md):
    the loss's forward holds each group's prompt once, as one packed row without padding in which every
    completion attends to its prompt and itself (grpo_fast.packed_attention.SharedPrompts); with
    G completions per prompt the trunk then runs P + G x C tokens instead of G x (P + C). It equals the padded
    forward up to rounding: the positions restart at 0 without the left padding, which RoPE does not see. It
    applies where it is exact: a decoder of SHARED_PROMPT_MODELS on sdpa attention (switched to grpo_fast's
    variable-length attention for the loss; TRL's generation and scoring run transformers' sdpa itself,
    attention.sdpa_while_generating), text batches, and no router aux loss (which counts padding by the
    attention mask); elsewhere, or with share_prompts=False, the padded batch runs as in TRL. The old and
    reference log-prob passes stay padded.
    """

    def __init__(self, *args, share_prompts: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        # What grpo_fast refuses is refused here, before any rollout: every log-prob takes the head's transform at
        # this temperature, and the fused loss the options its loss type reads (`loss_config`). Under ZeRO-3 the
        # head's weight is a partition until gathered (every rank constructs the trainer: the gather is collective).
        with gathered_lm_head(self.model):
            lm_head(unwrap(self.model)).transform(self.temperature)
        self.share_prompts = share_prompts and self._use_shared_prompt_attention()
        patch_grpo_trainer(self)
        reasons = self.fallback_reasons({})
        if not reasons:
            self.loss_config()
        if reasons:             # once, at construction: what this configuration leaves to TRL's loss, and why
            warnings.warn("grpo_fast: TRL's own loss code runs on grpo_fast's log-probs (4 GEMM passes, not the "
                          "fused loss) for: " + "; ".join(reasons), stacklevel=2)
        bias = truncated_sampling_bias(self.args)
        if bias:
            warnings.warn(bias, stacklevel=2)

    def _use_shared_prompt_attention(self) -> bool:
        """Switch the policy to grpo_fast's variable-length attention where prompts can be shared (see the class
        docstring); whether they can."""
        model = unwrap(self.model)
        # the top-level type: a vision-language model (its own type) keeps its encoders' attention untouched
        if model.config.model_type not in SHARED_PROMPT_MODELS or self.aux_loss_enabled:
            return False
        name = attention.attention_name(model)
        if name == "sdpa":
            model.set_attn_implementation(attention.register())
            name = attention.NAME
        return name == attention.NAME

    def _generate_and_score_completions(self, inputs):
        # padded and cached calls: transformers' own sdpa, which the loss's variable-length attention would only
        # hand them to, at a cost (attention.sdpa_while_generating)
        with attention.sdpa_while_generating(self.model):
            return super()._generate_and_score_completions(inputs)

    def fallback_reasons(self, inputs) -> list:
        """Every reason this batch (`{}`: this configuration) needs TRL's loss code; empty when the fused loss
        reproduces it."""
        reasons = []
        if self.loss_type not in LOSS_TYPES:
            reasons.append(f"loss_type={self.loss_type!r}")
        if self.loss_type == "vespo":
            args = self.args
            if min(args.vespo_k_pos, args.vespo_k_neg) < 0 or min(args.vespo_lambda_pos, args.vespo_lambda_neg) <= 0:
                reasons.append("vespo_k_* < 0 or vespo_lambda_* <= 0")
            # TRL sums log(ratio) over padding too, where grpo_fast sums over the mask: the same only where the
            # correction leaves the padding's ratio of exactly 1 alone.
            low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
            if self.use_vllm and self.vllm_importance_sampling_correction and (
                    (low is not None and low > 1) or (high is not None and high < 1)):
                reasons.append("vespo with vllm_importance_sampling_clip_min > 1 or "
                               "vllm_importance_sampling_clip_max < 1")
        return reasons

    def loss_config(self) -> LossConfig:
        """The fused loss's LossConfig from TRL's options, of those the loss type reads only: TRL never reads the
        others (vespo_* under dapo, sapo_* under grpo, ...), so their values are not checked either, and
        LossConfig's defaults stand in for them. A value read that grpo_fast refuses is a one-line ValueError
        naming the GRPOConfig field; the entropy bonus's coefficients are checked here too, as the loss takes them
        step by step."""
        args = self.args
        objective = LOSS_TYPES[self.loss_type][1]
        read = {"beta": (self.beta, "beta")}
        if self.beta != 0.0:                    # TRL reads the correction of the KL only
            read["use_bias_correction_kl"] = (bool(args.use_bias_correction_kl), "use_bias_correction_kl")
        epsilon_high = (self.epsilon_high, "epsilon" if args.epsilon_high is None else "epsilon_high")
        if objective == "clip":
            read.update(epsilon_low=(self.epsilon_low, "epsilon"), epsilon_high=epsilon_high,
                        delta=(args.delta, "delta"))
        elif objective == "cispo":
            read["epsilon_high"] = epsilon_high
        else:
            names = {"sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
                     "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}[objective]
            read.update({name: (getattr(args, name), name) for name in names})
        if self.loss_type == "dr_grpo":
            read["max_completion_length"] = (self.max_completion_length, "max_completion_length")
        coefficients = {}
        if self._entropy_bonus_enabled:
            names = ("entropy_coef", "entropy_coef_min", "entropy_coef_max") if self.use_adaptive_entropy \
                else ("entropy_coef",)
            coefficients = {name: getattr(args, name) for name in names}
        kinds, fields = hints(LossConfig), {item.name: item.metadata for item in dataclasses.fields(LossConfig)}
        checks = [(field, name, value) for field, (value, name) in read.items()]
        checks += [("entropy_coef", name, value) for name, value in coefficients.items()]
        for field, name, value in checks:
            check_value(name, value, kinds[field], fields[field]["rule"], fields[field]["choices"], "GRPOConfig")
        return LossConfig(loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
                          **{field: value for field, (value, _) in read.items()})

    def fused_loss_unsupported(self, inputs) -> str | None:
        """Why this batch needs TRL's loss code (the first reason of `fallback_reasons`), or None."""
        reasons = self.fallback_reasons(inputs)
        return reasons[0] if reasons else None

    def _compute_loss(self, model, inputs):
        if self.fused_loss_unsupported(inputs):
            return super()._compute_loss(model, inputs)
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        config = self.loss_config()
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        per_token_normalized = config.reduction == "num_items"
        num_items = None
        if per_token_normalized:        # TRL: the generation batch's token count, per process and window
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * accumulation / self.args.steps_per_generation
        entropy_coef = self.entropy_coef if self._entropy_bonus_enabled else 0.0
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            entropy_coef = 0.0          # as TRL: the bonus applies only while the last window's entropy is low
        if per_token_normalized:        # TRL divides the bonus, not the dapo / cispo term, by accumulation
            entropy_coef = entropy_coef / accumulation
        config = dataclasses.replace(config, entropy_coef=entropy_coef)      # this step's share of the bonus
        is_ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"].expand(mask.shape)
        old_logps, ref_logps = inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps")
        stats = {}
        bonus_mask = mask.float()        # the tokens the entropy bonus averages over: TRL's effective mask

        def loss_on_hidden(hidden, weight, bias, head):
            nonlocal bonus_mask
            transform = head.transform(self.temperature)
            hidden = hidden[:, -completion_ids.size(1):]
            keep = None
            if self.off_policy_mask_threshold is not None or self.top_entropy_quantile < 1.0:
                keep, high_entropy = self._policy_masks(hidden, weight, bias, transform, completion_ids, mask, inputs,
                                                        old_logps)
                if high_entropy is not None:
                    bonus_mask = bonus_mask * high_entropy
            return checked_policy_loss(
                hidden, weight, completion_ids, inputs["advantages"], mask, config=config, transform=transform,
                old_logps=old_logps, ref_logps=ref_logps, bias=bias, token_stats=stats, entropy_mask=bonus_mask,
                weights=TokenWeights(num_items_in_batch=num_items, is_ratio=is_ratio), policy_mask=keep)

        # A vision-language batch's image fields go to the model's own multimodal forward, whole, as TRL passes them
        # for a batch scored in one piece.
        multimodal = {key: inputs[key] for key in _MULTIMODAL_KEYS if inputs.get(key) is not None}
        # As TRL: router logits asked for on each call while the aux loss is on, whatever the config's
        # output_router_logits (False in released Qwen3-MoE configs, whose router_aux_loss_coef is nonzero).
        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        if self.share_prompts and not multimodal:       # one packed row, each group's prompt once
            model_inputs, predicting = attention.shared_prompt_row(input_ids, attention_mask, prompt_ids.size(1),
                                                                   completion_ids.size(1))
            model_inputs["hidden_index"] = predicting
        else:
            model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        (loss, _), aux_loss = model(**model_inputs, fused_lm_head=True, grpo_fast_loss=loss_on_hidden, **multimodal,
                                    **router)
        policy_loss = loss.detach()
        if not per_token_normalized:
            loss = loss / accumulation
        if self.aux_loss_enabled:      # as TRL: the router's load-balancing loss, divided by accumulation
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        if self.use_adaptive_entropy and mode == "train":
            self._adapt_entropy_coef(stats["entropy"], bonus_mask)
        self._log_metrics(mode, config, stats["logp"], stats["entropy"], mask, inputs, old_logps, ref_logps,
                          is_ratio, policy_loss + entropy_coef * masked_mean(stats["entropy"], bonus_mask))
        return loss

    def _adapt_entropy_coef(self, entropy, mask):
        """TRL's adaptive entropy controller, on the detached entropies of the fused loss: sum the window's masked
        entropy and token count over the accumulation steps; at the optimizer step, from the mean across processes,
        raise `entropy_coef` by `entropy_coef_delta` (up to `entropy_coef_max`) when it is at or below
        `entropy_target`, lower it (down to `entropy_coef_min`) otherwise. The new value applies from the next
        step; TRL saves and restores the state with its checkpoints."""
        window = torch.stack([(entropy * mask).sum(), mask.sum()])
        stats = self._entropy_window_stats
        self._entropy_window_stats = window if stats is None else stats + window
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _policy_masks(self, hidden, weight, bias, transform, completion_ids, mask, inputs, old_logps):
        """((B, T) 0/1 factor, (B, T) 0/1 high-entropy mask or None): TRL's off-policy sequence mask times its
        high-entropy token mask, and the latter alone, from a first pass over the LM head without gradients (one
        GEMM pass). Both multiply the policy term before the rollout correction and the KL, as TRL's do (for
        token-level objectives the loss folds them into the correction's factor, so the gradient pass stays fused:
        4 GEMM passes in all). The entropy bonus averages over the high-entropy tokens alone, as TRL's does."""
        keep = mask.bool()
        with torch.no_grad():
            logp_c, entropy_c = token_logprobs(hidden[keep], weight, completion_ids[keep], bias=bias,
                                               transform=transform, return_entropy=True)
        logp = logp_c.new_zeros(mask.shape).masked_scatter(keep, logp_c)
        factor, high_entropy = torch.ones_like(logp), None
        if self.top_entropy_quantile < 1.0:
            entropy = entropy_c.new_zeros(mask.shape).masked_scatter(keep, entropy_c)
            high_entropy = self.get_high_entropy_mask(entropy, mask, 1 - self.top_entropy_quantile).float()
            factor = factor * high_entropy
        if self.off_policy_mask_threshold is not None:
            advantages = inputs["advantages"]
            advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            sampling = inputs.get("sampling_per_token_logps", logp if old_logps is None else old_logps)
            factor = factor * self.get_off_policy_mask(advantages, logp, sampling, mask.float(),
                                                       self.off_policy_mask_threshold)
        return factor, high_entropy

    def _log_metrics(self, mode, config, logp, entropy, mask, inputs, old_logps, ref_logps, is_ratio, policy_loss):
        """The metrics TRL's `_compute_loss` logs, from the detached per-token values of the fused loss."""
        mask = mask.float()
        gather, metrics = self.accelerator.gather, self._metrics[mode]

        def global_masked_mean(x):
            if x.shape[1] == 1:     # one value per sequence: a mean over the sequences
                local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device, dtype=x.dtype)])
            else:
                local = torch.stack([(x * mask).sum(), mask.sum()])
            totals = self.accelerator.reduce(local, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old = logp if old_logps is None else torch.where(mask > 0, old_logps, 0.0)    # logp is 0 off the mask
        ratio = importance_ratio(logp, old, mask, config)       # (B, 1) at sequence level, as TRL's coef_1
        if config.beta != 0.0:
            kl = k3_kl(ref_logps, logp)
            metrics["kl"].append(global_masked_mean(kl * ratio if config.use_bias_correction_kl else kl))
        metrics["entropy"].append(global_masked_mean(entropy))
        if config.objective == "clip" and config.delta is not None:
            ratio = torch.clamp(ratio, max=config.delta)     # TRL flags clipping on the delta-capped ratio
        flags = {name: flag.float() for name, flag in clip_flags(ratio, advantages, config).items()}
        for name, flag in flags.items():
            metrics[name].append(global_masked_mean(flag))
        if config.objective == "clip":
            def per_sequence(x):        # NaN for empty rows of token flags, as TRL
                return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

            metrics["clip_ratio/low_min"].append(nanmin(gather(per_sequence(flags["clip_ratio/low_mean"]))).item())
            metrics["clip_ratio/high_max"].append(nanmax(gather(per_sequence(flags["clip_ratio/high_mean"]))).item())
        if config.objective == "vespo":
            phi = vespo_weights(logp, old, advantages, mask, is_ratio, config)
            metrics["vespo/phi_seq_mean"].append(global_masked_mean(phi))
        if self._entropy_bonus_enabled:
            metrics["policy_loss"].append(gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
