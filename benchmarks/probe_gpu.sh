#!/usr/bin/env bash
# Device run of the X-Stage probe on one GPU: GPU tests of comm/probe, the host-path sweeps (all
# experiments), an HBM control and the peer path with two ranks sharing the GPU (correctness only,
# not a timing). Everything lands in one archive, $OUT/probe.tar.gz (default OUT=./out):
#   tests.log, h200-host-probe/, h200-hbm-probe/, peer-1gpu/ (summary.csv, summary.md, plots, raw/*.csv.gz)
# The fit runs afterwards on any machine: xstage probe --analyse-only -o h200-host-probe
# Usage (repository root): XSTAGE_GIT_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/probe_gpu.sh
set -u
if [ -z "${XSTAGE_GIT_COMMIT:-}" ]; then  # results must name the code that made them; no fallback
  echo "$(basename "$0"): set XSTAGE_GIT_COMMIT to this tree's commit, e.g." \
    "XSTAGE_GIT_COMMIT=\$(git rev-parse --short=12 HEAD) bash $0" >&2
  exit 2
fi
export XSTAGE_GIT_COMMIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
WORK=$(mktemp -d)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current --format=csv
python3 -m xstage env

timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider tests/comm tests/probe/test_probe_gpu.py \
  tests/probe/test_runner.py tests/probe/test_peer_probe.py > "$WORK/tests.log" 2>&1
echo "tests rc=$?"; tail -1 "$WORK/tests.log"

run() {  # name seconds args...
  local name=$1 secs=$2; shift 2
  local start; start=$(date +%s)
  timeout "$secs" "$@" -o "$WORK/$name" --no-fit --quiet > "$WORK/$name.log" 2>&1
  echo "$name rc=$? in $(( $(date +%s) - start )) s"; tail -2 "$WORK/$name.log"
}
run h200-host-probe "${SWEEP_S:-200}" python3 -m xstage probe --path host --sweep all
run h200-hbm-probe "${HBM_S:-60}" python3 -m xstage probe --path hbm --sweep all
run peer-1gpu "${PEER_S:-90}" torchrun --nproc-per-node 2 -m xstage probe --path peer --sweep first,peers \
  --only n_sm=8 --only burst_bytes=65536

gzip -f "$WORK"/*/raw/*.csv 2>/dev/null
tar czf "$OUT/probe.tar.gz" -C "$WORK" .
ls -la "$OUT"
