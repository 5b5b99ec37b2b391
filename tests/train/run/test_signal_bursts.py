"""Real bursts of Ctrl-C (SIGINT) and SIGTERM sent to a real `grpo-fast train` process, at different instants after
its periodic checkpoint: whatever the burst, the process exits with 130 and no traceback (no abort), and its last
line names the newest checkpoint on disk, which resumes. The first signal stops the run; later ones cannot cut the
save it starts, its cleanup or the interpreter's exit (`signals.StopOnce`); one that lands inside torch's own zip
writer is still a stop (`signals.interrupt_behind`)."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")

from grpo_fast.train.saved import checkpoint  # noqa: E402

ARGUMENTS = ["--save-every", "1", "--eval-every", "0", "--group-size", "4", "--prompts-per-step", "4",
             "--sft-steps", "0"]


def start(output_dir, *extra):
    return subprocess.Popen([sys.executable, "-m", "grpo_fast.cli", "train", "--output-dir", str(output_dir),
                             *ARGUMENTS, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# (signals, seconds between them, seconds after checkpoint-2 appears): bursts from 1 ms to 40 ms apart, landing
# in the periodic save, the step after it, the interrupt save and the exit
BURSTS = {"2 x SIGINT 20 ms": ([signal.SIGINT] * 2, 0.02, 0.0), "3 x SIGINT 1 ms": ([signal.SIGINT] * 3, 0.001, 0.0),
          "5 x SIGINT 3 ms": ([signal.SIGINT] * 5, 0.003, 0.05),
          "SIGINT then 2 x SIGTERM 5 ms": ([signal.SIGINT, signal.SIGTERM, signal.SIGTERM], 0.005, 0.01)}


@pytest.mark.parametrize("burst", BURSTS)
def test_a_burst_of_stops_exits_130_naming_the_newest_checkpoint(tmp_path, burst):
    signums, gap, after = BURSTS[burst]
    run = tmp_path / "run"
    process = start(run, "--max-steps", "500")
    deadline = time.monotonic() + 240
    while not os.path.isdir(run / "checkpoint-2") and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert process.poll() is None, process.communicate()[1][-3000:]
    time.sleep(after)
    for signum in signums:
        process.send_signal(signum)
        time.sleep(gap)
    _, err = process.communicate(timeout=240)
    assert process.returncode == 130 and "Traceback" not in err, (process.returncode, err[-3000:])
    newest = checkpoint.latest_checkpoint(str(run))
    assert err.strip().splitlines()[-1] == f"stopped; resume from {newest} with --resume", err[-2000:]
    done = checkpoint.checkpoint_step(os.path.basename(newest))
    resumed = start(run, "--max-steps", str(done + 1), "--resume")
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err[-3000:]
    assert checkpoint.latest_checkpoint(str(run)) == str(run / f"checkpoint-{done + 1}")
