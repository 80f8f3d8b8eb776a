#!/usr/bin/env bash
# Ulysses attention on one GPU: the attention core vs cuDNN SDPA (with the SASS check), the GPU tests
# (bf16 correctness, loopback host/hbm, ranks sharing the GPU), then as much of the loopback grid as
# the time allows (resumable). Results go under $OUT (default ./out/attention).
#   usage: benchmarks/attention_gpu.sh [core|tests|grid]...   (default: all three)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out/attention}
GRID_ONLY=${GRID_ONLY:-}
GRID_SECONDS=${GRID_SECONDS:-60}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(core tests grid)
python3 -m xstage env | tee "$OUT/env.txt"
for step in "${steps[@]}"; do
  case "$step" in
    core)
      timeout "${CORE_TIMEOUT:-150}" python3 -m xstage bench ulysses --core -o "$OUT/core" --warmup 3 --rep 20 \
        2>&1 | tail -n 60 | tee "$OUT/core.log" ;;
    tests)
      timeout "${TESTS_TIMEOUT:-120}" python3 -m pytest -q -m gpu tests/attention -x -p no:cacheprovider \
        2>&1 | tail -n 40 | tee "$OUT/tests.log" ;;
    grid)
      only=()
      for o in $GRID_ONLY; do only+=(--only "$o"); done
      timeout "${GRID_TIMEOUT:-$((GRID_SECONDS + 120))}" python3 -m xstage bench ulysses -o "$OUT/grid" --path host \
        --warmup 2 --rep 8 --max-seconds "$GRID_SECONDS" "${only[@]}" 2>&1 | tail -n 80 | tee "$OUT/grid.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
