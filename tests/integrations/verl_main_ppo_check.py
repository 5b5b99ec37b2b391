"""Runs verl's `main_ppo` GRPO job of examples/verl_grpo.py on this CPU host, in verl's own mode and with grpo_fast's
fused loss, and prints what tests/integrations/test_verl_main_ppo.py checks, as JSON: each run's exit code and
seconds, and the metrics verl's console logger printed for each step.

    python tests/integrations/verl_main_ppo_check.py OUT_DIR [STEPS]

Both runs sample with per-prompt seeds (grpo_fast.integrations.vllm_cpu, GRPO_FAST_VLLM_SEED_BY_PROMPT), so their
first step's rollouts are the same and its loss, entropy, KL and gradient norm can be compared.
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


def run(out_dir: str, mode: str, steps: int) -> dict:
    command = [sys.executable, os.path.join(ROOT, "examples", "verl_grpo.py"), os.path.join(out_dir, mode), "--cpu",
               "--mode", mode, f"trainer.total_training_steps={steps}", "data.train_batch_size=16",
               "actor_rollout_ref.actor.ppo_mini_batch_size=16", "data.shuffle=False",
               "reward.custom_reward_function.name=partial_score"]
    env = {**os.environ, "GRPO_FAST_VLLM_SEED_BY_PROMPT": "0", "PYTHONPATH": ROOT}
    env.pop("TRITON_INTERPRET", None)
    started = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        sys.stderr.write(process.stdout[-4000:] + process.stderr[-8000:])
    return {"returncode": process.returncode, "seconds": round(seconds, 1),
            "steps": step_metrics(process.stdout + process.stderr)}


def main(out_dir: str, steps: int = 3) -> None:
    result = {mode: run(out_dir, mode, steps) for mode in ("verl", "fused")}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
