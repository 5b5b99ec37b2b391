"""Prompt sources (a built-in arithmetic task generated in code, the vendored GSM8K subset, JSONL files of
prompts with solutions) and the prompts of each training step.

A sample is a dict with "prompt" (text) and "solution" (the gold answer, a string math-verify can parse).
"""

from __future__ import annotations

import json
import os
import random
import re

GSM8K_PATH = os.path.join(os.path.dirname(__file__), "data", "gsm8k_test_200.jsonl")
GSM8K_ANSWER_RE = re.compile(r"#### (-?[0-9.,]+)")


def arithmetic_task(num_samples: int, *, seed: int = 0, max_operand: int = 20, operations: str = "+-") -> list:
    """`num_samples` problems "a op b =" with their answers, reproducible from `seed`."""
    if num_samples <= 0 or max_operand <= 0:
        raise ValueError(f"num_samples and max_operand must be positive, got {num_samples} and {max_operand}")
    unknown = set(operations) - set("+-*")
    if not operations or unknown:
        raise ValueError(f"operations must be a non-empty string of + - *, got {operations!r}")
    rng = random.Random(seed)
    samples = []
    for _ in range(num_samples):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(operations)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        samples.append({"prompt": f"{a}{op}{b}=", "solution": str(value)})
    return samples


def load_jsonl(path: str, *, prompt_key: str = "prompt", solution_key: str = "solution") -> list:
    """Samples from a JSONL file of objects with a string prompt and a string or number solution; a bad line
    raises a ValueError naming the file, the line and what is wrong with it."""
    samples = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: not UTF-8 text ({error.reason} at byte {error.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            for key in (prompt_key, solution_key):
                if key not in record:
                    raise ValueError(f"{path}:{number}: missing key {key!r} (has {sorted(record)})")
            prompt, solution = record[prompt_key], record[solution_key]
            if not isinstance(prompt, str):
                raise ValueError(f"{path}:{number}: {prompt_key!r} must be a string, got {type(prompt).__name__}")
            if isinstance(solution, bool) or not isinstance(solution, (str, int, float)):
                raise ValueError(f"{path}:{number}: {solution_key!r} must be a string or a number, got "
                                 f"{type(solution).__name__}")
            samples.append({"prompt": prompt, "solution": str(solution)})
    if not samples:
        raise ValueError(f"{path}: no samples")
    return samples


def gsm8k(num_samples=None) -> list:
    """The vendored GSM8K subset (200 test problems, MIT licence beside it): the question as prompt and the number
    after "#### " in the worked answer (commas removed) as solution."""
    samples = []
    with open(GSM8K_PATH) as f:
        for line in f:
            record = json.loads(line)
            answer = GSM8K_ANSWER_RE.search(record["answer"]).group(1).replace(",", "")
            samples.append({"prompt": record["question"], "solution": answer})
    return samples if num_samples is None else samples[:num_samples]


def load_samples(config) -> list:
    """The samples of `config.task` (a TrainConfig): "arithmetic", "gsm8k" or a JSONL path."""
    if config.task == "arithmetic":
        return arithmetic_task(config.num_prompts, seed=config.seed, max_operand=config.max_operand)
    if config.task == "gsm8k":
        return gsm8k()
    return load_jsonl(config.task)


def prompts_for_step(samples: list, step: int, count: int, seed: int) -> list:
    """The step's samples: a fixed shuffle per epoch, so a resumed run sees exactly the same ones."""
    order = []
    epoch = (step * count) // len(samples)
    while len(order) < (step * count) % len(samples) + count:
        permutation = list(range(len(samples)))
        random.Random(seed * 100_003 + epoch).shuffle(permutation)
        order.extend(permutation)
        epoch += 1
    start = (step * count) % len(samples)
    return [samples[i] for i in order[start:start + count]]


def prompt_text(sample: dict, tokenizer, config) -> str:
    """The text the policy is prompted with: the chat template (prompt_format "chat") or the plain prompt, with
    config.system_prompt as the system turn or a line before it."""
    if config.prompt_format == "chat":
        system = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
        return tokenizer.apply_chat_template(system + [{"role": "user", "content": sample["prompt"]}],
                                             tokenize=False, add_generation_prompt=True)
    if config.system_prompt:
        return config.system_prompt + "\n" + sample["prompt"]
    return sample["prompt"]


def prompt_ids(texts: list, tokenizer) -> list:
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
