"""A thin GRPO trainer: rollouts, rewards, group advantages and grpo_fast's loss, in one loop.

    grpo-fast train                                     # the built-in default: tiny model, arithmetic, CPU
    grpo-fast train examples/tiny_cpu.yaml --max-steps 20 --output-dir runs/try

Each step: sample prompts_per_step prompts, generate group_size completions each (grpo_fast.train.engines: HF or
vLLM), score them, turn rewards into group-normalized advantages, then update the policy with
grpo_fast.grpo_loss on the final hidden states (no logits), in micro-batches sized by sequences and tokens
(grpo_fast.train.batching), num_iterations times. The output folder gets metrics.jsonl (one line per step),
completions.jsonl, curves.png and checkpoints written atomically; `resume=True` continues from the latest.
Under torchrun each rank does this for its share of the prompts (grpo_fast.train.distributed).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import grpo_fast as gf
from grpo_fast import reference
from grpo_fast.train import distributed, tasks
from grpo_fast.train.advantages import group_advantages
from grpo_fast.train.batching import MicroBatch, completion_hidden_states, micro_batch, plan_micro_batches
from grpo_fast.train.config import TrainConfig
from grpo_fast.models import final_hidden_states, lm_head
from grpo_fast.train.rewards import load_reward, weighted_rewards
from grpo_fast.variants import masked_mean, micro_batch_share


# the policy loss from hidden states: grpo_fast's, or the full-logits one (for memory and speed comparisons)
LOSS_IMPLEMENTATIONS = {"grpo_fast": gf.grpo_loss, "naive": reference.grpo_loss}


# ----------------------------------------------------------------------------------------------- setup pieces
def load_samples(config: TrainConfig) -> list:
    if config.task == "arithmetic":
        return tasks.arithmetic_task(config.num_prompts, seed=config.seed, max_operand=config.max_operand)
    if config.task == "gsm8k":
        return tasks.gsm8k()
    return tasks.load_jsonl(config.task)


def load_model(config: TrainConfig, samples: list):
    """(model, tokenizer): the tiny model with a tokenizer trained on the task, or a local HF directory."""
    if config.model == "tiny":
        from grpo_fast.train.tiny import tiny_qwen2, train_tokenizer

        tokenizer = train_tokenizer([s["prompt"] + s["solution"] for s in samples], vocab_size=300)
        model = tiny_qwen2(len(tokenizer), seed=config.seed, eos_token_id=tokenizer.eos_token_id,
                           max_positions=max(1024, config.max_completion_length + 1024),
                           pad_token_id=tokenizer.pad_token_id)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model)
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def prompt_text(sample: dict, tokenizer, config: TrainConfig) -> str:
    if config.prompt_format == "chat":
        system = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
        return tokenizer.apply_chat_template(system + [{"role": "user", "content": sample["prompt"]}],
                                             tokenize=False, add_generation_prompt=True)
    if config.system_prompt:
        return config.system_prompt + "\n" + sample["prompt"]
    return sample["prompt"]


def prompt_ids(texts: list, tokenizer) -> list:
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def resolve_device(name: str, world: distributed.World = distributed.World()) -> torch.device:
    """The device of this rank: "auto" is CUDA (the rank's local GPU) when available."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but torch sees no CUDA device")
    if name == "cuda" and world.size > 1:
        return torch.device("cuda", world.local_rank)
    return torch.device(name)


def prompts_for_step(samples: list, step: int, count: int, seed: int) -> list:
    """The step's prompts: a fixed shuffle per epoch, so a resumed run sees exactly the same ones."""
    order = []
    epoch = (step * count) // len(samples)
    while len(order) < (step * count) % len(samples) + count:
        permutation = list(range(len(samples)))
        random.Random(seed * 100_003 + epoch).shuffle(permutation)
        order.extend(permutation)
        epoch += 1
    start = (step * count) % len(samples)
    return [samples[i] for i in order[start:start + count]]


def lr_factor(step: int, config: TrainConfig) -> float:
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    if config.lr_schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    if config.lr_schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 1.0


# --------------------------------------------------------------------------------------- the math of a step
def compute_dtype(model, device: torch.device):
    """bf16 autocast on GPU; on CPU the model's own dtype (fp32)."""
    return torch.bfloat16 if device.type == "cuda" else next(model.parameters()).dtype


def micro_batches(rollout: dict, config: TrainConfig, world: distributed.World = distributed.World()) -> list:
    """The step's micro-batches, at most micro_batch_size sequences and micro_batch_tokens real tokens each, as
    (micro-batch, counts) pairs. Every rank gets as many as the busiest one has, since each forward and backward of
    a DDP / FSDP2 model is a collective: a rank with fewer repeats its last one with counts=False."""
    lengths = rollout["attention_mask"].sum(1).tolist()
    plan = plan_micro_batches(lengths, config.micro_batch_tokens, config.micro_batch_size)
    batches = [micro_batch(rollout["input_ids"], rollout["attention_mask"], rollout["prompt_length"], rows,
                           packed=config.packing) for rows in plan]
    steps = distributed.all_reduce_max(len(batches), world, rollout["input_ids"].device)
    return [(batches[min(step, len(batches) - 1)], step < len(batches)) for step in range(steps)]


@dataclass
class Policy:
    """A causal LM (its LM head, generation, checkpoints) and the module that computes its final hidden states
    for training: HiddenStates(model), inside DDP or FSDP2 when distributed."""

    model: torch.nn.Module
    forward: torch.nn.Module

    @classmethod
    def of(cls, model) -> "Policy":
        return cls(model, distributed.HiddenStates(model))


def completion_hidden(policy: Policy, batch: MicroBatch, offload: bool = False):
    """The final hidden states that predict each completion token (b, C, H), and the LM head's weight and logit
    arguments in the same dtype: the backbone runs under bf16 autocast on GPU, the loss in bf16 outside it.
    offload: keep the activations saved for backward in (pinned) CPU memory."""
    device = batch.hidden_index.device
    dtype = compute_dtype(policy.model, device)
    saved = torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda") if offload else nullcontext()
    with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"), saved:
        hidden = completion_hidden_states(policy.forward, batch)
    head = lm_head(policy.model)
    kwargs = head.logit_kwargs()
    if kwargs["bias"] is not None:
        kwargs["bias"] = kwargs["bias"].to(dtype)
    return hidden.to(dtype), head.weight.to(dtype), kwargs


@torch.no_grad()
def completion_logprobs(policy: Policy, rollout: dict, config: TrainConfig,
                        world: distributed.World = distributed.World()) -> torch.Tensor:
    """(B, C) log-probs of the completions under `policy`, micro-batch by micro-batch, one GEMM pass each and no
    logits (old and reference log-probs)."""
    completion_ids = rollout["completion_ids"]
    logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    for batch, _ in micro_batches(rollout, config, world):      # a repeated batch rewrites the same values
        hidden, weight, kwargs = completion_hidden(policy, batch)
        with torch.autocast(hidden.device.type, enabled=False):
            values = gf.token_logprobs(hidden, weight, batch.completion(completion_ids),
                                       **{**kwargs, "temperature": config.temperature})
        logps[batch.rows, :batch.completion_length] = (values * batch.completion(rollout["completion_mask"])).float()
    return logps


def accumulate_gradients(policy: Policy, rollout: dict, config: TrainConfig,
                         world: distributed.World = distributed.World()) -> dict:
    """Backward of the step's loss, micro-batch by micro-batch: the micro-batch losses are weighted
    (`variants.micro_batch_share`, over the sequences and tokens of all ranks) so that their sum is the loss of
    the whole rollout at once, however it is cut, packed and spread over ranks. Every rank runs as many backward
    passes as the busiest (extra ones weigh 0) and reduces gradients in the last. Returns the loss and the loss
    metrics (token-weighted means over micro-batches), summed over ranks."""
    loss_config = config.loss_config()
    device = rollout["completion_mask"].device
    total_sequences, total_tokens = distributed.all_reduce_sum(
        [rollout["input_ids"].shape[0], float(rollout["completion_mask"].sum())], world, device)
    batches = micro_batches(rollout, config, world)
    summed = {"loss": 0.0}
    for step, (batch, counts) in enumerate(batches):
        hidden, weight, head_kwargs = completion_hidden(policy, batch, config.offload_activations)
        mask = batch.completion(rollout["completion_mask"])
        with torch.autocast(hidden.device.type, enabled=False):
            loss, metrics = LOSS_IMPLEMENTATIONS[config.loss_implementation](
                hidden, weight, batch.completion(rollout["completion_ids"]), rollout["advantages"][batch.rows],
                mask, old_logps=batch.completion(rollout.get("old_logps")),
                ref_logps=batch.completion(rollout.get("ref_logps")),
                is_ratio=batch.completion(rollout.get("is_ratio")), loss_type=loss_config.loss_type,
                epsilon_low=loss_config.epsilon_low, epsilon_high=loss_config.epsilon_high, beta=loss_config.beta,
                entropy_coef=loss_config.entropy_coef, max_completion_length=config.max_completion_length,
                num_items_in_batch=total_tokens, **{**head_kwargs, "temperature": config.temperature},
            )
        share = micro_batch_share(mask, loss_config, total_sequences, total_tokens) if counts else 0.0
        loss = loss * share
        with distributed.gradient_sync(policy.forward, enabled=step == len(batches) - 1):
            (loss * world.size).backward()          # DDP and FSDP2 average gradients over ranks
        summed["loss"] += loss.item()
        token_share = float(mask.sum()) / max(1.0, total_tokens) if counts else 0.0
        for name, value in metrics.items():
            summed[name] = summed.get(name, 0.0) + value.item() * token_share
    names = sorted(summed)
    return dict(zip(names, distributed.all_reduce_sum([summed[n] for n in names], world, device)))


def policy_update(policy: Policy, optimizer, rollout: dict, config: TrainConfig,
                  world: distributed.World = distributed.World()) -> dict:
    """One optimizer step of grpo_loss over the rollout, with grad-norm clipping."""
    summed = accumulate_gradients(policy, rollout, config, world)
    norm = torch.nn.utils.clip_grad_norm_(policy.forward.parameters(), config.max_grad_norm)
    summed["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return summed


def supervised_warm_start(model, tokenizer, samples: list, config: TrainConfig, log) -> float:
    """sft_steps of next-token training on prompt -> solution<eos>, the loss from token_logprobs."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.sft_learning_rate)
    rng = random.Random(config.seed)
    loss_value = float("nan")
    for step in range(config.sft_steps):
        batch = rng.sample(samples, min(32, len(samples)))
        prompts = [prompt_text(s, tokenizer, config) for s in batch]
        full = [p + s["solution"] + tokenizer.eos_token for p, s in zip(prompts, batch)]
        encoded = tokenizer(full, return_tensors="pt", padding=True, add_special_tokens=False)
        prompt_lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        device = next(model.parameters()).device
        ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].bool().to(device)
        answer = torch.zeros_like(mask)
        for row, (length, valid) in enumerate(zip(prompt_lengths, mask.sum(1).tolist())):
            answer[row, ids.shape[1] - valid + length:] = True          # left padding: answers end each row
        hidden = final_hidden_states(model, ids, mask.long())[:, :-1]
        head = lm_head(model)
        targets = torch.where(answer[:, 1:], ids[:, 1:], 0)
        logp = gf.token_logprobs(hidden, head.weight, targets, **head.logit_kwargs())
        loss = -(logp * answer[:, 1:]).sum() / answer[:, 1:].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if step % 50 == 0 or step == config.sft_steps - 1:
            log(f"warm start {step + 1}/{config.sft_steps}: loss {loss_value:.3f}")
    return loss_value


# ------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(output_dir: str, step: int, state: dict) -> str:
    """Writes `state` (see `training_state`) as output_dir/checkpoint-{step}/state.pt: to a temporary folder
    first, then renamed, so a crash or a full disk never leaves a broken checkpoint; older ones are then removed.
    """
    final = os.path.join(output_dir, f"checkpoint-{step}")
    temporary = final + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    try:
        torch.save({"step": step, **state}, os.path.join(temporary, "state.pt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(temporary, final)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    for name in os.listdir(output_dir):                       # keep only the newest complete checkpoint
        if name.startswith("checkpoint-") and not name.endswith(".tmp") and name != os.path.basename(final):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    return final


def training_state(policy: Policy, optimizer, scheduler, ref_model=None, rng=None) -> dict:
    """Everything a resume needs, as full (unsharded) tensors keyed by parameter name, so that a checkpoint
    written by any number of processes (plain, DDP or FSDP2) resumes with any other. Call it on every rank.

    rng: the (torch, python) random states to resume with; default the current ones. ref_model: the KL
    reference (beta > 0), so that a resumed run keeps the same one.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch_rng, python_rng = rng or (torch.get_rng_state(), random.getstate())
    options = StateDictOptions(full_state_dict=True, cpu_offload=distributed.initialized())
    return {"model": distributed.full_state_dict(policy.model),
            "optimizer": get_optimizer_state_dict(policy.forward, optimizer, options=options),
            "scheduler": scheduler.state_dict(), "torch_rng": torch_rng, "python_rng": python_rng,
            "ref_model": None if ref_model is None else ref_model.state_dict()}


def load_optimizer_state(policy: Policy, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    sharded = any(hasattr(p, "device_mesh") for p in policy.forward.parameters())
    set_optimizer_state_dict(policy.forward, optimizer, state,
                             options=StateDictOptions(full_state_dict=sharded))


def latest_checkpoint(output_dir: str):
    steps = [int(name.split("-")[1]) for name in os.listdir(output_dir) if name.startswith("checkpoint-")
             and not name.endswith(".tmp")] if os.path.isdir(output_dir) else []
    return os.path.join(output_dir, f"checkpoint-{max(steps)}") if steps else None


# ----------------------------------------------------------------------------------------------- the loop
def train(config: TrainConfig, *, resume: bool = False, log=print) -> list:
    """Runs the configured GRPO training; returns the per-step metrics (also in output_dir/metrics.jsonl).
    Under torchrun, every rank runs this; rank 0 writes the metrics, plots and checkpoints."""
    import copy

    from tqdm.auto import tqdm

    from grpo_fast.train.engines import importance_weights, make_engine

    world = distributed.init(config.device)
    if config.prompts_per_step % world.size:
        raise ValueError(f"prompts_per_step must be a multiple of the number of processes ({world.size}) so that "
                         f"each rank scores whole groups, got {config.prompts_per_step}")
    if not world.is_main:
        log = lambda *_: None  # noqa: E731
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    os.makedirs(config.output_dir, exist_ok=True)
    device = resolve_device(config.device, world)
    samples = load_samples(config)
    model, tokenizer = load_model(config, samples)
    model.to(device)
    reward_fns = [load_reward(name) for name in config.rewards]
    checkpoint = latest_checkpoint(config.output_dir) if resume else None
    start_step = 0
    metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
    state = None
    if checkpoint:
        state = torch.load(os.path.join(checkpoint, "state.pt"), weights_only=False, map_location="cpu")
        model.load_state_dict(state["model"])
        torch.set_rng_state(state["torch_rng"].cpu())
        random.setstate(state["python_rng"])
        start_step = state["step"]
        if world.is_main:
            _truncate_metrics(metrics_path, start_step)
        log(f"resumed from {checkpoint} at step {start_step}")
    else:
        if world.is_main:
            open(metrics_path, "w").close()
        if config.sft_steps:                   # the same on every rank: same seed, same samples
            supervised_warm_start(model, tokenizer, samples, config, log)
        torch.manual_seed(config.seed + 1)
    ref_model = None
    if config.beta > 0:                        # the reference: the policy as GRPO starts (after the warm start)
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if state is not None and state.get("ref_model") is not None:
            ref_model.load_state_dict(state["ref_model"])
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    policy = Policy(model, distributed.wrap(model, config.distributed, world))
    reference_policy = None if ref_model is None else Policy.of(ref_model)
    optimizer = torch.optim.AdamW(policy.forward.parameters(), lr=config.learning_rate,
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    if state is not None:
        load_optimizer_state(policy, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    state = None
    max_prompt_tokens = max(len(ids) for ids in prompt_ids([prompt_text(s, tokenizer, config) for s in samples],
                                                           tokenizer))
    sharded = config.distributed == "fsdp2" and world.size > 1
    engine = make_engine(config, model, tokenizer, max_prompt_tokens,
                         model_dir=None if config.model == "tiny" else config.model,
                         sharded_root=policy.forward if sharded else None)
    prompts_per_rank = config.prompts_per_step // world.size
    history = []
    step = start_step
    progress = tqdm(range(start_step, config.max_steps), initial=start_step, total=config.max_steps,
                    desc="grpo", disable=None if world.is_main else True)

    def save(step_done: int, rng=None) -> None:
        snapshot = training_state(policy, optimizer, scheduler, ref_model, rng)      # a collective under FSDP2
        if world.is_main:
            save_checkpoint(config.output_dir, step_done, snapshot)
        distributed.barrier(world)

    try:
        for step in progress:
            started = time.perf_counter()
            rng_at_start = (torch.get_rng_state(), random.getstate())   # an interrupt resumes from here
            first = world.rank * prompts_per_rank      # this rank's share of the step's prompts: whole groups
            batch = prompts_for_step(samples, step, config.prompts_per_step, config.seed)[
                first:first + prompts_per_rank]
            prompts = [prompt_text(s, tokenizer, config) for s in batch]
            try:
                rollout = engine.generate(prompt_ids(prompts, tokenizer),
                                          seed=config.seed * 1_000_003 + step * 997 + first)
            except Exception as error:
                raise RuntimeError(f"step {step}: the {config.engine} engine failed to generate for prompts "
                                   f"{[p[:60] for p in prompts]}: {error}") from error
            generation_seconds = time.perf_counter() - started
            completion_mask = rollout.completion_mask
            if config.mask_truncated_completions:
                completion_mask = completion_mask & ~rollout.truncated[:, None]
            completions = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
            solutions = [s["solution"] for s in batch for _ in range(config.group_size)]
            try:
                rewards = weighted_rewards(reward_fns, config.reward_weights, completions, solution=solutions)
            except RuntimeError as error:
                raise RuntimeError(f"step {step}: {error}") from error
            rewards = torch.tensor(rewards, dtype=torch.float32)
            advantages, reward_stats = group_advantages(rewards, config.group_size, scale=config.scale_rewards,
                                                        estimator=config.advantage_estimator)
            if config.scale_rewards == "batch" and world.size > 1:
                raise ValueError("scale_rewards='batch' needs the rewards of all ranks; use 'group' or 'none'")
            inputs = dict(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                          prompt_length=rollout.prompt_length, completion_ids=rollout.completion_ids,
                          completion_mask=completion_mask, advantages=advantages.to(device))
            correct = rollout.sampling_logps is not None and config.importance_sampling != "none"
            if config.num_iterations > 1 or correct:
                inputs["old_logps"] = completion_logprobs(policy, inputs, config, world)
            if correct:
                inputs["is_ratio"] = importance_weights(inputs["old_logps"], rollout.sampling_logps,
                                                        completion_mask, config.importance_sampling,
                                                        config.importance_sampling_cap)
            if reference_policy is not None:
                inputs["ref_logps"] = completion_logprobs(reference_policy, inputs, config)
            for _ in range(config.num_iterations):
                update = policy_update(policy, optimizer, inputs, config, world)
            scheduler.step()
            engine.sync_weights(model)
            elapsed = time.perf_counter() - started
            sampled = rollout.completion_mask
            local = [float(completion_mask.sum()), float(sampled.sum()), float(sampled.shape[0]),
                     rollout.truncated.float().sum().item(), reward_stats["reward_mean"],
                     reward_stats["reward_std"], reward_stats["frac_zero_std_groups"],
                     masked_mean(inputs["is_ratio"], completion_mask).item() if correct else 0.0]
            (tokens, sampled_tokens, rows, truncated, reward_mean, reward_std, zero_std,
             is_ratio_mean) = distributed.all_reduce_sum(local, world, device)
            record = {"step": step + 1, "reward": reward_mean / world.size, "reward_std": reward_std / world.size,
                      "frac_zero_std_groups": zero_std / world.size, "loss": update["loss"],
                      "kl": update.get("kl", 0.0), "entropy": update.get("entropy", float("nan")),
                      "completion_len": sampled_tokens / rows, "truncated": truncated / rows,
                      "grad_norm": update["grad_norm"], "lr": scheduler.get_last_lr()[0],
                      "tokens_per_s": tokens / elapsed, "seconds": elapsed,
                      "generation_tokens_per_s": sampled_tokens / generation_seconds}
            if correct:
                record["is_ratio_mean"] = is_ratio_mean / world.size
            history.append(record)
            if world.is_main:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            if config.log_completions and world.is_main:
                with open(os.path.join(config.output_dir, "completions.jsonl"), "a") as f:
                    for prompt, completion, reward in list(zip(prompts, completions[::config.group_size],
                                                               rewards[::config.group_size].tolist()))[
                                                               :config.log_completions]:
                        f.write(json.dumps({"step": step + 1, "prompt": prompt, "completion": completion,
                                            "reward": reward}) + "\n")
            progress.set_postfix(reward=f"{record['reward']:.3f}", loss=f"{record['loss']:.4f}",
                                 kl=f"{record['kl']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if (step + 1) % config.save_every == 0 or step + 1 == config.max_steps:
                save(step + 1)
    except KeyboardInterrupt:
        done = len(history) + start_step      # the interrupted step left the weights as they were before it
        log(f"interrupted: saving step {done}")
        save(done, rng=rng_at_start)
        raise
    if world.is_main:
        plot_curves(metrics_path, os.path.join(config.output_dir, "curves.png"))
    return history


def _truncate_metrics(path: str, step: int) -> None:
    """Drop metric lines past the checkpoint being resumed, so the file stays one line per step."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(kept)


def plot_curves(metrics_path: str, out_path: str) -> None:
    """Reward, completion length and KL against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = [r["step"] for r in records]
    for ax, key in zip(axes, ("reward", "completion_len", "kl")):
        values = [r[key] for r in records]
        ax.plot(steps, values, marker=".", alpha=0.5 if len(values) > 20 else 1.0)
        if len(values) > 20:                   # per-step values are noisy: a 20-step running mean on top
            smooth = [sum(values[max(0, i - 19):i + 1]) / len(values[max(0, i - 19):i + 1])
                      for i in range(len(values))]
            ax.plot(steps, smooth, color="black", label="20-step mean")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
