#!/usr/bin/env bash
# Device run of the X-Stage probe on one GPU: GPU tests of comm/probe, then the host-path sweeps
# (all experiments) and an HBM control, each bounded in time. Results go under $OUT (default ./out):
#   $OUT/tests.log, $OUT/h200-host-probe/{summary.csv,summary.md,experiments.json,plots,raw/*.csv.gz}
# Usage: bash benchmarks/probe_gpu.sh [tests|sweep|all]   (run from the repository root)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
STAGE=${1:-all}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current \
  --format=csv
python3 -m xstage env

if [ "$STAGE" = tests ] || [ "$STAGE" = all ]; then
  timeout "${TESTS_S:-180}" python3 -m pytest -q -p no:cacheprovider tests/comm tests/probe/test_probe_gpu.py \
    tests/probe/test_runner.py tests/probe/test_peer_probe.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -5
  grep -E "^(FAILED|ERROR)|Error" "$OUT/tests.log" | head -20
fi

if [ "$STAGE" = sweep ] || [ "$STAGE" = all ]; then
  start=$(date +%s)
  timeout "${SWEEP_S:-240}" python3 -m xstage probe --path host --sweep all -o "$OUT/h200-host-probe" --no-fit \
    --quiet > "$OUT/host.log" 2>&1
  echo "host sweep rc=$? in $(( $(date +%s) - start )) s"
  tail -5 "$OUT/host.log"
  start=$(date +%s)
  timeout "${HBM_S:-60}" python3 -m xstage probe --path hbm --sweep first,twoburst -o "$OUT/h200-hbm-probe" \
    --no-fit --quiet > "$OUT/hbm.log" 2>&1
  echo "hbm sweep rc=$? in $(( $(date +%s) - start )) s"
  tail -3 "$OUT/hbm.log"
  for d in "$OUT"/h200-*-probe; do
    gzip -f "$d"/raw/*.csv 2>/dev/null
    [ -f "$d/summary.md" ] && sed -n '1,40p' "$d/summary.md"
  done
fi
