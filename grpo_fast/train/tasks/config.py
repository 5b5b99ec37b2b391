"""The config sections of the task: `data`, the prompts trained on (a built-in task or a dataset on disk) and how
each becomes the text the policy answers, and `evaluation`, the held-out problems (never trained on), how often and
how many answers each."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from grpo_fast.fields import NON_NEGATIVE, POSITIVE, UNIT_INTERVAL, check_keys, key
from grpo_fast.train.tasks import dataset_files

TASKS = ("max", "arithmetic", "gsm8k")


def check_task(source: str, name: str) -> None:
    """Raises ValueError naming the key `name` when `source` is neither a built-in task nor a dataset on disk."""
    if source not in TASKS:
        try:
            dataset_files.check_source(source, name)
        except ValueError as error:
            raise ValueError(f"{error} ({name} is one of {', '.join(TASKS)} or a dataset on disk)") from None


def check_split(split: Optional[str], folder: str, name: str) -> None:
    """Raises ValueError when `folder` is a save_to_disk folder of several splits and `split` is none of them."""
    if split is not None and folder not in TASKS and os.path.isdir(folder):
        found = dataset_files.splits(folder)
        if len(found) > 1 and split not in found:
            raise ValueError(f"{name}={split!r}: {folder!r} has the splits {found}")


def check_column(column: str, name: str) -> None:
    """Raises ValueError naming the key `name` when `column` is no column name or dotted path: empty, or a path
    with an empty part ("reward_model." or "reward_model..ground_truth")."""
    if not column.strip() or not all(column.split(".")):
        raise ValueError(f"{name}={column!r}: expected a column name or a dotted path into struct columns such as "
                         f"reward_model.ground_truth, with no empty part")


@dataclass
class DataConfig:
    """The config section `data`: the policy's prompts (the built-in tiny model answers the generated tasks)."""

    task: str = key("max", '"max" (generated: the largest of four numbers), "arithmetic" (generated), "gsm8k" '
                           "(vendored 200-problem subset) or a dataset on disk: a .jsonl / .json / .parquet / .csv "
                           "file or a save_to_disk folder")
    prompt_column: str = key("prompt", "the dataset's prompt column: text, or a list of chat messages "
                                       "({role, content}, rendered with the chat template); a dotted path reads a "
                                       "key of a struct column (extra_info.question)")
    solution_column: str = key("solution", "the dataset's gold-answer column (text or a number); a dotted path "
                                           "reads a key of a struct column (verl's and DAPO's parquet files: "
                                           "reward_model.ground_truth)")
    train_split: str = key("train", "the split trained on, for a save_to_disk folder of several splits")
    prompt_format: str = key("plain", '"plain" (the prompt text) or "chat" (the chat template, as a user turn)',
                             choices=("plain", "chat"))
    system_prompt: Optional[str] = key(None, "the system turn (chat) or a line before the prompt (plain)")
    num_prompts: int = key(2000, "how many max / arithmetic problems are generated", POSITIVE)
    max_operand: int = key(9, "max / arithmetic numbers are 0..max_operand", POSITIVE)

    def __post_init__(self):
        if isinstance(self.task, str):                   # a path: "~" is the home folder, as in a shell
            self.task = os.path.expanduser(self.task)
        check_keys(self)
        for name in ("prompt_column", "solution_column"):
            check_column(getattr(self, name), name)
        check_task(self.task, "task")
        check_split(self.train_split, self.task, "train_split")


@dataclass
class EvaluationConfig:
    """The config section `evaluation`: held-out problems (never trained on) answered eval_samples times each,
    before the first step, every eval_every steps and after the last: accuracy and pass@k in eval.jsonl
    (grpo_fast.train.run.evaluate)."""

    eval_every: int = key(50, "steps between evaluations on the held-out problems (also before the first step and "
                              "after the last; 0: none)", NON_NEGATIVE)
    eval_prompts: int = key(100, "held-out problems per evaluation at most", POSITIVE)
    eval_samples: int = key(4, "completions per held-out problem: accuracy is their mean, pass@k for k up to this",
                            POSITIVE)
    eval_reward: Optional[str] = key(None, "the reward that scores an evaluation, 1.0 or more counting as correct "
                                           "(None: the first of rewards)")
    eval_task: Optional[str] = key(None, "where the held-out problems come from, as task (arithmetic, gsm8k, a file "
                                         "or folder); None: eval_split or eval_fraction")
    eval_split: Optional[str] = key(None, "the held-out split of a save_to_disk folder (e.g. test)")
    eval_fraction: float = key(0.1, "share of the task's distinct problems held out (never trained on) when neither "
                                    "eval_task nor eval_split is set", UNIT_INTERVAL)

    def __post_init__(self):
        if isinstance(self.eval_task, str):              # a path: "~" is the home folder, as in a shell
            self.eval_task = os.path.expanduser(self.eval_task)
        check_keys(self)
        if self.eval_task is not None:
            check_task(self.eval_task, "eval_task")
