"""Rollouts: each step's completions, from an engine in this process or from a rollout process that runs ahead.

    rollouts = start_rollouts(config, model, tokenizer, share, max_prompt_tokens)
    generation, info = rollouts.get(step)        # the step's Generation; info: staleness metrics, or {}
    rollouts.sleep()                             # the step's rollouts are taken: vllm_sleep frees vLLM's pool
    rollouts.after_update(model, step)           # the policy after step `step`'s update, into the engine
    evaluation = rollouts.generate(prompt_ids, seed, n=4)    # blocking, for the held-out evaluation
    rollouts.close()

The loop sees only this interface. `Rollouts` generates a step's completions when the loop asks for them, from
the policy as it is (max_staleness 0: on-policy). `AheadRollouts` (max_staleness k > 0) keeps k + 1 steps
submitted to a rollout process, so generation overlaps the update, each rollout at most k policy versions old.

    generation   Generation (a step's padded tensors), pack, EngineError / EngineStartError: what engines return
    engines      HFEngine (`model.generate`) and VLLMEngine (an offline `vllm.LLM`), in this process
    process      RolloutProcess: an engine in a spawned process, serving requests in order
"""

from __future__ import annotations

from grpo_fast.train.rollout.config import RolloutConfig
from grpo_fast.train.rollout.engines import engine_model_folder, log_ignored_generation_settings, make_engine
from grpo_fast.train.rollout.generation import EngineError, EngineStartError, Generation
from grpo_fast.train.rollout.process import RolloutProcess, refuse_unguarded_main

__all__ = ["AheadRollouts", "EngineError", "EngineStartError", "Generation", "Rollouts",
           "log_ignored_generation_settings", "rollout_seed", "start_rollouts"]


def rollout_seed(step: int, first_row: int, seed: int, round_: int = 0) -> int:
    """The sampling seed of a step's rollouts (one per prompt follows it) from the run's `seed`, so that a resume
    redraws them; round_: dynamic sampling's further rounds of the step (0: the step's own prompts)."""
    return seed * 1_000_003 + step * 997 + first_row + round_ * 104_729


class Rollouts:
    """A step's rollouts generated when asked for, by an engine in this process (HF on the policy itself, or a
    colocated vLLM given the weights after every update).

    engine: HFEngine or VLLMEngine; share: this rank's prompts of each step (grpo_fast.train.tasks.StepShare), whose
    seed the rollouts are drawn from; rollout: the rollout section."""

    def __init__(self, engine, share, rollout: RolloutConfig):
        self.engine, self.share, self.rollout = engine, share, rollout

    @property
    def name(self) -> str:
        """The engine's name: "hf" or "vllm"."""
        return self.rollout.engine

    def get(self, step: int) -> tuple[Generation, dict]:
        """(Generation of step `step`'s prompts, {}); EngineError names the prompts when the engine fails."""
        prompt_ids = self.share.ids(step)
        try:
            seed = rollout_seed(step, self.share.first_row, self.share.seed)
            generation = self.engine.generate(prompt_ids, seed=seed, max_tokens=self.rollout.stages.at(step))
        except Exception as error:
            texts = [text[:60] for text in self.share.at(step)[1]]
            raise EngineError(f"the {self.name} engine failed to generate for prompts {texts}: "
                              f"{error}") from error
        return generation, {}

    def sleep(self) -> None:
        """The step's rollouts are taken: the engine frees what it can for the update (with rollout.vllm_sleep,
        vLLM's pool; after_update and generate wake it)."""
        self.engine.sleep()

    def after_update(self, model, step: int) -> None:
        """The policy after step `step`'s update, into the engine (nothing to do for HF on the policy itself)."""
        self.engine.sync_weights(model)

    def generate(self, prompt_ids: list, seed: int, n=None, max_tokens=None) -> Generation:
        """n completions of each prompt (default group_size, of at most max_tokens, default max_completion_length)
        from the current policy: the evaluation's, and dynamic sampling's further rounds."""
        return self.engine.generate(prompt_ids, seed=seed, n=n, max_tokens=max_tokens)

    def close(self) -> None:
        """Nothing to stop in this process."""


class AheadRollouts(Rollouts):
    """max_staleness = k > 0: a rollout process (grpo_fast.train.rollout.process) keeps steps s .. s + k submitted
    while the trainer updates on step s, and gets step s + k + 1 right after the weights of version s + 1 (the
    policy after s + 1 optimizer steps): every rollout comes from a policy at most k versions old, and none is
    generated only to be dropped. The first get() submits the first k + 1 steps from the weights as they are (a
    resumed run regenerates the ones that were in flight). max_steps: the run's (no step is submitted past it)."""

    def __init__(self, process: RolloutProcess, share, rollout: RolloutConfig, max_steps: int):
        super().__init__(process, share, rollout)
        self.max_steps, self.started = max_steps, False

    def _submit(self, step: int) -> None:
        if step < self.max_steps:
            seed = rollout_seed(step, self.share.first_row, self.share.seed)
            self.engine.submit(step, self.share.ids(step), seed, self.rollout.stages.at(step))

    def get(self, step: int) -> tuple[Generation, dict]:
        """(Generation, info): info has the policy version it was sampled from, its staleness, the engine's
        generation and idle seconds and its tokens per second of generation. EngineError if the process failed."""
        if not self.started:
            for ahead in range(step, step + self.rollout.max_staleness + 1):
                self._submit(ahead)
            self.started = True
        generation, info = self.engine.take(step)
        info["staleness"] = step - info["policy_version"]
        info["engine_tokens_per_s"] = (float(generation.completion_mask.sum())
                                       / max(info["engine_generation_seconds"], 1e-9))
        return generation, info

    def sleep(self) -> None:
        """Nothing: the rollout process generates during the update (vllm_sleep is refused with max_staleness)."""

    def after_update(self, model, step: int) -> None:
        """Pushes the weights as version step + 1, then submits step step + 1 + k from them."""
        self.engine.sync_weights(model)
        self._submit(step + 1 + self.rollout.max_staleness)

    def close(self) -> None:
        """Stops the rollout process (idempotent)."""
        self.engine.close()


def start_process(config, model, tokenizer, max_prompt_tokens: int, policy_version: int = 0) -> RolloutProcess:
    """A RolloutProcess of the configured engine (a TrainConfig: its rollout section, the run's seed, and where
    the model's folder is) on the policy's folder, given the current weights as version `policy_version` (the
    optimizer steps they have had: a resumed run's step)."""
    refuse_unguarded_main(config.rollout.max_staleness)     # before the model folder is written
    parameter = next(model.parameters())
    folder = engine_model_folder(config.policy, config.run, model, tokenizer)
    process = RolloutProcess(config.rollout, config.run.seed, folder, parameter.dtype,
                             max_prompt_tokens + config.rollout.max_completion_length, parameter.device,
                             policy_version, config.policy.rope_scaling)
    process.sync_weights(model)
    return process


def start_rollouts(config, model, tokenizer, share, max_prompt_tokens: int, sharded_root=None,
                   policy_version: int = 0) -> Rollouts:
    """The configured rollouts: HF or vLLM in this process (max_staleness 0), else AheadRollouts over a rollout
    process. max_prompt_tokens: the longest prompt (vLLM's context is it plus max_completion_length);
    sharded_root: the FSDP2-wrapped module when the policy is sharded (see HFEngine); policy_version: the step the
    run starts from."""
    if config.rollout.max_staleness:
        return AheadRollouts(start_process(config, model, tokenizer, max_prompt_tokens, policy_version), share,
                             config.rollout, config.run.max_steps)
    return Rollouts(make_engine(config, model, tokenizer, max_prompt_tokens, sharded_root=sharded_root), share,
                    config.rollout)
