"""The rollout process's lifetime: it dies with the trainer whatever the signal and leaves nothing in /dev/shm;
one that cannot start, or a script that would start it again, says what to change in one line."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.train.rollout.generation import EngineStartError  # noqa: E402
from grpo_fast.train.rollout.process import RolloutProcess  # noqa: E402
from tests.helpers import flat_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY_RUN = ["--max-staleness", "1", "--sft-steps", "0", "--max-steps", "10000", "--save-every", "10000",
            "--group-size", "2", "--prompts-per-step", "2", "--eval-every", "0"]
linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")


def environment():
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    return env


def stat(pid: int):
    """(state, ppid) of a live process, None once it is gone (or a zombie: dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else (fields[0], int(fields[1]))


def children(pid: int) -> dict:
    """{child pid: its command line} of the live children of `pid`."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat(int(entry)) or (None, None))[1] == pid:
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as file:
                    found[int(entry)] = file.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
    return found


def shm_inodes(pids) -> set:
    """The inodes of the /dev/shm files (named semaphores, shared memory) that these processes have mapped: a
    file of /dev/shm with one of them after the processes are gone is one they left behind."""
    inodes = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as file:
                inodes.update(int(line.split()[4]) for line in file if "/dev/shm/" in line)
        except OSError:
            pass
    return inodes


def left_in_shm(inodes: set) -> list:
    left = []
    for name in os.listdir("/dev/shm"):
        try:
            if os.stat(os.path.join("/dev/shm", name)).st_ino in inodes:
                left.append(name)
        except OSError:
            pass
    return left


class Trainer:
    """A real `grpo-fast train --max-staleness 1` run in its own process group, watched from /proc."""

    def __init__(self, output_dir):
        self.output_dir = str(output_dir)
        self.log = open(f"{self.output_dir}.log", "w")
        temp = f"{self.output_dir}-tmp"       # multiprocessing's temp folder, which a SIGKILL leaves: not in /tmp
        os.makedirs(temp)
        self.process = subprocess.Popen([sys.executable, "-m", "grpo_fast.cli", "train", *TINY_RUN, "--output-dir",
                                         self.output_dir], stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**environment(), "TMPDIR": temp}, cwd=ROOT, start_new_session=True)

    def wait_until_serving(self, timeout=120) -> dict:
        """Waits until the engine is ready (the run's first file is written after it) and returns the trainer's
        children: the rollout process and multiprocessing's resource tracker."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.tail()
            if os.path.exists(os.path.join(self.output_dir, "metrics.jsonl")):
                found = children(self.process.pid)
                if any("spawn_main" in line for line in found.values()):
                    return found
            time.sleep(0.2)
        raise AssertionError(f"the rollout process did not start within {timeout} s\n{self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        with open(self.log.name) as file:
            return file.read()[-3000:]

    def stop(self) -> None:
        """Kills what is left of the run's process group (a failed check leaves orphans there)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.log.close()


def gone_within(pids, seconds: float) -> list:
    """The pids still alive after `seconds` (polled)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [pid for pid in pids if stat(pid) is not None]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@linux_only
def test_the_rollout_process_dies_with_the_trainer_and_leaves_no_shared_memory(tmp_path):
    """A SIGKILL of the trainer (nothing runs in it afterwards) and a SIGTERM (`timeout`, `docker stop`): within a
    few seconds the rollout process and the resource tracker are gone, and so is every /dev/shm file they or the
    trainer had open (multiprocessing's queues were named semaphores there). Both trainers run at once."""
    trainers = {signal.SIGKILL: Trainer(tmp_path / "killed"), signal.SIGTERM: Trainer(tmp_path / "terminated")}
    try:
        watched = {}
        for signum, trainer in trainers.items():
            found = trainer.wait_until_serving()
            watched[signum] = (found, shm_inodes([trainer.process.pid, *found]))
            assert any("resource_tracker" in line for line in found.values()), found
        for signum, trainer in trainers.items():
            os.kill(trainer.process.pid, signum)
        for signum, trainer in trainers.items():
            trainer.process.wait(timeout=60)        # SIGTERM: the trainer may save a checkpoint first
            found, inodes = watched[signum]
            alive = gone_within(found, 10)
            assert not alive, (signum.name, {pid: found[pid] for pid in alive}, trainer.tail())
            assert not left_in_shm(inodes), (signum.name, left_in_shm(inodes))
    finally:
        for trainer in trainers.values():
            trainer.stop()


def test_an_engine_that_cannot_start_is_one_line_naming_the_folder(tmp_path):
    missing = str(tmp_path / "no-model")
    config = flat_config(max_staleness=1, output_dir=str(tmp_path))
    with pytest.raises(EngineStartError, match=r"^the rollout process could not start its hf engine on "
                                               rf"{missing}: \w*Error: .*{missing}") as caught:
        RolloutProcess(config.rollout, 0, missing, torch.float32, 64, torch.device("cpu"))
    assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)   # the CLI prints one line


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vllm is not installed")
def test_a_vllm_engine_that_cannot_start_is_one_line_naming_the_folder(tmp_path):
    code = textwrap.dedent(f"""
        import torch
        from grpo_fast.train.config import TrainConfig
        from tests.helpers import flat_config
        from grpo_fast.train.rollout.engines import VLLMEngine
        try:
            VLLMEngine({str(tmp_path / "no-model")!r}, flat_config(engine="vllm").rollout, 0, 64, torch.device("cpu"))
        except ValueError as error:
            print("ERROR", type(error).__name__, error)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment(),
                            timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("ERROR ")]
    assert lines, result.stdout[-2000:] + result.stderr[-4000:]
    assert lines[0].startswith(f"ERROR EngineStartError vLLM could not start on {tmp_path / 'no-model'} "
                               "(max_model_len 64, vllm_gpu_memory_utilization 0.3): "), lines


def refusals(script) -> list:
    """The REFUSED lines a script prints when train() refuses it (it then exits with 3)."""
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=environment(),
                            timeout=120)
    refused = [line for line in result.stdout.splitlines() if line.startswith("REFUSED ")]
    assert result.returncode == 3 and refused, result.stdout[-2000:] + result.stderr[-4000:]
    return refused


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    """Spawning the rollout process imports the main script again: a training call outside `if __name__ ==
    "__main__":` would run again in it. The trainer refuses before it spawns anything."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from grpo_fast.train import TrainConfig, train

        config = TrainConfig.from_keys(max_staleness=1, sft_steps=0, max_steps=1, group_size=2,
                                       prompts_per_step=2, eval_every=0, output_dir={str(tmp_path / "run")!r})
        try:
            train(config, log=lambda *_: None)
        except ValueError as error:             # EngineStartError: the CLI prints it as one line
            print("REFUSED", error)
            sys.exit(3)
    """))
    refused = refusals(script)
    assert not os.path.exists(tmp_path / "run" / "engine_model")           # nothing written, nothing spawned
    assert refused[0] == (f"REFUSED max_staleness=1 runs the engine in a spawned process, which imports "
                                    f"{script} again and would run its training call again: put the call under "
                                    f"`if __name__ == \"__main__\":` in {script}"), refused


def test_a_rollout_process_that_dies_before_it_starts_names_the_main_module(tmp_path):
    """What the refusal above cannot see (here a script that exits when imported as the spawned process's main
    module): the process's death before it runs is named, with the likely cause and its fix."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        if __name__ == "__mp_main__":              # the rollout process importing this script again
            sys.exit(4)
        from grpo_fast.train import TrainConfig, train

        if __name__ == "__main__":
            config = TrainConfig.from_keys(max_staleness=1, sft_steps=0, max_steps=1, group_size=2,
                                           prompts_per_step=2, eval_every=0, output_dir={str(tmp_path / "run")!r})
            try:
                train(config, log=lambda *_: None)
            except ValueError as error:
                print("REFUSED", error)
                sys.exit(3)
    """))
    refused = refusals(script)
    assert refused[0] == (f"REFUSED the rollout process exited with code 4 before it started: a spawned process "
                          f"imports the trainer's main module ({script}) again, so a script must make its training "
                          f"call under `if __name__ == \"__main__\":` (its own error, if any, is printed above)")
