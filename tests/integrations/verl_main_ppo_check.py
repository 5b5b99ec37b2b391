"""Runs verl's `main_ppo` GRPO job of examples/verl_grpo.py on this CPU host, with the example's defaults, in verl's
own mode and with grpo_fast's fused loss, then with verl's optimal token baseline on the legacy trainer
(trainer.use_v1=False, the one that asks the actor for each token's sum of p^2; fused), and prints what
tests/integrations/test_verl_main_ppo.py checks, as JSON: each run's exit code and seconds, and the metrics verl's
console logger printed for each step.

    python tests/integrations/verl_main_ppo_check.py OUT_DIR [STEPS]

The example seeds its CPU rollouts by prompt itself (grpo_fast.integrations.vllm_cpu, GRPO_FAST_VLLM_SEED_BY_PROMPT),
so the two modes' first step has the same rollouts and its loss, entropy, KL and gradient norm can be compared.
"""

import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP_LINE = re.compile(r"step:(\d+) - (.*)$")


def step_metrics(output: str) -> dict:
    """{step: {metric: float}} from verl's console logger lines ("step:N - name:value - ...")."""
    steps = {}
    for line in output.splitlines():
        match = STEP_LINE.search(line)
        if not match:
            continue
        metrics = {}
        for item in match.group(2).split(" - "):
            name, _, value = item.partition(":")
            value = re.sub(r"^np\.\w+\((.*)\)$", r"\1", value.strip())
            try:
                metrics[name.strip()] = float(value)
            except ValueError:
                pass
        steps[int(match.group(1))] = metrics
    return steps


def run(out_dir: str, name: str, mode: str, steps: int, *extra: str) -> dict:
    command = [sys.executable, os.path.join(ROOT, "examples", "verl_grpo.py"), os.path.join(out_dir, name), "--cpu",
               "--mode", mode, f"trainer.total_training_steps={steps}", "data.train_batch_size=16",
               "actor_rollout_ref.actor.ppo_mini_batch_size=16", "data.shuffle=False", *extra]
    env = {**os.environ, "PYTHONPATH": ROOT}
    for variable in ("TRITON_INTERPRET", "GRPO_FAST_VLLM_SEED_BY_PROMPT"):     # the example sets its own seed
        env.pop(variable, None)
    started = time.perf_counter()
    # in out_dir: main_ppo's hydra writes its outputs/ folder where it runs
    process = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200, cwd=out_dir)
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        sys.stderr.write(process.stdout[-4000:] + process.stderr[-8000:])
    return {"returncode": process.returncode, "seconds": round(seconds, 1),
            "steps": step_metrics(process.stdout + process.stderr)}


def main(out_dir: str, steps: int = 3) -> None:
    result = {mode: run(out_dir, mode, mode, steps) for mode in ("verl", "fused")}
    result["optimal_token_baseline"] = run(out_dir, "otb", "fused", 2, "algorithm.adv_estimator=optimal_token_baseline",
                                           "trainer.use_v1=False")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
