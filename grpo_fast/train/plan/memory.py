"""The memory model: how much memory a GRPO job needs, per component, before it is launched.

    shape = PRESETS["qwen2.5-1.5b"]                      # or ModelShape.from_config("config.json")
    job = Job(prompt_length=512, completion_length=16384, group_size=8, micro_batch_size=1, loss="grpo_fast")
    estimate = plan(shape, job, CARDS["H100 80GB"])      # {"weights": bytes, ..., "total": bytes} on that card
    fits(shape, job)                                     # card -> (fits, needed bytes, peak bytes)

The training peak is reached in the backward pass of a micro-batch, once gradients and optimizer states exist:

    weights + gradients + fp32 gradient sum + optimizer states + reference model + autocast weight copies
        + max(activations + loss buffers + attention mask of one training micro-batch, one no-grad log-prob pass)
        + runtime

The fp32 gradient sum is counted for bf16 weights with more than one micro-batch per step (one process sums the
micro-batches' gradients in fp32: grpo_fast.train.update.step.Fp32GradientSum), 4 bytes per trainable parameter.
The HF engine in the trainer's process (max_staleness 0) generates before the update, with gradients freed: a
second peak of weights + optimizer states + reference model + runtime + its KV cache (one model.generate call for
all of the step's prompts: prompts_per_step x group_size sequences at prompt + completion tokens, in the weights'
dtype) + one decode step's logits of those rows; the plan's peak is the higher of the two (its prefill's transient
activations are not counted). With max_staleness >= 1 the engine runs in its own process on the same device while
the trainer updates: the HF engine's weights, KV cache, decode step's logits, the sampling log-probs its sampler
takes as it draws (a buffer of fp32 values, one a sampled token, not the logits of every step) and a second
runtime are added (rollout_*); vLLM's weights and cache are in its pool either way (fits_in adds the pool).
With vllm_sleep (max_staleness 0) vLLM sleeps through the update: the card then needs the higher of the training
peak plus what a sleeping vLLM keeps (VLLM_ASLEEP) and, at generation, its pool beside what the trainer holds
between updates (HELD_BETWEEN_UPDATES).

Per GPU under torchrun (Job.gpus processes, sequence_parallel ranks a group): the step's prompts are split over
gpus / sequence_parallel data-parallel groups, so the step's batch, kept sets, KV caches and micro-batches are
those of prompts_per_step / (gpus / sequence_parallel) prompts (Job.prompts_per_rank); DDP keeps full replicas
and its gradient buckets, FSDP2 shards weights, gradients and optimizer states over all gpus ranks and adds what it
keeps unsharded (_replicas_or_shards); the KL reference is a full copy on every rank (the trainer deep-copies the
model before wrapping it: grpo_fast.train.loop.training_policies); a micro-batch's activations, loss buffers and
no-grad pass are those of its tokens / sequence_parallel, plus sequence parallelism's own buffers
(_micro_batch_peak). The fp32 gradient sum is one process's alone.

Activation bytes per token per decoder layer are counted from what a Hugging Face Llama / Qwen2 layer saves for
backward (norms in fp32, q/k/v, the rotary products, the attention output, the MLP's gate, up and their
products), with the attention the trainer selects (grpo_fast.packed_attention): flash-attention or one sdpa per
packed sequence, no (T x T) scores. A mask is counted where one is built: a padded micro-batch of several rows
gets a (b, 1, L, L) bool mask from transformers (sdpa, and the per-sequence attention, which hands padded batches
to sdpa; not flash-attention), which PyTorch's sdpa turns into an additive mask of the compute dtype in each
layer; plain sdpa over a packed row (attention="sdpa", the old default) gets a dense (1, 1, N, N) one over all N
tokens of the micro-batch. Gradient checkpointing keeps each layer's input and recomputes one layer at a time.
The loss buffers are what each implementation holds for the micro-batch's completion tokens: the full logits and
their fp32 copies (naive), TRL 1.16's fused LM head tile, or grpo_fast's chunk buffer, whose default budget on
CUDA depends on the card (grpo_fast.chunked.cuda_chunk_bytes).
Constants are checked against measured peaks (tests/test_memory_plan.py on CPU, benchmarks/long_context.py), not
guessed. The plan counts live tensors (what CUDA's allocator reports); on CPU, glibc's default allocator keeps
freed blocks below its rising mmap threshold (up to 32 MiB) in the process, so peak RSS can exceed the plan by
much (SmolLM2-135M at 4k tokens: 5.1 GiB of RSS for 2.7 GiB live); the benchmark fixes the threshold
(--malloc-mmap-threshold) where it compares.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from grpo_fast import chunked
from grpo_fast.backends import torch_ops
from grpo_fast.packed_attention import choose_attention
from grpo_fast.train.distributed import check_data_groups, check_processes, check_sequence_parallel
from grpo_fast.train.qlora import check_4bit, quantized_bytes
from grpo_fast.train.rollout.config import check_sampling, check_vllm_sleep
from grpo_fast.train.update import optimizer, precision

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that decide its memory, and its context: max_position_embeddings
    (None: unknown, not checked) and the RoPE parameters of its own config (rope_parameters, or the older
    rope_scaling), which the planner checks a job's lengths against as the trainer does."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: Optional[int] = None
    attention_bias: bool = False
    max_position_embeddings: Optional[int] = None
    rope_parameters: Optional[dict] = field(default=None, hash=False)
    qk_norm: bool = False                 # Qwen3: an RMSNorm weight of head_dim on each head's query and key

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def q_dim(self) -> int:
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    def linear_shapes(self) -> list:
        """(in, out) of every linear layer of one decoder layer (what LoRA adapts)."""
        h, i = self.hidden_size, self.intermediate_size
        return [(h, self.q_dim), (h, self.kv_dim), (h, self.kv_dim), (self.q_dim, h), (h, i), (h, i), (i, h)]

    def layer_parameters(self) -> int:
        """Parameters of one decoder layer: its linear layers, two RMSNorms, the q/k/v biases (Qwen2) and the
        per-head query and key norms (Qwen3)."""
        per_layer = sum(a * b for a, b in self.linear_shapes()) + 2 * self.hidden_size
        if self.attention_bias:
            per_layer += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            per_layer += 2 * self.head_size
        return per_layer

    def num_parameters(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_parameters() + embeddings + self.hidden_size

    @classmethod
    def from_config(cls, path: str) -> "ModelShape":
        """From a Hugging Face config.json (a text_config inside a multimodal config is used). A file that is not
        such a config raises ValueError naming the file and what is wrong with it."""
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except OSError as error:
            raise ValueError(f"{path}: cannot be read ({error.strerror or error})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a config.json (not UTF-8 text)") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error.msg} at line {error.lineno}, column "
                             f"{error.colno})") from None
        if isinstance(config, dict) and config.get("text_config") is not None:
            config = config["text_config"]
            where = "text_config"
        else:
            where = "a config.json"
        if not isinstance(config, dict):
            raise ValueError(f"{path}: {where} must be a JSON object, got a JSON {_json_type(config)}")

        def count(key, default=None):
            value = config.get(key)
            if value is None:                     # absent, or null as some configs write for "the default"
                if default is not None:
                    return default
                raise ValueError(f"{path}: a decoder config needs {key!r}")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{path}: {key} must be a positive integer, got {_short(value)}")
            return value

        def flag(key, default):
            value = config.get(key)
            if value is None:
                return default
            if not isinstance(value, bool):
                raise ValueError(f"{path}: {key} must be true or false, got {_short(value)}")
            return value

        hidden, intermediate, layers = count("hidden_size"), count("intermediate_size"), count("num_hidden_layers")
        heads = count("num_attention_heads")
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        if rope is not None and not isinstance(rope, dict):
            raise ValueError(f"{path}: rope_scaling must be a JSON object or null, got {_short(rope)}")
        if rope is not None and "rope_type" not in rope and "type" in rope:    # the older name: transformers reads it
            rope = {**rope, "rope_type": rope["type"]}
        return cls(hidden_size=hidden, intermediate_size=intermediate, num_layers=layers, num_heads=heads,
                   num_kv_heads=count("num_key_value_heads", default=heads), vocab_size=count("vocab_size"),
                   tie_word_embeddings=flag("tie_word_embeddings", False),
                   head_dim=None if config.get("head_dim") is None else count("head_dim"),
                   attention_bias=flag("attention_bias", config.get("model_type") == "qwen2"),
                   max_position_embeddings=None if config.get("max_position_embeddings") is None else
                   count("max_position_embeddings"), rope_parameters=rope,
                   qk_norm=config.get("model_type") == "qwen3")


def _json_type(value) -> str:
    """The JSON name of a parsed JSON value's type, for error messages."""
    for kind, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array"),
                       (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null"


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Each preset is the Instruct checkpoint's config.json on the Hugging Face hub (Qwen/Qwen2.5-*-Instruct,
# meta-llama/Llama-3.1-8B-Instruct), its context included: max_position_embeddings, and Llama 3.1's own RoPE
# scaling (rope_type llama3, which its 131072 positions already count). Other checkpoints of a family share the
# shape but not always the context (the Qwen2.5-1.5B and -7B bases declare 131072): fit.training_shape keeps it for
# the Instruct ones alone.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
PRESETS = {
    "qwen2.5-0.5b": ModelShape(896, 4864, 24, 14, 2, 151936, tie_word_embeddings=True, attention_bias=True,
                               max_position_embeddings=32768),
    "qwen2.5-1.5b": ModelShape(1536, 8960, 28, 12, 2, 151936, tie_word_embeddings=True, attention_bias=True,
                               max_position_embeddings=32768),
    "qwen2.5-7b": ModelShape(3584, 18944, 28, 28, 4, 152064, attention_bias=True, max_position_embeddings=32768),
    "llama-3.1-8b": ModelShape(4096, 14336, 32, 32, 8, 128256, max_position_embeddings=131072,
                               rope_parameters=LLAMA3_ROPE),
    # deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B's config.json: Qwen2.5-Math-1.5B's shape, its own LM head, 131072
    # positions (examples/long_reasoning_16k.yaml)
    "deepseek-r1-distill-qwen-1.5b": ModelShape(1536, 8960, 28, 12, 2, 151936, attention_bias=True,
                                                max_position_embeddings=131072),
    # Qwen/Qwen3-8B's config.json (the post-trained checkpoint; Qwen3-8B-Base is another): head_dim 128 (not
    # hidden / heads), no q/k/v bias, q_norm / k_norm per head, its own LM head, 40960 positions without rope_scaling
    # (trained at 32768; Qwen documents YaRN factor 4 over original_max_position_embeddings 32768 for 131072)
    "qwen3-8b": ModelShape(4096, 12288, 36, 32, 8, 151936, head_dim=128, max_position_embeddings=40960,
                           qk_norm=True),
}
# presets that are one checkpoint, not a family: their context holds for the name itself
CHECKPOINT_PRESETS = ("deepseek-r1-distill-qwen-1.5b", "qwen3-8b")

# Bytes each card offers: the total CUDA reports (torch.cuda.mem_get_info, the "total capacity" in PyTorch's
# out-of-memory message), at the low end of what drivers report. The "GB" in the names are the vendors' labels,
# neither decimal GB nor GiB of usable memory: an H200 "141GB" reports 139.7 GiB (150e9 bytes), an "80GB" card
# 79.1 GiB. vLLM's pool is a share of this same total. The 24 GB row is the smaller of its two cards (L4 22.0 GiB,
# RTX 4090 23.5 GiB), so that "fits" holds on both.
CARDS = {"24 GB (RTX 4090 / L4)": int(22.0 * GIB), "A100 40GB": int(39.4 * GIB), "A100 80GB": int(79.1 * GIB),
         "H100 80GB": int(79.1 * GIB), "H200 141GB": int(139.7 * GIB)}
DTYPES = tuple(name for name in precision.DTYPES if name != "auto")      # a plan is for one device
OPTIMIZERS = optimizer.OPTIMIZERS
LOSSES = ("naive", "trl", "grpo_fast")
ENGINES = ("vllm", "hf")

# Elements saved for backward per token by one decoder layer of Hugging Face's Llama / Qwen2 in eager PyTorch:
#   x hidden_size (17): 2 RMSNorms x 3 (input, normalized, output), q, rotate_half(q), rotated q, k and v repeated
#       to all heads (2), contiguous copies for attention (3), attention output and its reshaped copy (2)
#   x kv_dim (4): k, v, rotate_half(k), rotated k
#   x intermediate_size (6): gate, up, silu(gate), silu(gate) * up, and the backward's two gradients of that size
# With checkpointing, one layer is recomputed at a time and its backward frees what it has used as it goes: the
# peak holds RECOMPUTE_PEAK of that layer's saved tensors. Both fitted to peak RSS on CPU
# (benchmarks/long_context.py at hidden 256, 2 layers, kv_dim 128, intermediate 512, 1k-32k tokens: about 70 KB
# per token without checkpointing, 26 KB with it).
SAVED_PER_HIDDEN = 17
SAVED_PER_KV = 4
SAVED_PER_INTERMEDIATE = 6
RECOMPUTE_PEAK = 0.6
NAIVE_LOGIT_COPIES = 3          # fp32 logits, log_softmax saved for backward, its gradient (and the GEMM output)
TRL_TILE = (4096, 32768)        # tokens x vocabulary columns of TRL 1.16's ChunkedLogProbFunction tile
TRL_TILE_COPIES = 3
CUDA_CONTEXT = 600 * 2**20      # CUDA context and cuBLAS workspaces
# bytes per logit of one HF decode step beyond the model's output: the fp32 next-token scores, the processors'
# fp32 copy, top-p's sorted values (fp32) and indices (int64)
GENERATE_LOGIT_BYTES = 4 + 4 + 4 + 8
# a rollout process's sampling log-probs, taken by the sampler as it draws (grpo_fast.train.rollout.sampling) over
# the decode step's own buffers: per sampled token an fp32 value in a buffer that doubles when full (up to twice
# the tokens)
LOGP_TOKEN_BYTES = 2 * 4
# What vLLM keeps on the card asleep (sleep level 1 frees the weights and KV cache it allocated in its pool): its
# CUDA graphs and the buffers allocated outside the pool. An estimate, not measured: the GPU window's vllm_sleep
# phase (benchmarks/gpu_window.sh) measures the card's free memory before and after a sleep.
VLLM_ASLEEP = 1 * GIB
# the components the trainer holds on the card between two updates, while an engine generates (gradients are
# freed by zero_grad(set_to_none=True); DDP's buckets live for the whole run; FSDP2 gathers layers as they run)
HELD_BETWEEN_UPDATES = ("weights", "optimizer", "ddp_gradient_buckets", "fsdp2_gathered", "reference_model",
                        "kept_sets", "runtime")
# What a CPU step holds beyond the tensors counted: nothing to add. With glibc's mmap threshold fixed (freed blocks go
# back to the system, as in every CPU measurement here: benchmarks/results/cpu/long_context*.md) the tensors alone
# are 1-16% above the peak RSS of the tiny model and SmolLM2-135M, 1-32k tokens, full training, LoRA and QLoRA.
# Under glibc's default allocator the process also keeps freed blocks (the threshold rises to 32 MiB): RSS then
# exceeds the live memory by what the allocator keeps, not counted (docs/long-context-and-planner.md).
CPU_RUNTIME = 0
# attention implementations a plan can be for; "auto": what the trainer selects on the job's device
# (grpo_fast.packed_attention.choose_attention)
ATTENTIONS = ("auto", "flash_attention_2", "grpo_fast_varlen", "sdpa")
# the data-parallel wrappers of grpo_fast.train.distributed.wrap under torchrun
DISTRIBUTED = ("ddp", "fsdp2")


@dataclass(frozen=True)
class Job:
    """What the trainer will run. Lengths in tokens; micro_batch_size in sequences (or micro_batch_tokens).
    gpus: torchrun's processes, one a GPU (1: one process, no wrapper); sequence_parallel: the ranks that share
    each packed micro-batch's tokens; distributed: the wrapper with more than one process (ddp or fsdp2);
    steps_per_generation: optimizer steps per step, each on a mini-batch of the step's groups; vllm_sleep: vLLM
    (max_staleness 0) sleeps through each update, its pool free for it; load_in_4bit: QLoRA's NF4 base
    (bnb_4bit_double_quant: its scales in 8 bits)."""

    prompt_length: int = 512
    completion_length: int = 4096
    group_size: int = 8
    prompts_per_step: int = 8
    micro_batch_size: int = 1
    micro_batch_tokens: Optional[int] = None
    dtype: str = "bf16-autocast"
    optimizer: str = "adamw"
    grad_accum_dtype: str = "fp32"
    gradient_checkpointing: bool = True
    lora_rank: int = 0
    loss: str = "grpo_fast"
    beta: float = 0.0
    engine: str = "vllm"
    gpu_memory_utilization: float = 0.3
    chunk_bytes: Optional[int] = None
    device: str = "cuda"
    packing: bool = True
    attention: str = "auto"
    max_staleness: int = 0
    top_k: int = 0
    top_p: float = 1.0
    offload_activations: bool = False
    gpus: int = 1
    sequence_parallel: int = 1
    distributed: str = "ddp"
    steps_per_generation: int = 1
    vllm_sleep: bool = False
    load_in_4bit: bool = False
    bnb_4bit_double_quant: bool = False

    def __post_init__(self):
        for name, allowed in (("dtype", DTYPES), ("optimizer", OPTIMIZERS), ("loss", LOSSES),
                              ("grad_accum_dtype", ("fp32", "bf16")), ("distributed", DISTRIBUTED),
                              ("engine", ENGINES), ("device", ("cuda", "cpu")), ("attention", ATTENTIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        optimizer.check_optimizer(self.dtype, self.optimizer, self.lora_rank, installed=False)
        # the trainer's rules (TrainConfig), so that a plan is never made for a job the trainer refuses
        for name in ("prompt_length", "completion_length", "prompts_per_step", "micro_batch_size"):
            _require(name, getattr(self, name), getattr(self, name) > 0, "> 0")
        _require("group_size", self.group_size, self.group_size >= 2, ">= 2 (advantages compare completions)")
        for name in ("micro_batch_tokens", "chunk_bytes"):
            value = getattr(self, name)
            _require(name, value, value is None or value > 0, "> 0 (or unset)")
        _require("lora_rank", self.lora_rank, self.lora_rank >= 0, ">= 0 (0: full training)")
        _require("max_staleness", self.max_staleness, self.max_staleness >= 0,
                 ">= 0 (0: generate, then update; k >= 1: the engine in its own process)")
        _require("beta", self.beta, 0 <= self.beta < math.inf, "a finite number >= 0")
        _require("gpu_memory_utilization", self.gpu_memory_utilization, 0 < self.gpu_memory_utilization < 1,
                 "in (0, 1)")
        _require("top_k", self.top_k, self.top_k >= 0, ">= 0 (0: every token)")
        _require("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]")
        check_sampling(self.engine, self.top_k, self.top_p)            # the trainer's own checks
        check_vllm_sleep(self.vllm_sleep, self.engine, self.max_staleness)
        check_4bit(self.load_in_4bit, self.bnb_4bit_double_quant, self.lora_rank, self.distributed, installed=False)
        for name in ("gpus", "sequence_parallel", "steps_per_generation"):
            _require(name, getattr(self, name), getattr(self, name) >= 1, ">= 1")
        self._check_world()

    def _check_world(self) -> None:
        """The trainer's checks of a job on `gpus` processes, in its words: distributed.init's (sequence_parallel
        divides the processes), TrainConfig.check_world's over the data-parallel groups (whole groups a rank,
        whole mini-batches; max_staleness alone) and check_sequence_parallel's."""
        check_processes(self.gpus, self.sequence_parallel)
        check_data_groups(self.prompts_per_step, self.data_groups, self.steps_per_generation, self.max_staleness)
        check_sequence_parallel(self.sequence_parallel, self.packing, self.attention, self.max_staleness)

    @property
    def data_groups(self) -> int:
        """The data-parallel groups the step's prompts are split over: gpus / sequence_parallel."""
        return self.gpus // self.sequence_parallel

    @property
    def prompts_per_rank(self) -> int:
        """The prompts each rank generates, holds and trains on in a step: its data-parallel group's share (the
        ranks of a sequence-parallel group hold the same ones)."""
        return self.prompts_per_step // self.data_groups

    def kept_ids_per_token(self, vocab_size: int) -> int:
        """The most ids a sampled token's kept set can hold: top_k (at most the vocabulary), the whole vocabulary
        under top-p alone (on an untrained policy top-p 0.95 keeps most of it), 0 without truncation (no kept
        sets)."""
        if self.top_k > 0:
            return min(self.top_k, vocab_size)
        return vocab_size if self.top_p < 1 else 0

    @property
    def attention_implementation(self) -> str:
        """The attention the job runs: `attention`, or for "auto" the trainer's choice on the job's device and
        dtype (flash_attention_2 needs the flash_attn package here)."""
        if self.attention != "auto":
            return self.attention
        return choose_attention(self.device, self.dtype, flash=self.sequence_parallel == 1)

    @property
    def micro_batch_sequences(self) -> int:
        if self.micro_batch_tokens is None:
            return self.micro_batch_size
        per_sequence = self.prompt_length + self.completion_length
        return max(1, min(self.micro_batch_size, self.micro_batch_tokens // per_sequence))

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches of one rank's optimizer step (its prompts_per_rank, cut into steps_per_generation
        mini-batches), every sequence at full length (the most there can be); under sequence parallelism each is
        shared by the group, every rank running its shard of each."""
        sequences = self.prompts_per_rank // self.steps_per_generation * self.group_size
        return -(-sequences // self.micro_batch_sequences)


class JobValueError(ValueError):
    """A Job field out of range; `field` lets the command line name its option instead."""

    def __init__(self, field: str, expected: str, value):
        super().__init__(f"{field} must be {expected}, got {value!r}")
        self.field, self.expected, self.value = field, expected, value


def _require(field: str, value, ok: bool, expected: str) -> None:
    if not ok:                            # NaN fails every comparison, so it lands here too
        raise JobValueError(field, expected, value)


def _bytes(dtype: str) -> tuple:
    """(parameter bytes, activation bytes)."""
    return {"bf16-autocast": (4, 2), "bf16": (2, 2), "fp32": (4, 4)}[dtype]


class Estimate(dict):
    """plan()'s {component: bytes} with the attention implementation it was counted for (`.attention`), the
    training peak (`.training_peak`: the update's, without a rollout process) and the in-process HF engine's
    generation peak (`.generation_peak`, 0 for other engines); "total" is the higher one (plus a rollout
    process's memory). `.host_activations`: the pinned host memory offload_activations moves there (not in the
    card's total)."""

    attention: str = ""
    training_peak: int = 0
    generation_peak: int = 0
    host_activations: int = 0


def check_heads(shape: ModelShape, job: Job) -> None:
    """Raises ValueError (one line, grpo_fast.sequence_parallel.spread_heads' words) when job.sequence_parallel is
    more than the model's attention heads (fewer, they split as evenly as can be)."""
    size, heads = job.sequence_parallel, shape.num_heads
    if heads < size:
        raise ValueError(f"sequence_parallel {size} must be at most the model's {heads} attention heads")


def exchanged_kv_heads(shape: ModelShape, size: int) -> int:
    """The key / value heads the all-to-all exchanges over `size` ranks (grpo_fast.sequence_parallel.spread_heads):
    as they are where the ranks divide both counts, repeated to `size` where the ranks divide the heads and are a
    multiple of the key / value heads, else repeated to one per query head."""
    heads, kv_heads = shape.num_heads, shape.num_kv_heads
    if heads % size == 0 and kv_heads % size and size % kv_heads == 0:
        return size
    if heads % size or kv_heads % size:
        return heads
    return kv_heads


def mask_elements(job: Job, attention: str) -> int:
    """Elements of the attention mask one micro-batch builds: b x L x L for padded rows (unless flash-attention,
    which unpads instead), N x N for plain sdpa over a packed row of N tokens, none for variable-length attention
    or a single sequence (no padding and nothing packed)."""
    sequences = job.micro_batch_sequences
    length = job.prompt_length + job.completion_length
    if sequences == 1 or attention == "flash_attention_2":
        return 0
    if not job.packing:
        return sequences * length * length
    return (sequences * length) ** 2 if attention == "sdpa" else 0


def plan(shape: ModelShape, job: Job, capacity: Optional[int] = None) -> Estimate:
    """Predicted peak memory per component, in bytes, and their sum as "total", on a CUDA card of `capacity`
    bytes: grpo_fast's default chunk budget is a share of the card (grpo_fast.chunked.cuda_chunk_bytes). Without
    a capacity the largest budget any card gets is counted, an upper bound. CPU plans do not depend on it.
    The result's .attention names the attention implementation counted. Every component is one GPU's (one rank's
    of job.gpus; see _replicas_or_shards and _micro_batch_peak); a model whose heads do not split over
    job.sequence_parallel ranks raises ValueError (check_heads)."""
    check_heads(shape, job)
    param_bytes, _ = _bytes(job.dtype)
    params = shape.num_parameters()
    trainable, trainable_bytes, autocast_copies = params, param_bytes, job.dtype == "bf16-autocast"
    if job.lora_rank:         # fp32 adapters on a frozen base held in the dtype's weights (autocast caches no cast)
        trainable = job.lora_rank * shape.num_layers * sum(a + b for a, b in shape.linear_shapes())
        trainable_bytes, autocast_copies = 4, False
    # grpo_fast.train.update.optimizer: AdamW's fp32 moments (plus an fp32 master copy of bf16 weights), 8-bit moments,
    # or bf16 moments; the two low-bit ones round bf16 weights stochastically instead of keeping a master copy
    state_bytes = {"adamw": 8 + (4 if trainable_bytes == 2 else 0), "adamw8bit": 2, "adamw-bf16": 4}[job.optimizer]
    attention = job.attention_implementation
    weights = params * param_bytes + (trainable * 4 if job.lora_rank else 0)
    if job.load_in_4bit:      # the decoder's linear layers in NF4 with their scales (grpo_fast.train.qlora)
        linear = shape.num_layers * sum(a * b for a, b in shape.linear_shapes())
        weights -= linear * param_bytes - int(quantized_bytes(linear, job.bnb_4bit_double_quant))
    # bf16 weights: one process sums the micro-batches' gradients in fp32 (grpo_fast.train.update.step.Fp32GradientSum;
    # under DDP and FSDP2 the gradients add up in .grad, in the parameters' dtype)
    fp32_sum = 0
    if job.grad_accum_dtype == "fp32" and trainable_bytes == 2 and job.micro_batches_per_step > 1 and job.gpus == 1:
        fp32_sum = trainable * 4
    runtime = CUDA_CONTEXT if job.device == "cuda" else CPU_RUNTIME
    # top-k / top-p: each sampled position's kept set (int64 ids and an offset) lives through the whole step
    kept_ids = job.kept_ids_per_token(shape.vocab_size)
    kept_sets = job.prompts_per_rank * job.group_size * job.completion_length * (kept_ids + 1) * 8 if kept_ids else 0
    # the step's batch, held through its update: input ids and attention mask (int64) over prompt + completion,
    # the completion's ids (int64), mask (bool) and its old, reference and sampling log-probs and correction (fp32)
    sequences = job.prompts_per_rank * job.group_size
    step_batch = sequences * ((job.prompt_length + job.completion_length) * 16 + job.completion_length * 25)
    gradients, optimizer_states = trainable * trainable_bytes, trainable * state_bytes
    layer_trainable = trainable // shape.num_layers if job.lora_rank else shape.layer_parameters()
    components = {
        **_replicas_or_shards(shape, job, weights, gradients, optimizer_states, layer_trainable * trainable_bytes),
        "fp32_gradient_sum": fp32_sum,
        # the KL reference is a frozen copy of the policy, but with LoRA the policy with its adapters off
        # (grpo_fast.train.policy.frozen_reference): no copy
        "reference_model": params * param_bytes if job.beta > 0 and not job.lora_rank else 0,
        "autocast_weight_copies": params * 2 if autocast_copies and job.device == "cuda" else 0,
        **_micro_batch_peak(shape, job, capacity, attention),
        "kv_cache": 0,
        "generation_logits": 0,
        "kept_sets": kept_sets,
        "step_batch": step_batch,
        "runtime": runtime,
    }
    training_peak = sum(components.values())
    components, generation_peak = _with_generation(shape, job, components, training_peak, runtime)
    components["total"] = sum(components.values())
    estimate = Estimate(components)
    estimate.attention = attention
    estimate.training_peak, estimate.generation_peak = training_peak, generation_peak
    estimate.host_activations = offloaded_activations(shape, job)
    return estimate


def _replicas_or_shards(shape: ModelShape, job: Job, weights: int, gradients: int, optimizer_states: int,
                        layer_gradients: int) -> dict:
    """Each rank's weights, gradients and optimizer states, and what its wrapper adds (distributed.wrap).

    One process (gpus 1, no wrapper): the three as they are.
    DDP: full replicas on every rank, plus its gradient buckets: the trainer's DistributedDataParallel keeps the
    default gradient_as_bucket_view=False, so the buckets are a second copy of every trainable gradient, in its dtype,
    allocated for the whole run.
    FSDP2 (fully_shard of each decoder layer, then of the root, over a 1-D mesh of all gpus ranks, sequence-parallel
    ranks included): the three sharded, 1/gpus each (FSDP2 also pads each parameter's first dimension to a multiple
    of gpus: at most gpus - 1 rows a parameter, not counted). Not sharded:
      - fsdp2_unsharded_gradients: the trainer turns the gradient reduction off for every micro-batch but an
        optimizer step's last (distributed.gradient_sync), and FSDP2 then keeps each layer's full gradient until that
        last backward reduce-scatters it: with more than one micro-batch a step, a full gradient on every rank.
      - fsdp2_gathered: the root's parameters (embeddings, LM head, final norm), which stay gathered from its forward
        to the end of its backward; two decoder layers gathered at once (the one computing and the next, which
        fully_shard's default implicit forward prefetch and explicit backward prefetch of one layer gather ahead); one
        layer's unsharded gradient and its reduce-scatter input. All in the parameters' dtype (no mixed-precision
        policy: under bf16-autocast the gathered weights are fp32)."""
    if job.gpus == 1:
        return {"weights": weights, "gradients": gradients, "optimizer": optimizer_states}
    if job.distributed == "ddp":
        return {"weights": weights, "gradients": gradients, "optimizer": optimizer_states,
                "ddp_gradient_buckets": gradients}
    size = job.gpus
    param_bytes = _bytes(job.dtype)[0]
    root = shape.num_parameters() - shape.num_layers * shape.layer_parameters()
    return {"weights": weights // size, "gradients": gradients // size, "optimizer": optimizer_states // size,
            "fsdp2_unsharded_gradients": gradients if job.micro_batches_per_step > 1 else 0,
            "fsdp2_gathered": (root + 2 * shape.layer_parameters()) * param_bytes + 2 * layer_gradients}


def offloaded_activations(shape: ModelShape, job: Job) -> int:
    """Bytes of a micro-batch's saved activations that policy.offload_activations keeps in (pinned) host memory on
    a CUDA job, 0 otherwise (on a CPU the host is the device). The trainer wraps the decoder's training forward in
    torch.autograd.graph.save_on_cpu: with checkpointing what that forward saves is each layer's input, so all
    layers' inputs go to the host and the card keeps one of them (brought back for its layer's recompute) beside the
    recompute's own working set, which runs in the backward, outside the offload; without checkpointing every
    layer's saved tensors go, and the card holds one layer's at a time as the backward brings them back. The loss's
    buffers and the states it takes stay on the card (the loss runs after that forward); so, in this count, do the
    final norm's few saved tensors, which also go to the host."""
    return _offloaded_layers(shape, job) * shape.num_layers


def _offloaded_layers(shape: ModelShape, job: Job) -> int:
    """offloaded_activations of one decoder layer (0 without the offload, or on a CPU job)."""
    if not job.offload_activations or job.device != "cuda":
        return 0
    _, act_bytes = _bytes(job.dtype)
    h = shape.hidden_size
    tokens = -(-job.micro_batch_sequences * (job.prompt_length + job.completion_length) // job.sequence_parallel)
    if job.gradient_checkpointing:
        return tokens * h * act_bytes
    return tokens * (_layer_saved(shape, job) + adapter_copies(shape, job))


def _layer_saved(shape: ModelShape, job: Job) -> int:
    """Bytes one decoder layer of the model saves for backward per token (SAVED_PER_* elements in the activations'
    dtype), LoRA's adapter_copies aside; also the measure of a no-grad pass's transient working set."""
    _, act_bytes = _bytes(job.dtype)
    return (SAVED_PER_HIDDEN * shape.hidden_size + SAVED_PER_KV * shape.kv_dim
            + SAVED_PER_INTERMEDIATE * shape.intermediate_size) * act_bytes


def adapter_copies(shape: ModelShape, job: Job) -> int:
    """Bytes per token that LoRA adds to what one decoder layer saves for backward. With a bf16 base (dtype bf16,
    QLoRA's compute dtype included) PEFT casts each adapted layer's input to its fp32 adapters' dtype, and lora_A
    saves that copy (and its rank-r output), seven fp32 copies a layer where q, k and v share one input and gate and
    up another; the frozen base layers (and bitsandbytes' 4-bit matmul) save no input of their own. fp32 needs no
    cast; under bf16-autocast lora_A saves autocast's bf16 copy where the trained base layer saved its own: 0."""
    if not job.lora_rank or job.dtype != "bf16":
        return 0
    h = shape.hidden_size
    adapted_inputs = sum(inputs for inputs, _ in shape.linear_shapes())
    base_inputs = 2 * h + shape.q_dim + shape.intermediate_size     # q/k/v, o, gate/up and down's inputs
    outputs = len(shape.linear_shapes()) * job.lora_rank
    return 4 * (adapted_inputs + outputs) - 2 * base_inputs


def _micro_batch_peak(shape: ModelShape, job: Job, capacity: Optional[int], attention: str) -> dict:
    """The components of one micro-batch at the training peak: its activations, loss buffers and attention mask
    during backward, or (when that is larger) one no-grad log-prob pass, the other three then 0.

    Under sequence parallelism (N ranks) each rank runs the decoder on its shard of the packed row, the row's tokens
    / N (the row padded to a multiple of N), and the loss on the completion tokens whose predicting state it holds
    (at most those of its shard); it also holds sp_all_to_all, the send and receive copies of the all-to-alls of one
    layer (grpo_fast.sequence_parallel._exchange: q, k and v, key/value heads repeated as exchanged_kv_heads says,
    and the attention output), and sp_completion_states, the (b, C, H) tensor of the completion tokens' hidden
    states that states_here builds on every rank, zero where another rank holds them."""
    _, act_bytes = _bytes(job.dtype)
    h = shape.hidden_size
    sequences = job.micro_batch_sequences
    parallel = job.sequence_parallel
    tokens = -(-sequences * (job.prompt_length + job.completion_length) // parallel)
    completion_tokens = min(sequences * job.completion_length, tokens)
    sp = {}
    if parallel > 1:
        # send and receive copies of q and the attention output (this shard's tokens with every head; the whole
        # row with this rank's share of the heads, the larger share where they split unevenly), and of k and v
        kv_heads, row = exchanged_kv_heads(shape, parallel), tokens * parallel
        per_head = [tokens * count + row * -(-count // parallel) for count in (shape.num_heads, kv_heads)]
        exchanged = 2 * sum(per_head) * shape.head_size
        sp = {"sp_all_to_all": exchanged * act_bytes,
              "sp_completion_states": sequences * job.completion_length * h * act_bytes}

    layer = _layer_saved(shape, job)
    per_layer = layer + adapter_copies(shape, job)        # what a training forward saves: the adapters' copies too
    around = 4 * h * 4 + h * act_bytes                # embeddings output, final norm (fp32), hidden for the loss
    if job.gradient_checkpointing:
        activations = tokens * (shape.num_layers * h * act_bytes + int(RECOMPUTE_PEAK * per_layer) + around)
    else:
        activations = tokens * (shape.num_layers * per_layer + around)
    if job.offload_activations:             # all layers' saved tensors on the host, one layer's back on the card
        activations -= offloaded_activations(shape, job) - _offloaded_layers(shape, job)
    loss_bytes = _loss_buffers(job, shape, completion_tokens, act_bytes, capacity)
    # the bool mask lives through the micro-batch's forward and backward (an input of every checkpointed layer);
    # sdpa's additive copy of it in the compute dtype is saved for backward by one layer at a time with
    # checkpointing, by every layer without
    elements = mask_elements(job, attention)
    mask_bytes = elements * (1 + act_bytes * (1 if job.gradient_checkpointing else shape.num_layers))
    # A no-grad pass (reference log-probs with beta > 0, old log-probs for vLLM's correction) holds one layer's
    # transient working set and the loss's forward buffers.
    no_grad = 0
    if job.beta > 0 or job.engine == "vllm" or job.max_staleness:      # a rollout process's log-probs: corrected
        no_grad = tokens * (int(RECOMPUTE_PEAK * layer) + around) + _loss_buffers(
            job, shape, completion_tokens, act_bytes, capacity, forward_only=True) + elements * (1 + act_bytes)
    if no_grad:
        no_grad += sum(sp.values())
    training = activations + loss_bytes + mask_bytes + sum(sp.values()) >= no_grad
    return {"activations": activations if training else 0,
            "loss_buffers": loss_bytes if training else 0,
            "attention_mask": mask_bytes if training else 0,
            "no_grad_pass": 0 if training else no_grad,
            **{name: value if training else 0 for name, value in sp.items()}}


def _with_generation(shape: ModelShape, job: Job, components: dict, training_peak: int, runtime: int) -> tuple:
    """(components, generation peak) with the HF engine's memory: in the trainer's process (max_staleness 0) its
    generation peak, which replaces the training components when it is the higher; in a rollout process
    (max_staleness >= 1) its rollout_* components on top. Other engines: unchanged, generation peak 0."""
    param_bytes, _ = _bytes(job.dtype)
    params = shape.num_parameters()
    # The HF engine generates all of the step's prompts in one model.generate call, with the policy's weights in
    # their own dtype (no autocast): the KV cache of prompts_per_rank x group_size sequences at full length and one
    # decode step's logits of those rows.
    rows = job.prompts_per_rank * job.group_size
    kv_cache = hf_kv_cache(shape, job)
    step_logits = rows * shape.vocab_size * (param_bytes + GENERATE_LOGIT_BYTES)
    # In-process HF generation runs before the update, gradients freed (zero_grad(set_to_none=True)): a separate
    # peak of the weights, optimizer states, reference model, KV cache and decode logits. When it is the higher
    # one, the components are those it holds.
    generation_peak = 0
    if job.engine == "hf" and not job.max_staleness:
        # DDP's buckets live for the whole run; FSDP2 gathers the layers one by one as generate calls them
        held = [name for name in HELD_BETWEEN_UPDATES if name in components]
        generation_peak = sum(components[name] for name in held) + kv_cache + step_logits
        if generation_peak > training_peak:
            components = {name: value if name in held else 0 for name, value in components.items()}
            components["kv_cache"], components["generation_logits"] = kv_cache, step_logits
    # max_staleness >= 1: the engine's own process, at the same time as the update. The HF engine holds the
    # policy's weights in their dtype, its KV cache, one decode step's logits and the sampling log-probs its sampler
    # takes as it draws (one fp32 value a sampled token); vLLM's weights and cache are in its pool (fits_in).
    if job.max_staleness and job.engine == "hf":
        components["rollout_weights"] = params * param_bytes
        components["rollout_kv_cache"] = kv_cache
        components["rollout_logits"] = step_logits + rows * job.completion_length * LOGP_TOKEN_BYTES
        components["rollout_runtime"] = runtime
    return components, generation_peak


def _loss_buffers(job: Job, shape: ModelShape, tokens: int, act_bytes: int, capacity: Optional[int],
                  forward_only: bool = False) -> int:
    v, h = shape.vocab_size, shape.hidden_size
    # fp32 d(hidden), and d(weight) unless the head is frozen (LoRA)
    gradients = 0 if forward_only else tokens * h * 4 + (0 if job.lora_rank else v * h * 4)
    if job.loss == "naive":
        return tokens * v * (act_bytes + 4 * (1 if forward_only else NAIVE_LOGIT_COPIES)) + gradients
    if job.loss == "trl":
        tile = min(tokens, TRL_TILE[0]) * min(v, TRL_TILE[1]) * 4 * TRL_TILE_COPIES
        return tile + gradients
    # the loss's default budget: on CUDA a share of the card's total memory (the largest share of any card when
    # no card is given), on CPU a fixed one
    chunk_bytes = job.chunk_bytes
    if chunk_bytes is None and job.device == "cuda":
        chunk_bytes = chunked.CUDA_CHUNK_BYTES_MAX if capacity is None else chunked.cuda_chunk_bytes(capacity)
    elif chunk_bytes is None:
        chunk_bytes = chunked.DEFAULT_CHUNK_BYTES_CPU
    # the chunks are of equal size, as few as the budget allows (chunked.balanced_rows)
    if job.device == "cuda":             # Triton works in place on the GEMM buffer
        rows = chunked.balanced_rows(tokens, max(1, chunk_bytes // (v * act_bytes)))
        buffer = rows * v * act_bytes
    else:
        # The PyTorch path sizes its chunk for the buffer, an fp32 copy when it is not fp32 and two fp32
        # temporaries (torch_ops.bytes_per_logit), but holds the buffer alone: its passes run a block of rows at a
        # time with at most four block-sized temporaries (torch_ops.row_blocks).
        budget_per_logit = act_bytes + (0 if act_bytes == 4 else 4) + 8
        rows = chunked.balanced_rows(tokens, max(1, chunk_bytes // (v * budget_per_logit)))
        buffer = rows * v * act_bytes + 4 * torch_ops.CPU_BLOCK_BYTES
    return buffer + tokens * 4 * 8 + gradients                             # plus per-token fp32 vectors


def hf_kv_cache(shape: ModelShape, job: Job) -> int:
    """Bytes of the HF engine's KV cache: one model.generate call for all of a step's prompts, prompts_per_step x
    group_size sequences up to prompt + completion tokens, keys and values of every layer in the weights' dtype
    (grpo_fast.train.rollout.engines.HFEngine batches every prompt of a call)."""
    tokens = job.prompts_per_rank * job.group_size * (job.prompt_length + job.completion_length)
    return 2 * shape.num_layers * shape.kv_dim * tokens * _bytes(job.dtype)[0]


def kv_cache_needed(shape: ModelShape, job: Job) -> int:
    """Bytes of bf16 KV cache that hold every sequence of one step at full length at once."""
    sequences = job.group_size * job.prompts_per_rank
    per_token = 2 * shape.num_layers * shape.kv_dim * 2
    return sequences * (job.prompt_length + job.completion_length) * per_token


def fits(shape: ModelShape, job: Job) -> dict:
    """card -> (fits, needed bytes, peak bytes): the card's peak (plan for that card's "total") plus,
    with vLLM colocated, its pool (gpu_memory_utilization x card, which must also hold vLLM's bf16 weights and
    the KV cache)."""
    result = {}
    for card, capacity in CARDS.items():
        estimate = plan(shape, job, capacity)
        result[card] = fits_in(shape, job, estimate, capacity) + (estimate["total"],)
    return result


def vllm_minimum(shape: ModelShape, job: Job) -> int:
    """The least vLLM's pool must hold: its bf16 weights and one sequence's KV cache at full length."""
    return shape.num_parameters() * 2 + kv_cache_needed(shape, job) // (job.group_size * job.prompts_per_rank)


def fits_in(shape: ModelShape, job: Job, estimate: dict, capacity: int) -> tuple:
    """(fits, needed bytes) on a card of `capacity` bytes, for the estimate plan(shape, job, capacity); see
    `fits` (and `misfit_reason` for why not). vLLM's pool is beside the peak, or with job.vllm_sleep beside what
    the trainer holds between updates, the peak then beside what vLLM keeps asleep (`asleep_peaks`)."""
    needed, pool_ok = estimate["total"], True
    if job.engine == "vllm":
        pool = job.gpu_memory_utilization * capacity
        needed = max(asleep_peaks(estimate, pool)) if job.vllm_sleep else needed + pool
        pool_ok = pool >= vllm_minimum(shape, job)
    return pool_ok and needed <= capacity, needed


def asleep_peaks(estimate: dict, pool: float) -> tuple:
    """(the update's peak, generation's peak) on the card of a job whose vLLM sleeps through the update: the
    estimate's total beside what vLLM keeps asleep (VLLM_ASLEEP), and vLLM's `pool` beside what the trainer holds
    between updates (HELD_BETWEEN_UPDATES)."""
    held = sum(estimate.get(name, 0) for name in HELD_BETWEEN_UPDATES)
    return estimate["total"] + VLLM_ASLEEP, held + pool


def least_pool_share(shape: ModelShape, job: Job, capacity: int) -> Optional[float]:
    """The smallest vllm_gpu_memory_utilization, in hundredths, whose pool holds vllm_minimum on a card of
    `capacity` bytes, where the job's share is below it (None otherwise, or when no share below 1 does)."""
    if not pool_shortfall(shape, job, capacity):
        return None
    share = math.ceil(vllm_minimum(shape, job) / capacity * 100) / 100
    return share if share < 1 else None


def pool_shortfall(shape: ModelShape, job: Job, capacity: int) -> str:
    """Why vLLM's pool on a card of `capacity` bytes is too small, in words, or "" (it is not, or no vLLM): the
    budget a job can miss while its total is below the card (`fits_in`)."""
    minimum = vllm_minimum(shape, job) if job.engine == "vllm" else 0
    if job.gpu_memory_utilization * capacity >= minimum:
        return ""
    return (f"vLLM's pool, gpu_memory_utilization {job.gpu_memory_utilization} of the card "
            f"({job.gpu_memory_utilization * capacity / GIB:.1f} GiB), is below its weights and one sequence's KV "
            f"cache at full length ({minimum / GIB:.1f} GiB, {minimum / capacity:.2f} of the card)")


def load_shape(model: str) -> ModelShape:
    """A preset name or the path of a Hugging Face config.json (or of the folder holding it)."""
    if model in PRESETS:
        return PRESETS[model]
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if os.path.isdir(model) and not os.path.isfile(path):
        raise ValueError(f"model folder {model!r} must hold a config.json, found none")
    if not os.path.isfile(path):
        raise ValueError(f"model must be a preset {sorted(PRESETS)} or a config.json path, got {model!r}")
    return ModelShape.from_config(path)

