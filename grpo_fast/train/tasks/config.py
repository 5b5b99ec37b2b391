"""The config section `data`: the prompts trained on (a built-in task or a dataset on disk) and how each becomes the
text the policy answers; `check_task` is the check of a task source the `evaluation` section's eval_task shares."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from grpo_fast.fields import POSITIVE, check_keys, key
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


@dataclass
class DataConfig:
    """The config section `data`: the policy's prompts (the built-in tiny model answers the generated tasks)."""

    task: str = key("max", '"max" (generated: the largest of four numbers), "arithmetic" (generated), "gsm8k" '
                           "(vendored 200-problem subset) or a dataset on disk: a .jsonl / .json / .parquet / .csv "
                           "file or a save_to_disk folder")
    prompt_column: str = key("prompt", "the dataset's prompt column: text, or a list of chat messages "
                                       "({role, content}, rendered with the chat template)")
    solution_column: str = key("solution", "the dataset's gold-answer column (text or a number)")
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
        check_task(self.task, "task")
        check_split(self.train_split, self.task, "train_split")
