#!/usr/bin/env bash
# Ulysses attention on one GPU: the attention core vs cuDNN SDPA (with the SASS check), the GPU tests
# (bf16 correctness, loopback host/hbm, ranks sharing the GPU), as much of the loopback grid as the
# time allows (resumable), the per-tile traces of the fused kernel and the bulk-store (TMA) repro.
# Results (core.csv, ulysses.csv, summary.md, plots) go to $OUT/results, traces to $OUT/trace, the
# repro to $OUT/tma, logs to $OUT (default ./out/attention).
#   usage: XSTAGE_GIT_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/attention_gpu.sh \
#            [core|tests|grid|calibration|trace|tma]...   (default: core tests grid)
#   GRID_PATH=hbm puts the other ranks' buffers in device memory; GRID_EXCHANGE=X1,X2 names the
#   variants (default: every one of `xstage bench ulysses`); GRID_TURNS=N: the variants take turns in
#   N blocks of replays (default 2); `calibration` runs the planner's calibration grid into
#   $OUT/calibration, and a later `grid` step fits the planner behind `auto` on it.
set -uo pipefail
if [ -z "${XSTAGE_GIT_COMMIT:-}" ]; then  # results must name the code that made them; no fallback
  echo "$(basename "$0"): set XSTAGE_GIT_COMMIT to this tree's commit, e.g." \
    "XSTAGE_GIT_COMMIT=\$(git rev-parse --short=12 HEAD) bash $0" >&2
  exit 2
fi
export XSTAGE_GIT_COMMIT
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out/attention}
GRID_ONLY=${GRID_ONLY:-}
GRID_SECONDS=${GRID_SECONDS:-60}
RES="$OUT/results"
mkdir -p "$RES"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(core tests grid)
python3 -m xstage env
for step in "${steps[@]}"; do
  case "$step" in
    core)
      core_shapes=()
      [ -n "${CORE_SHAPES:-}" ] && core_shapes=(--core-shapes "$CORE_SHAPES")
      timeout "${CORE_TIMEOUT:-150}" python3 -m xstage bench ulysses --core -o "$RES" --warmup 3 --rep 20 \
        "${core_shapes[@]}" \
        2>&1 | tail -n 60 | tee "$OUT/core.log" ;;
    tests)
      timeout "${TESTS_TIMEOUT:-120}" python3 -m pytest -q -m gpu ${TESTS:-tests/attention} -x -p no:cacheprovider \
        2>&1 | tail -n 40 | tee "$OUT/tests.log" ;;
    grid)
      only=()
      for o in $GRID_ONLY; do only+=(--only "$o"); done
      # the fastest configuration per head dim from the core step, when it ran
      for csv in "$RES/core.csv" ${TUNED_FROM:-}; do if [ -f "$csv" ]; then only+=(--tuned-from "$csv"); fi; done
      [ -n "${GRID_EXCHANGE:-}" ] && only+=(--exchange "$GRID_EXCHANGE")
      [ -f "$OUT/calibration/ulysses.csv" ] && only+=(--calibration "$OUT/calibration/ulysses.csv")
      timeout "${GRID_TIMEOUT:-$((GRID_SECONDS + 120))}" python3 -m xstage bench ulysses -o "$RES" --path "${GRID_PATH:-host}" \
        --warmup "${GRID_WARMUP:-1}" --rep "${GRID_REP:-6}" --turns "${GRID_TURNS:-2}" --budget-s "$GRID_SECONDS" \
        "${only[@]}" 2>&1 | tail -n 80 | tee "$OUT/grid.log" ;;
    calibration)
      cal=()
      [ -n "${CAL_EXCHANGE:-}" ] && cal+=(--exchange "$CAL_EXCHANGE")
      timeout "${CAL_TIMEOUT:-240}" python3 -m xstage bench ulysses --grid calibration -o "$OUT/calibration" \
        --path "${GRID_PATH:-host}" --warmup "${GRID_WARMUP:-2}" --rep 10 --turns "${GRID_TURNS:-2}" "${cal[@]}" 2>&1 | tail -n 40 | tee "$OUT/calibration.log" ;;
    trace)
      timeout "${TRACE_TIMEOUT:-240}" python3 benchmarks/experiments/ulysses_trace.py --out "$OUT/trace" \
        2>&1 | tail -n 60 | tee "$OUT/trace.log" ;;
    tma)
      timeout "${TMA_TIMEOUT:-150}" python3 benchmarks/experiments/tma_store_repro.py --out "$OUT/tma" \
        2>&1 | tail -n 40 | tee "$OUT/tma.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
