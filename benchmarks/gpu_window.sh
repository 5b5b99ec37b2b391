#!/usr/bin/env bash
# One GPU window in one command, on a machine with no package registry:
#   benchmarks/gpu_window.sh OUT_DIR [WHEELS_DIR]
# (1) the machine (nvidia-smi, versions) into OUT_DIR/environment.txt; (2) installs grpo_fast editable without
# dependencies, and those wheels of WHEELS_DIR whose package the environment lacks (trl, liger-kernel, datasets,
# pytest, ...); (3) gpu_check with a budget, under a hard timeout; (4) the kernel tests (gpu_check.KERNEL_TESTS)
# under a timeout, into OUT_DIR/kernel_tests.txt; (5) verl's main_ppo for 2 steps (examples/verl_grpo.py) where
# verl, vLLM and Ray import and time is left (a longer WINDOW_S), into OUT_DIR/verl_grpo.txt. gpu_check rewrites
# gpu_check.json and SUMMARY.md after every phase, and every step appends to OUT_DIR/window.log as it goes, so a
# crash or a timeout keeps what was measured.
# The whole window stays within WINDOW_S seconds (default 420: with the machine's start, about 9 of a
# 15-minute GPU lease, which leaves room to run a shortened window again).
#
# Settings (environment variables):
#   GRPO_FAST_COMMIT      the commit this tree is (default: git's; a copy of the tree sent to a GPU machine has
#                         no .git, so pass it: GRPO_FAST_COMMIT=$(git rev-parse HEAD) on the machine that sends it)
#   PYTHON                the interpreter (default python3)
#   GPU_CHECK_BUDGET      gpu_check's --budget in seconds (default 180)
#   GPU_CHECK_TIMEOUT     hard limit of the gpu_check phase (default 230)
#   GPU_CHECK_ARGS        more gpu_check flags, e.g. "--device cpu --backend torch --quick" (a CPU dry run)
#   KERNEL_TESTS          the kernel test command (default: gpu_check.KERNEL_TESTS, run verbosely)
#   KERNEL_TESTS_TIMEOUT  its limit in seconds (default 160, less if the window has less left)
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
WINDOW_S=${WINDOW_S:-420}
START=$SECONDS
LOG="$OUT/window.log"
export PYTHONUNBUFFERED=1                     # every row reaches the log as it is printed

log() { echo "[gpu_window $(date -u +%H:%M:%S) +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
# Which code ran: results without it cannot be compared with anything. gpu_check records it too (environment).
if GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null); then
  CHANGED="$(git status --porcelain 2>/dev/null | wc -l) paths changed"
else
  GIT_COMMIT="" CHANGED="no .git here: changes unknown"
fi
export GRPO_FAST_COMMIT=${GRPO_FAST_COMMIT:-${GIT_COMMIT:-unknown (no .git here and GRPO_FAST_COMMIT unset)}}
left() { echo $((WINDOW_S - (SECONDS - START))); }
install() {                                   # install LIMIT_S ARGS...: pip install, or its dry run
  local limit=$1; shift
  if [ "${INSTALL_DRY_RUN:-0}" = 1 ]; then log "dry run: $PY -m pip install $*"; return 0; fi
  timeout "$limit" "$PY" -m pip install "$@" >>"$LOG" 2>&1
}

# (1) the machine, before anything can fail
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
log "commit $GRPO_FAST_COMMIT; environment: $(grep -m1 -E '^python' "$OUT/environment.txt")"

# (2) install: grpo_fast editable, then only the wheels whose distribution is missing (the image's own pytest,
# say, stays as it is: replacing it could break its plugins)
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
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
      install 120 -q --no-deps --no-index $MISSING \
        || log "wheel install failed (exit $?): the rows that need them say so"
    else
      log "wheels: every package in $WHEELS is installed already"
    fi
  fi
  log "pip install --no-deps --no-build-isolation -e ."
  install 120 -q --no-deps --no-build-isolation -e . || log "editable install failed (exit $?)"
  if ! "$PY" -c "import grpo_fast.kernels, grpo_fast.benchmarks.gpu_check" >>"$LOG" 2>&1; then
    # Without the install, pyproject's package-dir mapping (kernels/ -> grpo_fast.kernels, benchmarks/ ->
    # grpo_fast.benchmarks) is rebuilt from links in this copy of the tree, with its root on the path: pytest puts
    # the root first on sys.path too (pythonpath = ["."]), so a linked tree elsewhere would be shadowed.
    log "grpo_fast not importable after the install: linking grpo_fast/kernels and grpo_fast/benchmarks here"
    [ -e grpo_fast/kernels ] || ln -s ../kernels grpo_fast/kernels
    [ -e grpo_fast/benchmarks ] || ln -s ../benchmarks grpo_fast/benchmarks
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$PY" -c 'import importlib.util as u; print("importable:", {m: bool(u.find_spec(m)) for m in
    ("grpo_fast", "trl", "liger_kernel", "datasets", "pytest")})' 2>&1 | tee -a "$OUT/environment.txt" >>"$LOG"
fi

# (3) gpu_check: it writes OUT/gpu_check.json and OUT/SUMMARY.md after every phase
CHECK_TIMEOUT=${GPU_CHECK_TIMEOUT:-230}
[ "$CHECK_TIMEOUT" -gt "$(($(left) - 30))" ] && CHECK_TIMEOUT=$(($(left) - 30))
log "gpu_check, budget ${GPU_CHECK_BUDGET:-180} s, timeout $CHECK_TIMEOUT s"
timeout -k 10 "$CHECK_TIMEOUT" "$PY" -m grpo_fast.benchmarks.gpu_check "$OUT" --budget "${GPU_CHECK_BUDGET:-180}" \
  ${GPU_CHECK_ARGS:-} >"$OUT/gpu_check.log" 2>&1
CHECK_STATUS=$?
log "gpu_check exit status $CHECK_STATUS (0 pass, 1 a correctness row failed, 124/137 timed out)"
rm -f "$OUT"/*.tmp                            # a write cut short by the timeout

# (4) the kernel tests on the same GPU, whatever gpu_check found
TESTS=${KERNEL_TESTS:-"$("$PY" -c 'from grpo_fast.benchmarks.gpu_check import KERNEL_TESTS; print(KERNEL_TESTS)' \
  2>>"$LOG") -vv --tb=short -p no:cacheprovider"}
TESTS=${TESTS/#python /$PY }
TEST_TIMEOUT=${KERNEL_TESTS_TIMEOUT:-160}
[ "$TEST_TIMEOUT" -gt "$(($(left) - 5))" ] && TEST_TIMEOUT=$(($(left) - 5))
if [ "$TEST_TIMEOUT" -lt 20 ]; then
  log "kernel tests: skipped, $(left) s left in the window" | tee "$OUT/kernel_tests.txt"
  TEST_STATUS=skipped
else
  log "kernel tests, timeout $TEST_TIMEOUT s: $TESTS"
  echo "$TESTS" >"$OUT/kernel_tests.txt"
  timeout -k 10 "$TEST_TIMEOUT" $TESTS >>"$OUT/kernel_tests.txt" 2>&1
  TEST_STATUS=$?
  log "kernel tests exit status $TEST_STATUS (0 pass, 1 failures, 124/137 timed out):" \
    "$(tail -n 1 "$OUT/kernel_tests.txt")"
fi

# (5) verl's main_ppo for 2 GRPO steps with vLLM rollouts and grpo_fast fused (examples/verl_grpo.py), where verl,
# vLLM and Ray import and VERL_GRPO_TIMEOUT (default 240) seconds are left in the window; else the reason is logged
VERL_TIMEOUT=${VERL_GRPO_TIMEOUT:-240}
if ! MISSING_VERL=$("$PY" -c 'import importlib.util as u; import sys; missing = [m for m in ("verl", "vllm", "ray")
    if not u.find_spec(m)]; print(" ".join(missing)); sys.exit(bool(missing))' 2>&1); then
  log "verl main_ppo: skipped, not importable: $MISSING_VERL" | tee "$OUT/verl_grpo.txt"
elif [ "$(left)" -lt "$VERL_TIMEOUT" ]; then
  log "verl main_ppo: skipped, $(left) s left in the window, $VERL_TIMEOUT s needed" | tee "$OUT/verl_grpo.txt"
else
  log "verl main_ppo, 2 steps, timeout $VERL_TIMEOUT s: examples/verl_grpo.py $OUT/verl_grpo"
  timeout -k 10 "$VERL_TIMEOUT" "$PY" examples/verl_grpo.py "$OUT/verl_grpo" trainer.total_training_steps=2 \
    >"$OUT/verl_grpo.txt" 2>&1
  log "verl main_ppo exit status $? (0 pass): $(tail -n 1 "$OUT/verl_grpo.txt")"
  rm -rf "$OUT/verl_grpo/checkpoints" "$OUT/verl_grpo/model"    # the step's log stays, the weights go
fi

GPU=$("$PY" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")' \
  2>/dev/null | tr 'A-Z ' 'a-z-')
log "done in $((SECONDS - START)) s; commit OUT_DIR's files under benchmarks/results/${GPU:-gpu}/"
[ -f "$OUT/SUMMARY.md" ] && cat "$OUT/SUMMARY.md"
echo "gpu_check: $CHECK_STATUS, kernel tests: $TEST_STATUS; $(tail -n 1 "$OUT/kernel_tests.txt")"
[ "$CHECK_STATUS" = 0 ] && [ "$TEST_STATUS" = 0 ]
