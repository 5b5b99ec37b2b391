"""benchmarks/gpu_window.sh on CPU: its gpu_check phase in the CPU smoke mode, stand-ins for the kernel tests and
compute-sanitizer, the install as a dry run (only the wheels whose package is missing), every result file in
OUT_DIR, the phases' budget, and the commit of a copy of the tree without .git."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def run_window(out, env: dict, *args, script=SCRIPT):
    """The window into out, with CPU_WINDOW's and env's settings; no compute-sanitizer unless env names one."""
    return subprocess.run(["bash", str(script), str(out), *args], capture_output=True, text=True,
                          env={**os.environ, "SANITIZER": "", "PATH": os.environ["PATH"], **CPU_WINDOW, **env},
                          timeout=600)


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
                                                "SUMMARY.md", "kernel_tests.txt", "memcheck.txt", "verl_grpo.txt",
                                                "phases.tsv"}
    # each phase's line, in order of value
    phases = [line.split("\t") for line in (out / "phases.tsv").read_text().splitlines()[1:]]
    assert [p[0] for p in phases] == ["environment", "install", "kernel tests", "gpu_check", "memcheck", "verl"]
    assert [p[1] for p in phases[:4]] == ["ok", "ok", "exit 0", "exit 0"], phases
    log = (out / "window.log").read_text()
    assert "installing wheels: no_such_package_here-1.0-py3-none-any.whl \n" in log, log
    assert "-m pip install -q --no-deps --no-build-isolation -e ." in log, log
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["finished"] and result["summary"][0].startswith("SUMMARY: PASS")
    assert "--budget 150" in result["command"]
    assert (out / "kernel_tests.txt").read_text().splitlines()[-1] == "12345"
    assert "gpu_check: 0, kernel tests: 0" in done.stdout and "benchmarks/results/cpu/" in log
    # verl is not in this environment, or the default window has no time left for it: said, not run
    assert (out / "verl_grpo.txt").read_text().startswith("skipped: ")
    assert phases[5][1] == "skipped"


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
    assert phases_of(out)["verl"][0] == "exit 0"


def test_a_gpu_check_that_outlives_its_timeout_leaves_its_rows_and_the_window_goes_on(tmp_path):
    """gpu_check hangs in its correctness phase (an interpreter that makes it sleep there) past a 20-second hard
    limit: killed, yet gpu_check.json holds the rows it finished, and the phases after it still run."""
    hang = stand_in_python(tmp_path, f"""if [ "$1 $2" = "-m grpo_fast.benchmarks.gpu_check" ]; then
  shift 2
  exec {sys.executable} -c 'import sys, time; import grpo_fast.benchmarks.gpu_check as g
g.correctness = lambda *args, **kwargs: time.sleep(600)
sys.exit(g.main(sys.argv[1:]))' "$@"
fi""")
    out = tmp_path / "out"
    done = run_window(out, {"PYTHON": str(hang), "SKIP_INSTALL": "1", "GPU_CHECK_TIMEOUT": "20"})
    log = (out / "window.log").read_text()
    assert done.returncode != 0 and "gpu_check: exit 124" in log, log
    assert (out / "kernel_tests.txt").read_text().splitlines()[-1] == "12345"
    assert not list(out.glob("*.tmp"))
    result = json.loads((out / "gpu_check.json").read_text())
    assert not result["finished"] and result["phases_done"] and result["end_to_end"], result
    assert (out / "SUMMARY.md").read_text().startswith("SUMMARY: ")
    assert set(phases_of(out)) >= {"memcheck", "verl"}
    assert shutil.which("timeout")


def phases_of(out) -> dict:
    """phases.tsv as {phase: (status, result)}."""
    rows = [line.split("\t") for line in (out / "phases.tsv").read_text().splitlines()[1:]]
    return {name: (status, result) for name, status, _, result in rows}


def test_the_kernel_tests_run_in_parallel_with_a_limit_per_test(tmp_path):
    """The default kernel test command: gpu_check.KERNEL_TESTS with -rfE, pytest-xdist workers and a per-test
    timeout where both import; in one process without a per-test limit, and said so, where neither does."""
    from grpo_fast.benchmarks.gpu_check import KERNEL_TESTS

    echo = stand_in_python(tmp_path, """case "$*" in
  "-m pytest"*) echo "pytest got: $*"; exit 0 ;;
esac""")
    env = {"PYTHON": str(echo), "SKIP_INSTALL": "1", "KERNEL_TESTS": "", "TEST_WORKERS": "4", "WINDOW_S": "60"}
    done = run_window(tmp_path / "out", env)
    tests = (tmp_path / "out" / "kernel_tests.txt").read_text().splitlines()[-1]
    assert tests.startswith("pytest got: " + KERNEL_TESTS.removeprefix("python "))
    assert tests.endswith("-p no:cacheprovider -rfE -n 4 --timeout 120"), tests
    assert phases_of(tmp_path / "out")["kernel tests"][0] == "exit 0", done.stdout[-2000:]

    bare = stand_in_python(tmp_path, """case "$*" in
  "-c import xdist"|"-c import pytest_timeout") exit 1 ;;
  "-m pytest"*) echo "pytest got: $*"; exit 0 ;;
esac""")
    run_window(tmp_path / "bare", {**env, "PYTHON": str(bare)})
    tests = (tmp_path / "bare" / "kernel_tests.txt").read_text().splitlines()[-1]
    assert tests.endswith("-p no:cacheprovider -rfE"), tests
    log = (tmp_path / "bare" / "window.log").read_text()
    assert "pytest-xdist does not import here: one process" in log and "pytest-timeout does not import" in log


def test_memcheck_runs_the_sanitizer_over_the_layout_tests(tmp_path):
    """With a compute-sanitizer (a stand-in that records its arguments and the allocator setting, then runs the
    command) and time left, the memcheck phase runs gpu_check.SANITIZER_TESTS under --tool memcheck."""
    sanitizer = tmp_path / "compute-sanitizer"
    sanitizer.write_text("#!/bin/sh\necho \"sanitizer got: $* caching=$PYTORCH_NO_CUDA_MEMORY_CACHING\"\n"
                         "echo '========= ERROR SUMMARY: 0 errors'\n")
    sanitizer.chmod(0o755)
    out = tmp_path / "out"
    run_window(out, {"PYTHON": sys.executable, "SKIP_INSTALL": "1", "SANITIZER": str(sanitizer),
                     "GPU_CHECK_BUDGET": "20"})
    text = (out / "memcheck.txt").read_text()
    assert "sanitizer got: --tool memcheck --error-exitcode 1" in text and "caching=1" in text, text
    assert "tests/kernels/test_gpu_numerics.py" in text and "layouts or kept_sets" in text, text
    assert phases_of(out)["memcheck"] == ("exit 0", "========= ERROR SUMMARY: 0 errors (0 clean, 124/137 timed out)")


def test_a_short_window_skips_what_it_cannot_finish_and_says_so(tmp_path):
    """WINDOW_S of 40 s: the kernel tests get what is left, gpu_check (60 s at least) and memcheck are skipped,
    each with the seconds it had and needed, in phases.tsv and the log."""
    sanitizer = tmp_path / "compute-sanitizer"
    sanitizer.write_text("#!/bin/sh\nexit 0\n")
    sanitizer.chmod(0o755)
    out = tmp_path / "out"
    done = run_window(out, {"PYTHON": sys.executable, "SKIP_INSTALL": "1", "WINDOW_S": "40",
                            "SANITIZER": str(sanitizer)})
    phases = phases_of(out)
    assert phases["kernel tests"][0] == "exit 0", done.stdout[-2000:]
    assert phases["gpu_check"][0] == "skipped" and "60 needed" in phases["gpu_check"][1], phases
    assert phases["memcheck"][0] == "skipped" and "45 needed" in phases["memcheck"][1], phases
    assert done.returncode != 0                           # gpu_check did not pass: it did not run


def test_a_copy_without_git_names_its_commit_by_tree_id(tmp_path):
    """A copy of the working tree without .git (as a GPU machine receives it) records "tree <id>", the id git gives
    the same files, which names the commit; the carried wheels folder is no part of it."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and this repository's .git")
    # the working tree's files as git would commit them, hashed into a scratch index and object folder (the
    # repository's own objects only read)
    objects = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-path", "objects"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "objects").mkdir()
    git = {**os.environ, "GIT_INDEX_FILE": str(tmp_path / "index"), "GIT_OBJECT_DIRECTORY": str(tmp_path / "objects"),
           "GIT_ALTERNATE_OBJECT_DIRECTORIES": objects}
    subprocess.run(["git", "add", "-A"], cwd=ROOT, env=git, check=True)
    expected = subprocess.run(["git", "write-tree"], cwd=ROOT, env=git, capture_output=True, text=True,
                              check=True).stdout.strip()
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, env=git, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    copy = tmp_path / "copy"
    for name in filter(None, files):
        target = copy / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target, follow_symlinks=False)
    wheels = copy / "carried-wheels"
    wheels.mkdir()
    (wheels / "trl-1.16.0-py3-none-any.whl").write_bytes(b"")
    out = tmp_path / "out"
    run_window(out, {"PYTHON": sys.executable, "SKIP_INSTALL": "1", "WINDOW_S": "30"}, str(wheels),
               script=copy / "benchmarks" / "gpu_window.sh")
    commit = (out / "environment.txt").read_text().splitlines()[1]
    assert commit.startswith(f"commit: tree {expected}, no .git here"), commit
