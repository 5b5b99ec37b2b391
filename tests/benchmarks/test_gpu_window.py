"""benchmarks/gpu_window.sh on CPU: its gpu_check phase in the CPU smoke mode, stand-ins for the kernel tests and
compute-sanitizer, the install as a dry run (only the wheels whose package is missing), every result file in
OUT_DIR (8 at most: what a lease returns), the phases' budget, a kernel test phase cut at its limit, and the commit
of a copy of the tree without .git."""

import json
import os
import re
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
                                                "SUMMARY.md", "kernel_tests.txt", "memcheck.txt", "phases.tsv"}
    # each phase's line, in order of value
    phases = [line.split("\t") for line in (out / "phases.tsv").read_text().splitlines()[1:]]
    assert [p[0] for p in phases] == ["environment", "install", "kernel tests", "gpu_check", "memcheck",
                                      "vllm_sleep", "verl"]
    assert [p[1] for p in phases[:4]] == ["ok", "ok", "exit 0", "exit 0"], phases
    log = (out / "window.log").read_text()
    assert "installing wheels: no_such_package_here-1.0-py3-none-any.whl \n" in log, log
    assert "-m pip install -q --no-deps --no-build-isolation -e ." in log, log
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["finished"] and result["summary"][0].startswith("SUMMARY: PASS")
    assert "--budget 120" in result["command"] and re.search(r"done in \d+ s of 300;", log), log
    assert (out / "kernel_tests.txt").read_text().splitlines()[-1] == "12345"
    assert "gpu_check: 0, kernel tests: 0" in done.stdout and "benchmarks/results/cpu/" in log
    # verl is not in this environment, or the default window has no time left for it: said (in phases.tsv), not run
    assert phases[6][1] == "skipped" and phases[6][3]
    assert phases[5][1:] == ["skipped", "0", "no CUDA device or no vllm here"], phases   # no GPU: not run, said


def test_the_default_window_leaves_a_15_minute_lease_room_for_a_rerun():
    """WINDOW_S at most 300 s: with a machine's start of a few minutes, a second (shorter) window still fits in a
    15-minute lease. The kernel tests and gpu_check, each with its 10 s kill grace, fit in it after the environment
    and an install of half a minute, so the two most valuable phases are never cut by the window's defaults."""
    text = SCRIPT.read_text()

    def default(name):
        return int(re.search(rf"\${{{name}:-(\d+)}}", text).group(1))

    window, tests, budget = default("WINDOW_S"), default("KERNEL_TESTS_TIMEOUT"), default("GPU_CHECK_BUDGET")
    check = budget + int(re.search(r"GPU_CHECK_TIMEOUT:-\$\(\(BUDGET \+ (\d+)\)\)", text).group(1))
    assert window <= 300, window
    assert 30 + tests + 10 + check + 10 <= window, (window, tests, check)


def test_verls_main_ppo_runs_where_verl_vllm_and_ray_import(tmp_path):
    """With verl, vLLM and Ray importable (an interpreter that says so) and time left in the window, the window
    runs examples/verl_grpo.py for 2 steps in a scratch folder, removed after; its output goes into window.log and
    its last line into phases.tsv, and OUT_DIR holds no file of its own."""
    python = stand_in_python(tmp_path, """case "$*" in
  *find_spec*) echo; exit 0 ;;
  examples/verl_grpo.py*) echo "main_ppo with: $*"; exit 0 ;;
esac""")
    out = tmp_path / "out"
    done = run_window(out, {"PYTHON": str(python), "SKIP_INSTALL": "1", "WINDOW_S": "1200"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    status, result = phases_of(out)["verl"]
    ran = re.fullmatch(r"main_ppo with: examples/verl_grpo.py (\S+)/verl_grpo trainer.total_training_steps=2 "
                       r"\(0 pass\)", result)
    assert status == "exit 0" and ran, result
    assert not Path(ran.group(1)).exists() and not Path(ran.group(1)).is_relative_to(out)
    assert result.removesuffix(" (0 pass)") in (out / "window.log").read_text()
    assert len(list(out.iterdir())) <= 8 and not list(out.glob("verl*")), sorted(p.name for p in out.iterdir())


def test_the_vllm_sleep_phase_measures_then_trains_where_cuda_and_vllm_are(tmp_path):
    """With CUDA and vLLM (an interpreter that says so), the vllm_sleep phase runs grpo_fast.benchmarks.vllm_sleep,
    then 2 training steps with vllm_sleep: the measurement's JSON line and both exits in phases.tsv, the outputs in
    window.log, nothing left in OUT_DIR; a failed measurement trains nothing."""
    measured = '{"freed_gib": 23.1, "same_samples": true}'
    python = stand_in_python(tmp_path, f"""case "$*" in
  *find_spec*) exit 0 ;;
  "-m grpo_fast.benchmarks.vllm_sleep"*) echo '{measured}'; exit ${{MEASURE_EXIT:-0}} ;;
  "-m grpo_fast.cli train --engine vllm --vllm-sleep true --max-steps 2 --output-dir "*) echo "step 2 of 2"; exit 0 ;;
esac""")
    for exit_code, status, trained in (("0", "exit 0", "train exit 0"),
                                       ("1", "exit 1", "train not run: the measurement failed")):
        out = tmp_path / f"out{exit_code}"
        run_window(out, {"PYTHON": str(python), "SKIP_INSTALL": "1", "WINDOW_S": "1200", "MEASURE_EXIT": exit_code,
                         "VERL_GRPO_TIMEOUT": "5000"})            # verl: skipped
        assert phases_of(out)["vllm_sleep"] == (status, f"{measured}; measure exit {exit_code}; {trained} "
                                                        "(0 pass, 124/137 timed out)"), phases_of(out)
        assert ("step 2 of 2" in (out / "window.log").read_text()) == (exit_code == "0")
        assert len(list(out.iterdir())) <= 8


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
    """The default kernel test command: gpu_check.KERNEL_TESTS with -v -rfE, TEST_SELECT as one -k argument,
    pytest-xdist workers (one per CPU this process may use, at most 8, whatever OMP_NUM_THREADS says: nproc's 1
    there would leave the other CPUs idle) and a per-test timeout where both import; in one process without a
    per-test limit, and said so, where neither does."""
    from grpo_fast.benchmarks.gpu_check import KERNEL_TESTS

    echo = stand_in_python(tmp_path, """case "$*" in
  "-m pytest"*) printf 'pytest got:'; printf ' [%s]' "$@"; echo; exit 0 ;;
esac""")
    env = {"PYTHON": str(echo), "SKIP_INSTALL": "1", "KERNEL_TESTS": "", "WINDOW_S": "60", "OMP_NUM_THREADS": "1",
           "TEST_SELECT": "sure_tokens or layouts"}
    done = run_window(tmp_path / "out", env)
    tests = (tmp_path / "out" / "kernel_tests.txt").read_text().splitlines()[-1]
    workers = min(8, len(os.sched_getaffinity(0)))
    assert tests.startswith("pytest got: " + " ".join(f"[{a}]" for a in KERNEL_TESTS.split()[1:])), tests
    assert tests.endswith("[-p] [no:cacheprovider] [-rfE] [-v] [-k] [sure_tokens or layouts] "
                          f"[-n] [{workers}] [--timeout] [60]"), tests
    assert phases_of(tmp_path / "out")["kernel tests"][0] == "exit 0", done.stdout[-2000:]

    bare = stand_in_python(tmp_path, """case "$*" in
  "-c import xdist"|"-c import pytest_timeout") exit 1 ;;
  "-m pytest"*) printf 'pytest got:'; printf ' [%s]' "$@"; echo; exit 0 ;;
esac""")
    run_window(tmp_path / "bare", {**env, "PYTHON": str(bare)})
    tests = (tmp_path / "bare" / "kernel_tests.txt").read_text().splitlines()[-1]
    assert tests.endswith("[-rfE] [-v] [-k] [sure_tokens or layouts]"), tests
    log = (tmp_path / "bare" / "window.log").read_text()
    assert "pytest-xdist does not import here: one process" in log and "pytest-timeout does not import" in log


def test_a_kernel_test_phase_cut_at_its_limit_says_what_passed_failed_and_never_finished(tmp_path):
    """The default kernel test command over three tests, one that hangs, cut at an 8-second limit: kernel_tests.txt's
    last line and phases.tsv give the count of each outcome, the failure by name and the test running when the phase
    was cut; pytest, interrupted, still prints the failure's traceback. In one process (xdist's workers take longer
    to start than the limit on a busy CPU): test_gpu_check.py reads the workers' lines."""
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "test_cut.py").write_text(
        "import time\n\n\ndef test_a_passes():\n    pass\n\n\ndef test_b_fails():\n    assert 1 == 2\n\n\n"
        "def test_c_hangs():\n    time.sleep(600)\n")
    # the kernel test files replaced by that one, every flag the window adds kept
    python = stand_in_python(tmp_path, f"""[ "$*" = "-c import xdist" ] && exit 1
if [ "$1 $2" = "-m pytest" ]; then
  shift 2
  args=""
  for a in "$@"; do case "$a" in tests/*) ;; *) args="$args $a" ;; esac; done
  exec {sys.executable} -m pytest {tmp_path}/cut/test_cut.py $args
fi""")
    out = tmp_path / "out"
    run_window(out, {"PYTHON": str(python), "SKIP_INSTALL": "1", "KERNEL_TESTS": "", "KERNEL_TESTS_TIMEOUT": "8",
                     "WINDOW_S": "40"})
    status, result = phases_of(out)["kernel tests"]
    text = (out / "kernel_tests.txt").read_text()
    assert status == "exit 124", (status, result, text[-2000:])
    assert result.startswith("3 tests: 1 passed, 1 failed, 0 skipped, 1 unfinished; failed: "), result
    assert "test_cut.py::test_b_fails; running when cut: " in result and result.count("test_c_hangs") == 1, result
    assert text.splitlines()[-1] + " (0 pass, 1 failures, 124/137 timed out)" == result
    assert "assert 1 == 2" in text


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
