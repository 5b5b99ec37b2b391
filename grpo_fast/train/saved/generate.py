"""`grpo-fast generate`: the trained model answers a prompt, rendered and sampled as its run renders and samples one.

    grpo-fast generate runs/default "max(3,8,2,7)="                       # the run's newest model, its settings
    grpo-fast generate runs/default "max(3,8,2,7)=" --num-samples 4 --seed 1
    grpo-fast generate runs/default "max(3,8,2,7)=" --greedy              # the most likely token at every step
    grpo-fast generate path/to/model "What is 2 + 3?" --prompt-format chat --max-new-tokens 64

A run folder answers with what `grpo-fast eval` would evaluate (eval_command.run_config: its model/ export when
that is its newest checkpoint's step, else that checkpoint) and with its saved config: the prompt is rendered as
its rollouts render one (tasks.prompt_text: prompt_format, system_prompt, the chat template), and sampled with its
temperature, top_p and top_k, at most max_completion_length tokens, rope_scaling and dtype as it trained. A
Hugging Face model folder answers with the trainer's defaults. Flags override either.

The tokens are drawn by the trainer's HF engine (rollout.engines.HFEngine), whatever engine the run trained with:
its seeded sampler (rollout.sampling.PromptSeededSampler, the draws of a rollout: the same seed gives the same
tokens) and the model folder's generation_config.json left out, as in training. One prompt does not repay
starting vLLM.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

from grpo_fast.train import tasks
from grpo_fast.train.config import key_names, load_config
from grpo_fast.train.rollout.engines import HFEngine
from grpo_fast.train.saved.eval_command import is_model_folder, opened_model, run_config

# the flags that set a TrainConfig key of the same name (the others: the prompt, --max-new-tokens, --num-samples,
# --greedy)
KEY_FLAGS = ("temperature", "top_p", "top_k", "seed", "prompt_format", "system_prompt", "device", "dtype")


def add_arguments(parser) -> None:
    parser.add_argument("target", metavar="RUN_OR_MODEL", help="a training run's output_dir, or a Hugging Face "
                        "model folder (then the trainer's defaults: plain prompts, temperature 1)")
    parser.add_argument("prompt", help="the prompt text, rendered as the run renders a prompt (put -- before one "
                        "that starts with -)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens sampled at most (default: the run's max_completion_length)")
    parser.add_argument("--num-samples", type=int, default=1, help="completions of the prompt (default 1)")
    parser.add_argument("--greedy", action="store_true", help="the most likely token at every step (top_k 1)")
    parser.add_argument("--temperature", help="default: the run's")
    parser.add_argument("--top-p", help="default: the run's")
    parser.add_argument("--top-k", help="default: the run's (0: every token)")
    parser.add_argument("--seed", help="the sampler's seed (default: the run's, so a command repeated prints the "
                        "same answer)")
    parser.add_argument("--prompt-format", help="plain or chat (default: the run's)")
    parser.add_argument("--system-prompt", help="default: the run's")
    parser.add_argument("--device", help="default: the run's (auto: CUDA when available)")
    parser.add_argument("--dtype", help="default: the run's (auto: fp32 on CPU, bf16 weights only for dtype bf16)")


def overrides_of(args) -> dict:
    """{TrainConfig key: value as text} of the flags given (argparse's namespace of add_arguments); --greedy is
    top_k 1."""
    overrides = {name: getattr(args, name) for name in KEY_FLAGS if getattr(args, name) is not None}
    if args.greedy:
        if "top_k" in overrides:
            raise ValueError(f"--greedy samples with top_k 1, and --top-k {overrides['top_k']} was given too: give "
                             "one of them")
        overrides["top_k"] = "1"
    return overrides


@contextlib.contextmanager
def no_loading_bar():
    """transformers' "Loading weights" bar off inside the block: the command's stderr holds its one line of what
    answers (or its one-line error), nothing else."""
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def generate_config(target: str, overrides: dict) -> tuple:
    """(TrainConfig, model folder or None, what answers, in words) for `grpo-fast generate TARGET`: a run folder's
    saved config and newest state (eval_command.run_config), or a model folder with the trainer's defaults.
    overrides: TrainConfig keys."""
    overrides = key_names(overrides)
    if is_model_folder(target):
        return load_config(None, {**overrides, "model": target}), target, f"model {target}"
    return run_config(target, overrides, "generate", "generate with")


def main(target: str, prompt: str, overrides: dict, max_new_tokens: Optional[int] = None, num_samples: int = 1,
         log=print) -> list:
    """`grpo-fast generate`: num_samples completions of `prompt` (text) by the model of `target`, each printed
    (through `log`) as its text alone, special tokens left out; a header line before each when there are several.
    Returns the completions' token ids, one list per sample (the EOS that ended one included)."""
    if num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {num_samples}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    config, model_dir, described = generate_config(target, overrides)
    max_new_tokens = max_new_tokens or config.rollout.max_completion_length
    with no_loading_bar(), opened_model(target, config.policy, config.data.prompt_format, model_dir) as opened:
        model, tokenizer, _ = opened
        ids = tasks.prompt_ids([tasks.prompt_text({"prompt": prompt}, tokenizer, config.data)], tokenizer)[0]
        if not ids:
            raise ValueError("the prompt is empty (no tokens): give the text to answer")
        tasks.check_context(len(ids), max_new_tokens, model.config, one_prompt=True, length_key="--max-new-tokens",
                            offer_scaling=False)          # the model's positions are those it was trained with
        rollout = config.rollout
        print(f"{target}: {described}; a prompt of {len(ids)} tokens ({config.data.prompt_format}), at most "
              f"{max_new_tokens} new tokens, temperature {rollout.temperature}, top_p {rollout.top_p}, top_k "
              f"{rollout.top_k}, seed {config.run.seed}", file=sys.stderr)
        completions = HFEngine(model, tokenizer, rollout).generate(
            [ids], seed=config.run.seed, n=num_samples, max_tokens=max_new_tokens).token_ids()
    for index, tokens in enumerate(completions):
        if num_samples > 1:
            log(f"--- sample {index + 1} of {num_samples} ---")
        log(tokenizer.decode(tokens, skip_special_tokens=True))
    return completions
