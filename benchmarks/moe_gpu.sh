#!/usr/bin/env bash
# Device runs of the fused MoE layer on one GPU: correctness, EP=1 vs the grouped_mm chain, the grid.
# Usage (repository root): XSTAGE_GIT_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/moe_gpu.sh \
#   [check] [precompile] [ep1] [calibrate] [op] [multirank] [pace] [grid] [fp8ep1] [fp8blocks] [fp8cal] [fp8grid]
#   [callcheck] [callep1] [callgrid] [calldecode] [calltf]   (results under $OUT or benchmarks/results)
set -u
if [ -z "${XSTAGE_GIT_COMMIT:-}" ]; then  # results must name the code that made them; no fallback
  echo "$(basename "$0"): set XSTAGE_GIT_COMMIT to this tree's commit, e.g." \
    "XSTAGE_GIT_COMMIT=\$(git rev-parse --short=12 HEAD) bash $0" >&2
  exit 2
fi
export XSTAGE_GIT_COMMIT
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src
OUT_DIR=${OUT:-benchmarks/results}/h200-moe
mkdir -p "$OUT_DIR"
steps=${*:-check ep1 multirank}
# The pacing sweep's default variants (sweep 1 of benchmarks/results/h200-moe-pacing/): three
# schedules unpaced, and paced at 44, 50 and 55 GB/s (0.8, 0.9 and 1.0 of the host profile's 55.4 GB/s
# drain) with a 1 MiB budget, and at 50 GB/s with 256 KiB and 2 MiB.
PACE_VARIANTS=${PACE_VARIANTS:-$(for s in expert_wave interleaved lag:16; do
  for p in off 44:1024 50:1024 55:1024 50:256 50:2048; do printf '%s@%s,' "$s" "$p"; done; done | sed 's/,$//')}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for step in $steps; do
  start=$(date +%s)
  case $step in
    check) timeout "${CHECK_S:-100}" python3 -u -m pytest -q -s -m gpu tests/moe/test_gpu_check.py -p no:cacheprovider \
             2>&1 | tail -40 ;;
    precompile)  # compile each block variant of EP1_BLOCKS in its own process, side by side (Triton's cache keeps them)
      i=0
      for spec in ${EP1_BLOCKS//,/ }; do
        timeout "${PRECOMPILE_S:-240}" python3 benchmarks/experiments/moe_ep1.py -o "/tmp/precompile-$i" --shapes "${PRECOMPILE_SHAPE:-H4096-I1536-E128-K8}" \
          --tokens 256 --blocks "$spec" --warmup 0 --rep 1 ${EP1_ARGS:-} > "/tmp/precompile-$i.log" 2>&1 &
        i=$((i + 1))
      done
      wait
      grep -h "regs=\|Error" /tmp/precompile-*.log | cut -c1-400 ;;
    ep1) timeout "${EP1_S:-130}" python3 -u benchmarks/experiments/moe_ep1.py -o "$OUT_DIR" ${EP1_BLOCKS:+--blocks "$EP1_BLOCKS"} ${EP1_ARGS:-} 2>&1 \
           | tee "$OUT_DIR/ep1.log" | grep -v "^ep1 " | tail -40 ;;
    calibrate) timeout "${CAL_S:-150}" python3 -u -m xstage plan calibrate -o "${OUT:-benchmarks/results}/h200-moe-tiles" \
                 ${CAL_ARGS:-} 2>&1 | tail -30 ;;
    op) timeout "${OP_S:-60}" python3 -u -m pytest -q -x -m gpu tests/moe/test_op.py 2>&1 | tail -15 ;;
    multirank) timeout "${MULTI_S:-70}" python3 -u -m pytest -q -x -m gpu tests/moe/test_multirank.py 2>&1 | tail -15 ;;
    pace)  # store pacing: schedules x pacings at the link-heavy configurations (EP 2-4, 4096 and 16384 tokens)
      timeout "${PACE_S:-240}" python3 -u -m xstage bench moe -o "${PACE_DIR:-${OUT:-benchmarks/results}/h200-moe-pacing}" \
        --only ep=2,4 --only tokens=4096,16384 --schedules "$PACE_VARIANTS" --warmup 2 --rep 10 2>&1 | tail -40 ;;
    fp8ep1)  # EP=1 in both dtypes, back to back per configuration: fused FP8 vs chain_fp8 and vs fused BF16
      timeout "${FP8EP1_S:-200}" python3 -u -m xstage bench moe -o "${OUT:-benchmarks/results}/h200-moe-fp8/ep1" \
        --only ep=1 --dtype bf16,fp8 --schedules "${FP8EP1_SCHEDULES:-expert_wave,lag:8}" --warmup 3 --rep 15 \
        2>&1 | tail -45 ;;
    fp8blocks)  # FP8 tile variants at EP=1, one schedule: each --block of FP8_BLOCKS into its own folder
      i=0
      for spec in ${FP8_BLOCKS:-128:128:128:128:8:4:d 128:128:128:128:8:4:td 128:128:128:128:8:3:td}; do
        timeout "${FP8BLOCK_S:-120}" python3 -u -m xstage bench moe -o "${OUT:-benchmarks/results}/h200-moe-fp8/blocks/$i" \
          --only ep=1 --dtype fp8 --block "$spec" --schedules lag:8 --warmup 3 --rep 15 2>&1 | grep -E "lag:8|Error" | cut -c1-200
        i=$((i + 1))
      done ;;
    fp8cal)  # FP8 tile costs (the buffer's default FP8 tiles) on the two calibration shapes
      timeout "${FP8CAL_S:-120}" python3 -u -m xstage plan calibrate --dtype fp8 \
        -o "${OUT:-benchmarks/results}/h200-moe-fp8/tiles" --shapes "${FP8CAL_SHAPES:-H4096-I2048-E256-K6,H1152-I4608-E8-K2}" \
        --tokens 1024,4096,16384 2>&1 | tail -20 ;;
    fp8grid)  # the 84 host configurations in both dtypes, the planner's 7 schedules at the default pacing
      timeout "${FP8GRID_S:-540}" python3 -u -m xstage bench moe -o "${OUT:-benchmarks/results}/h200-moe-fp8/grid" \
        --only ep=2,4,8 --dtype bf16,fp8 --budget-s "${FP8GRID_BUDGET_S:-470}" --warmup 2 --rep 10 2>&1 | tail -30 ;;
    callcheck) timeout "${CALLCHECK_S:-150}" python3 -u -m pytest -q -m gpu tests/bench/test_calls.py \
                 tests/bench/test_moe_calls.py -p no:cacheprovider 2>&1 | tail -20 ;;
    callep1|callgrid|calldecode)  # kernels and public calls: EP=1; EP 2 and 8 from 256 tokens; decode sizes
      case $step in
        callep1) args="--only ep=1" ;;
        callgrid) args="--only ep=2,8" ;;
        calldecode) args="--grid decode" ;;
      esac
      dir="${CALL_DIR:-${OUT:-benchmarks/results}/h200-moe-calls}/${step#call}"
      mkdir -p "$dir"
      # SM clock and power every 200 ms beside the run: the calls' sustained load against the kernels'
      # short timed runs (`loop_ns` is the kernels under the calls' load).
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 200 \
        > "$dir/clocks-${start}.csv" 2>/dev/null & clocks=$!
      timeout "${CALLGRID_S:-540}" python3 -u -m xstage bench moe -o "$dir" \
        $args --budget-s "${CALLGRID_BUDGET_S:-450}" --warmup 3 --rep 10 ${CALL_ARGS:-} 2>&1 | tail -60
      kill "$clocks" 2>/dev/null ;;
    calltf)  # the public call against transformers' grouped_mm experts (needs transformers 5)
      timeout "${CALLTF_S:-540}" python3 -u -m xstage bench moe-calls -o "${CALL_DIR:-${OUT:-benchmarks/results}/h200-moe-calls}/transformers" \
        --budget-s "${CALLTF_BUDGET_S:-450}" ${CALLTF_ARGS:-} 2>&1 | tail -40 ;;
    grid) timeout "${GRID_S:-250}" python3 -u -m xstage bench moe -o "${GRID_DIR:-$OUT_DIR}" --budget-s "${GRID_BUDGET_S:-200}" \
            --warmup 3 --rep 10 ${GRID_ARGS:-} 2>&1 | tail -60 ;;
  esac
  echo "== $step: $(( $(date +%s) - start )) s"
done
