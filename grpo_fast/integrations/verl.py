"""verl's actor with grpo_fast computing the LM head's log-probs and, where verl's loss allows it, the actor loss
inside the vocabulary sweep. Loaded by verl's own hook for outside code:

    actor_rollout_ref.model.external_lib=grpo_fast.integrations.verl
    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=torch
    actor_rollout_ref.model.use_remove_padding=True

Importing this module patches verl 0.9 in place (`install()`; idempotent):

- The model forward that verl installs for `use_fused_kernels` on text models (`dense_common`'s
  `forward_with_torch_backend` and `forward_with_triton_backend`, chosen by `fused_kernel_options.impl_backend`)
  computes its log-probs and entropies with `grpo_fast.token_logprobs`, run as the `lm_head` module's forward:
  FSDP2 gathers an untied head around the call, where verl's own reads `lm_head.weight` outside the module and
  fails under FSDP2 ("mixed torch.Tensor and DTensor"). Old and reference log-probs cost 1 GEMM pass.
- The same forward also returns each token's sum_v p_v^2 when the micro-batch asks for `calculate_sum_pi_squared`
  (verl's optimal token baseline, `actor.calculate_sum_pi_squared=True`), from the same read of each chunk; the
  engine's `prepare_model_inputs` / `prepare_model_outputs` pass the request in and the values out, where verl's
  own refuses the combination with fused kernels ("fused kernels do not materialize the full logits").
- Under Ulysses sequence parallelism the forward computes each rank's shard, which verl gathers; it refuses an
  attention other than transformers' flash-attention forward, the only one verl's Ulysses exchange wraps.
- `FSDPEngineWithLMHead.forward_step`, when its loss is verl's `ppo_loss` with a token-separable policy loss
  (`FUSED_LOSS_MODES`): the micro-batch's whole actor loss runs inside the sweep, 3 GEMM passes instead of 4 and
  no (tokens, vocab) logits (`fused_ppo_loss`). Every other case runs verl's own loss on grpo_fast's log-probs
  (two phases, 4 passes), with one warning naming what it leaves to verl.

- With megatron.core importable, verl's Megatron fused forwards (`model_forward_fused`, and
  `model_forward_1f1b_overlap`) call `megatron_linear_cross_entropy`: `token_logprobs` on the tensor-parallel
  group's vocabulary-parallel head, with verl's kernel's contract. The Megatron actor's loss stays verl's own.

The loss inside the sweep is verl's own code, not a copy: for each chunk of tokens, verl's `ppo_loss` (its
policy loss, clamps, rollout IS weights, entropy bonus, KL and `agg_loss` normalizers with dp_size and the
global token and sequence counts) is evaluated on the micro-batch's log-probs with that chunk's entries as the
variables, and autograd gives d(loss)/d(logp) of those entries. For a token-separable loss that gradient depends
on the chunk's own log-probs alone, so it is the final one; the loss value and verl's metrics come from one more
evaluation on all the log-probs after the sweep. A loss that needs every token first (gspo's sequence ratio,
clip_cov's and kl_cov's batch-wide token selection, geo_mean, bypass_mode's rejection masks) is not
token-separable and stays two-phase.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from grpo_fast.integrations import peer_import_error
from grpo_fast.logprobs import token_logprobs
from grpo_fast.numerics import LogitTransform
from grpo_fast.options import Execution
from grpo_fast.token_loss import batch_token_loss, fused_token_loss

try:
    import verl
    from verl.models.transformers import dense_common
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.utils import losses
    from verl.workers.utils.padding import no_padding_2_padding
except ImportError as error:
    raise peer_import_error(
        error, __name__, peer="verl", package="verl",
        install="grpo_fast.integrations.verl needs verl (pip install --no-deps 'verl==0.9.1', see docs/verl.md)",
        dependencies="pip install -r requirements-verl.txt installs those verl 0.9.1 needs, as tested; see "
                     "docs/verl.md") from error

TESTED_VERL = ("0.9.",)
if not str(getattr(verl, "__version__", "")).startswith(TESTED_VERL):
    raise ImportError(f"grpo_fast.integrations.verl is tested with verl 0.9.x, got verl {verl.__version__}: its "
                      f"engine and loss internals, which this module patches, change between minor releases")

# verl policy losses whose per-token loss depends on that token's log-prob alone (times normalizers known up front)
FUSED_LOSS_MODES = frozenset({"vanilla", "dppo_tv", "dppo_kl", "sapo", "gpg", "cispo", "dro"})

_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def as_head_forward(head: torch.nn.Module, fn, *args):
    """fn(head, *args) run as head's forward, so that the module's hooks wrap it: FSDP2's unshard / reshard (and
    the pre-backward unshard on its outputs), ZeRO-3's gather. The head's own forward is restored after."""
    had_own = "forward" in head.__dict__
    own = head.__dict__.get("forward")
    head.forward = functools.partial(fn, head)
    try:
        return head(*args)
    finally:
        if had_own:
            head.forward = own
        else:
            del head.forward


@dataclass
class OutputForPPOWithSumPiSquared(dense_common.CausalLMOutputForPPO):
    """verl's fused-forward output with each position's sum_v p_v^2 (None unless asked for)."""

    sum_pi_squared: Optional[torch.FloatTensor] = None


def _head_logprobs(head, hidden, labels, temperature, with_sum_pi_squared=False):
    """(logp, entropy, sum_pi_squared or None) of the head's next-token distribution."""
    out = token_logprobs(hidden, head.weight, labels, bias=head.bias, transform=LogitTransform(temperature=temperature),
                         return_entropy=True, return_sum_pi_squared=with_sum_pi_squared)
    return out if with_sum_pi_squared else (*out, None)


def check_ulysses_attention(config) -> None:
    """Refuse a model whose attention verl's Ulysses does not reach: verl exchanges sequence shards for heads only
    in its wrapper of transformers' flash-attention forward (`_ulysses_flash_attention_forward`), so under any other
    attention (sdpa, eager, flex) each rank attends within its own shard of the packed row, silently."""
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = getattr(config, "_attn_implementation", None)
    attention = ALL_ATTENTION_FUNCTIONS.get(implementation) if implementation else None
    if getattr(attention, "func", attention) is not flash_attention_forward:
        raise ValueError(f"attn_implementation must run transformers' flash-attention forward under Ulysses "
                         f"sequence parallelism (verl's exchange wraps only that; others attend within each rank's "
                         f"shard), got {implementation!r}")


def forward_with_grpo_fast(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                           inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                           output_hidden_states=None, return_dict=None, cache_position=None, logits_to_keep=0,
                           temperature: float = 1.0, shift_labels=None, grpo_fast_loss=None,
                           grpo_fast_sum_pi_squared: bool = False, **loss_kwargs):
    """verl's `forward_with_torch_backend` contract (CausalLMOutputForPPO with log_probs and entropy of the next
    token at every position, (B, T) fp32) with grpo_fast's head; `grpo_fast_loss` (set by the patched
    forward_step) makes the head compute a fused loss instead, returned as the output's `loss`;
    `grpo_fast_sum_pi_squared` (set by the patched prepare_model_inputs) adds each position's sum_v p_v^2. Under
    Ulysses the inputs and `shift_labels` are this rank's shard (verl rolls the labels over the whole row first),
    and so are the outputs, which verl gathers; `check_ulysses_attention` refuses an attention verl's Ulysses
    does not exchange."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

    if get_ulysses_sequence_parallel_world_size() > 1:
        check_ulysses_attention(self.config)
    outputs = dense_common.forward_base_model(
        self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
        output_attentions=output_attentions, output_hidden_states=output_hidden_states, cache_position=cache_position)
    hidden = outputs[0]
    if not return_dict:
        raise NotImplementedError("forward_with_grpo_fast returns a dict (verl passes return_dict=True)")
    if shift_labels is not None:            # the engine's labels, rolled over the whole packed sequence
        rolled = shift_labels
    elif labels is not None:
        rolled = torch.roll(labels, shifts=-1, dims=-1)
    elif input_ids is not None:
        rolled = torch.roll(input_ids, shifts=-1, dims=-1)
    else:
        raise ValueError("forward_with_grpo_fast needs labels, shift_labels or input_ids, got none of them")
    loss = sum_pi_squared = None
    if grpo_fast_loss is None:
        log_probs, entropy, sum_pi_squared = as_head_forward(self.lm_head, _head_logprobs, hidden, rolled,
                                                             temperature, grpo_fast_sum_pi_squared)
    else:
        loss, log_probs, entropy = as_head_forward(self.lm_head, grpo_fast_loss, hidden, rolled, temperature)
    return OutputForPPOWithSumPiSquared(loss=loss, log_probs=log_probs, entropy=entropy,
                                        past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
                                        attentions=outputs.attentions, sum_pi_squared=sum_pi_squared)


def fusable(loss_function) -> Optional[str]:
    """None when `loss_function` is verl's ppo_loss with a token-separable policy loss, else why not (one line)."""
    if not (isinstance(loss_function, functools.partial) and loss_function.func is losses.ppo_loss):
        return f"the loss function {getattr(loss_function, '__name__', loss_function)!r} is not verl's ppo_loss"
    mode = loss_function.keywords["config"].policy_loss.get("loss_mode", "vanilla")
    if mode not in FUSED_LOSS_MODES:
        return f"policy loss {mode!r} is not token-separable (fused: {', '.join(sorted(FUSED_LOSS_MODES))})"
    return None


def fused_ppo_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, data, config, *,
                   bias: Optional[torch.Tensor] = None, temperature: float = 1.0, with_entropy: bool = False,
                   execution: Optional[Execution] = None):
    """verl's `ppo_loss(config, {"log_probs": logp, "entropy": entropy}, data)` with logp, entropy the next-token
    log-probs and entropies of softmax((hidden @ weight.T + bias) / temperature) at each packed position, computed
    inside the vocabulary sweep: 3 GEMM passes (2 for a frozen head), no (tokens, vocab) logits, and only the
    response tokens that count go through the head.

    Args:
        hidden: (1, N, H) or (N, H), the packed micro-batch's final hidden states (verl's remove-padding layout).
        weight: (V, H), bias: optional (V,), the LM head. labels: N token ids, the packed input ids rolled by one.
        data: the micro-batch TensorDict verl's ppo_loss reads (responses, prompts, response_mask, old_log_probs,
            advantages, optional ref_log_prob and rollout_is_weights, dp_size, batch_num_tokens,
            global_batch_size).
        config: verl's ActorConfig; its policy_loss.loss_mode must be in FUSED_LOSS_MODES.
        with_entropy: compute the entropies (verl's calculate_entropy), which adds its entropy bonus.
        execution: chunk budget and backend of the sweep (`grpo_fast.Execution`; None: the defaults).

    Returns:
        (loss, metrics, log_probs, entropy): loss a 0-dim fp32 tensor equal to verl's, differentiable with respect
        to hidden, weight and bias; metrics verl's own dict; log_probs and entropy (N,) detached, filled at the
        response positions (0 elsewhere; entropy None without with_entropy).
    """
    mode = config.policy_loss.get("loss_mode", "vanilla")
    if mode not in FUSED_LOSS_MODES:
        raise ValueError(f"fused_ppo_loss needs a token-separable policy loss ({', '.join(sorted(FUSED_LOSS_MODES))}),"
                         f" got loss_mode {mode!r}: run verl's ppo_loss on token_logprobs instead")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    num_tokens = flat_labels.numel()
    if flat_hidden.shape[0] != num_tokens:
        raise ValueError(f"labels must hold one id per hidden row ({flat_hidden.shape[0]}), got {num_tokens}")
    offsets = data["input_ids"].offsets()
    if int(offsets[-1]) != num_tokens:
        raise ValueError(f"hidden must hold the micro-batch's {int(offsets[-1])} packed tokens, got {num_tokens}")
    # verl's own layout conversions: the packed position of each (bsz, max_response_len) response token's
    # log-prob (no_padding_2_padding of the positions), and ppo_loss's padded fields
    positions = no_padding_2_padding(torch.arange(num_tokens, device=hidden.device), data).long()
    padded = data.select("response_mask", "old_log_probs").to_padded_tensor()
    response_mask = padded["response_mask"].to(device=hidden.device, dtype=torch.bool)
    used = positions[response_mask]
    counted = torch.zeros(num_tokens, dtype=torch.bool, device=hidden.device)
    counted[used] = True
    # every token's log-prob starts at its old one (ratio 1); the sweep writes its own in (batch_token_loss)
    logp_all = torch.zeros(num_tokens, dtype=torch.float32 if hidden.dtype != torch.float64 else torch.float64,
                           device=hidden.device)
    logp_all[used] = padded["old_log_probs"].to(device=hidden.device, dtype=logp_all.dtype)[response_mask]
    entropy_all = torch.zeros_like(logp_all) if with_entropy else None

    def verl_loss(logp, entropy):
        out = {"log_probs": torch.nested.nested_tensor_from_jagged(logp, offsets)}
        if entropy is not None:
            out["entropy"] = torch.nested.nested_tensor_from_jagged(entropy, offsets)
        return losses.ppo_loss(config, out, data)

    carrier = fused_token_loss(flat_hidden, weight, flat_labels,
                               batch_token_loss(lambda logp, entropy: verl_loss(logp, entropy)[0], logp_all,
                                                entropy_all),
                               mask=counted, bias=bias, transform=LogitTransform(temperature=temperature),
                               execution=execution, with_entropy=with_entropy)
    with torch.no_grad():
        value, metrics = verl_loss(logp_all, entropy_all)
    loss = carrier + value.detach().to(carrier.dtype)
    return loss, metrics, logp_all, entropy_all


def _fused_step(self, micro_batch, loss_function):
    """FSDPEngineWithLMHead.forward_step's work with the actor loss inside the sweep (see fused_ppo_loss)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id, get_device_name

    device_name = get_device_name()
    micro_batch = micro_batch.to(get_device_id())
    model_inputs, output_args = self.prepare_model_inputs(micro_batch=micro_batch)
    config = loss_function.keywords["config"]
    with_entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
    pad_size = output_args.get("pad_size", 0)
    results = {}

    def head_loss(head, hidden, labels, temperature):
        num_tokens = hidden.shape[-2] - pad_size          # the engine's static padding is a suffix
        loss, metrics, logp, entropy = fused_ppo_loss(
            hidden[..., :num_tokens, :], head.weight, labels[..., :num_tokens], micro_batch, config,
            bias=head.bias, temperature=temperature, with_entropy=with_entropy)
        results["metrics"] = metrics
        return loss, logp, entropy

    model_inputs["grpo_fast_loss"] = head_loss
    autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
    autocast = nullcontext() if autocast_dtype == torch.float32 else \
        torch.autocast(device_type=device_name, dtype=autocast_dtype)
    with autocast:
        raw = self.module(**model_inputs, use_cache=False)
    offsets = micro_batch["input_ids"].offsets()
    model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(raw.log_probs, offsets)}
    if raw.entropy is not None:
        model_output["entropy"] = torch.nested.nested_tensor_from_jagged(raw.entropy, offsets)
    return raw.loss, {"model_output": model_output, "loss": raw.loss.detach().item(), "metrics": results["metrics"]}


def _unfusable_reason(self, micro_batch, loss_function, forward_only) -> Optional[str]:
    """None where _fused_step applies, else why not."""
    from verl.utils import tensordict_utils as tu

    if forward_only or loss_function is None:
        return "forward only"                           # old / reference log-probs: the log-prob op, 1 pass
    reason = fusable(loss_function)
    if reason:
        return reason
    for key, wanted in (("use_fused_kernels", True), ("use_remove_padding", True)):
        if bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=key == "use_remove_padding")) != wanted:
            return f"{key} is not {wanted}"
    if getattr(self, "use_ulysses_sp", False):
        return "Ulysses sequence parallelism (the loss needs the gathered log-probs)"
    if getattr(type(self.module), "forward", None) is not forward_with_grpo_fast:
        return ("the model's forward is not grpo_fast's (verl installs it for use_fused_kernels with "
                "fused_kernel_options.impl_backend torch or triton, on text models)")
    for key in ("distillation_use_topk", "distillation_only", "calculate_sum_pi_squared"):
        if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
            return f"{key} is set"
    return None


_original_forward_step = None
_original_prepare_inputs = None
_original_prepare_outputs = None


def _wants_fused_sum_pi_squared(self, micro_batch) -> bool:
    from verl.utils import tensordict_utils as tu

    return (bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=False))
            and bool(tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False))
            and getattr(type(self.module), "forward", None) is forward_with_grpo_fast)


def prepare_model_inputs(self, micro_batch):
    """verl's, plus the request for sum_v p_v^2 to grpo_fast's forward (see `prepare_model_outputs`)."""
    model_inputs, output_args = _original_prepare_inputs(self, micro_batch)
    if _wants_fused_sum_pi_squared(self, micro_batch):
        model_inputs["grpo_fast_sum_pi_squared"] = True
    return model_inputs, output_args


@contextmanager
def _without_sum_pi_squared(micro_batch):
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(micro_batch, calculate_sum_pi_squared=False)
    try:
        yield
    finally:
        tu.assign_non_tensor(micro_batch, calculate_sum_pi_squared=True)


def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
    """verl's, and where fused kernels ran grpo_fast's forward with sum_v p_v^2 asked for, that output laid out as
    verl lays out the log-probs (verl's own refuses fused kernels with calculate_sum_pi_squared)."""
    from verl.utils import tensordict_utils as tu

    sum_pi_squared = getattr(output, "sum_pi_squared", None)
    if sum_pi_squared is None or not _wants_fused_sum_pi_squared(self, micro_batch):
        return _original_prepare_outputs(self, output, output_args, micro_batch, logits_processor_func)
    with _without_sum_pi_squared(micro_batch):
        model_output = _original_prepare_outputs(self, output, output_args, micro_batch, logits_processor_func)
    offsets = micro_batch["input_ids"].offsets()
    if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
        values = self._gather_and_unpad_packed(sum_pi_squared.squeeze(0), output_args["pad_size"])
    else:                                    # (B, T) rows: each sequence's first length entries, as verl's log-probs
        lengths = offsets.diff()
        values = sum_pi_squared[torch.arange(sum_pi_squared.shape[1], device=lengths.device) < lengths[:, None]]
    model_output["sum_pi_squared"] = torch.nested.nested_tensor_from_jagged(values, offsets)
    return model_output


def forward_step(self, micro_batch, loss_function, forward_only):
    """verl's FSDPEngineWithLMHead.forward_step, with the actor loss fused where `_unfusable_reason` is None."""
    reason = _unfusable_reason(self, micro_batch, loss_function, forward_only)
    if reason is None:
        return _fused_step(self, micro_batch, loss_function)
    if reason != "forward only":
        _warn_once(f"grpo_fast.integrations.verl: the actor loss runs as verl's own on grpo_fast's log-probs "
                   f"(two phases, 4 GEMM passes) because {reason}")
    return _original_forward_step(self, micro_batch, loss_function, forward_only)


class _ShareOverGroup(torch.autograd.Function):
    """Identity forward; the backward hands each of the group's ranks 1/size of the gradient."""

    @staticmethod
    def forward(ctx, hidden, size):
        ctx.size = size
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.size, None


def megatron_linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none",
                                  dist_process_group=None):
    """verl's `verl.utils.kernel.linear_cross_entropy` contract, which verl's Megatron fused forward calls with the
    tensor-parallel group, on grpo_fast's vocabulary-parallel head::

        z = hidden.flatten(0, -2) @ full_weight.T / temperature        # full_weight: every rank's rows, in order
        logp = z.log_softmax(-1).gather(-1, labels.flatten()[:, None])[:, 0]
        entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)

    Args:
        hidden: (..., H), the same on every rank of the group (Megatron gathers a sequence-parallel one first).
        weight: (V_local, H): this rank's rows of the output layer.
        labels: hidden.shape[:-1] elements (any shape), global token ids.
        temperature: a float. reduction: only "none", what verl's Megatron path passes.
        dist_process_group: the tensor-parallel group, or None for a whole head on one device.

    Returns:
        (logp, entropy), (N,), fp32 (float64 for float64 inputs). As with verl's kernel, the d(hidden) of each
        rank is its share of the gradient, which the caller sums over the group (the backward of Megatron's
        sequence-parallel gather does): grpo_fast's head all-reduces d(hidden), and each rank keeps 1/size of it.
        Tensor parallelism without sequence parallelism leaves that sum to no one, here as with verl's kernel.
    """
    if reduction != "none":
        raise ValueError(f"megatron_linear_cross_entropy: reduction must be 'none' (what verl's Megatron forward "
                         f"passes), got {reduction!r}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    if flat_labels.shape[0] != flat_hidden.shape[0]:
        raise ValueError(f"megatron_linear_cross_entropy: labels must hold one id per hidden row, "
                         f"{flat_hidden.shape[0]}, got {flat_labels.shape[0]} (shape {tuple(labels.shape)})")
    if dist_process_group is not None:
        size = torch.distributed.get_world_size(dist_process_group)
        if size > 1:
            flat_hidden = _ShareOverGroup.apply(flat_hidden, size)
        else:
            dist_process_group = None
    return token_logprobs(flat_hidden, weight, flat_labels, transform=LogitTransform(temperature=float(temperature)),
                          execution=Execution(process_group=dist_process_group), return_entropy=True)


def _install_megatron() -> bool:
    """Point verl's Megatron fused forwards at megatron_linear_cross_entropy; False when megatron.core is absent."""
    try:
        from verl.models.mcore import model_forward_1f1b_overlap, model_forward_fused
    except ImportError:
        return False
    model_forward_fused.linear_cross_entropy = megatron_linear_cross_entropy
    model_forward_1f1b_overlap.linear_cross_entropy = megatron_linear_cross_entropy
    return True


def install() -> None:
    """Patch verl (see the module docstring); calling it again changes nothing."""
    global _original_forward_step, _original_prepare_inputs, _original_prepare_outputs
    _install_megatron()
    # both of verl's fused-kernel backends: its triton one's kernels are verl's own, and the head is grpo_fast's
    dense_common.forward_with_torch_backend = forward_with_grpo_fast
    dense_common.forward_with_triton_backend = forward_with_grpo_fast
    engine = transformer_impl.FSDPEngineWithLMHead
    if engine.forward_step is not forward_step:
        _original_forward_step = engine.forward_step
        engine.forward_step = forward_step
    if engine.prepare_model_inputs is not prepare_model_inputs:
        _original_prepare_inputs = engine.prepare_model_inputs
        engine.prepare_model_inputs = prepare_model_inputs
    if engine.prepare_model_outputs is not prepare_model_outputs:
        _original_prepare_outputs = engine.prepare_model_outputs
        engine.prepare_model_outputs = prepare_model_outputs


install()
