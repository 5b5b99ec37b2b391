"""benchmarks/gpu_window.sh on CPU: its gpu_check phase in the CPU smoke mode, a stand-in for the kernel tests, the
install as a dry run (only the wheels whose package is missing), and every result file in OUT_DIR."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_window.sh"
# gpu_check in its CPU smoke mode and a stand-in for the kernel tests: a whole window in seconds
CPU_WINDOW = {"GPU_CHECK_ARGS": "--device cpu --backend torch --quick --dtype float32 --repeats 1 --shapes 128x32x1000",
              "KERNEL_TESTS": "python -c print(12345)"}


def stand_in_python(tmp_path, cases: str):
    """An interpreter at tmp_path/python: a shell script that answers `cases` (shell lines) itself and hands every
    other call to this one."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\n{cases}\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


def run_window(out, env: dict, *args):
    return subprocess.run(["bash", str(SCRIPT), str(out), *args], capture_output=True, text=True,
                          env={**os.environ, **CPU_WINDOW, **env}, timeout=600)


def test_the_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_cpu_window_writes_every_result_and_installs_only_what_is_missing(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("pytest-8.4.2-py3-none-any.whl", "no_such_package_here-1.0-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")            # the dry run never opens them; pytest is installed here
    out = tmp_path / "out"
    done = run_window(out, {"PYTHON": sys.executable, "INSTALL_DRY_RUN": "1", "GRPO_FAST_COMMIT": "0123456789abcdef"},
                      str(wheels))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the commit handed in (a copy of the tree on a GPU machine has no .git): in the environment and gpu_check's
    assert "commit: 0123456789abcdef," in (out / "environment.txt").read_text()
    assert json.loads((out / "gpu_check.json").read_text())["environment"]["commit"] == "0123456789abcdef"
    assert {p.name for p in out.iterdir()} == {"environment.txt", "window.log", "gpu_check.log", "gpu_check.json",
                                                "SUMMARY.md", "kernel_tests.txt", "verl_grpo.txt"}
    log = (out / "window.log").read_text()
    assert "installing wheels: no_such_package_here-1.0-py3-none-any.whl \n" in log, log
    assert "-m pip install -q --no-deps --no-build-isolation -e ." in log, log
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["finished"] and result["summary"][0].startswith("SUMMARY: PASS")
    assert "--budget 180" in result["command"]
    assert (out / "kernel_tests.txt").read_text().splitlines()[-1] == "12345"
    assert "gpu_check: 0, kernel tests: 0" in done.stdout and "benchmarks/results/cpu/" in log
    # verl is not in this environment, or the default window has no time left for it: said, not run
    assert "verl main_ppo: skipped" in (out / "verl_grpo.txt").read_text()


def test_verls_main_ppo_runs_where_verl_vllm_and_ray_import(tmp_path):
    """With verl, vLLM and Ray importable (an interpreter that says so) and time left in the window, the window
    runs examples/verl_grpo.py for 2 steps into OUT_DIR/verl_grpo, its output into verl_grpo.txt."""
    python = stand_in_python(tmp_path, """case "$*" in
  *find_spec*) echo; exit 0 ;;
  examples/verl_grpo.py*) echo "main_ppo with: $*"; exit 0 ;;
esac""")
    out = tmp_path / "out"
    done = run_window(out, {"PYTHON": str(python), "SKIP_INSTALL": "1", "WINDOW_S": "1200"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "verl_grpo.txt").read_text() == (f"main_ppo with: examples/verl_grpo.py {out}/verl_grpo "
                                                   "trainer.total_training_steps=2\n")
    assert "verl main_ppo exit status 0" in (out / "window.log").read_text()


def test_a_gpu_check_that_outlives_its_timeout_leaves_its_rows_and_the_kernel_tests_still_run(tmp_path):
    """gpu_check hangs in its correctness phase (an interpreter that makes it sleep there) past a 20-second hard
    limit: killed, yet gpu_check.json holds the rows it finished, and the kernel test phase runs after it."""
    hang = stand_in_python(tmp_path, f"""if [ "$1 $2" = "-m grpo_fast.benchmarks.gpu_check" ]; then
  shift 2
  exec {sys.executable} -c 'import sys, time; import grpo_fast.benchmarks.gpu_check as g
g.correctness = lambda *args, **kwargs: time.sleep(600)
sys.exit(g.main(sys.argv[1:]))' "$@"
fi""")
    out = tmp_path / "out"
    done = run_window(out, {"PYTHON": str(hang), "SKIP_INSTALL": "1", "GPU_CHECK_TIMEOUT": "20"})
    log = (out / "window.log").read_text()
    assert done.returncode != 0 and "gpu_check exit status 124" in log, log
    assert (out / "kernel_tests.txt").read_text().splitlines()[-1] == "12345"
    assert not list(out.glob("*.tmp"))
    result = json.loads((out / "gpu_check.json").read_text())
    assert not result["finished"] and result["phases_done"] and result["end_to_end"], result
    assert (out / "SUMMARY.md").read_text().startswith("SUMMARY: ")
    assert shutil.which("timeout")
