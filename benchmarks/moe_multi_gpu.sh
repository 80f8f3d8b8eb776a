#!/usr/bin/env bash
# Device run of the MoE grid on a real expert-parallel group: one process per GPU of this node
# (torchrun, NCCL, NVLink peer stores), every configuration with EP = number of GPUs, NVLink
# multicast off. Results (4 files): $OUT/moe-peer/{topo.txt, run.log, moe.csv, summary.md}.
# The torchrun step is killed after MOE_PEER_BUDGET_S seconds; it stops starting configurations
# MOE_PEER_MARGIN_S seconds before that. moe.csv is resumable: a second run continues the grid.
# Usage (repository root):
#   XSTAGE_GIT_COMMIT=$(git rev-parse --short=12 HEAD) OUT=out MOE_PEER_BUDGET_S=180 [NPROC=2] \
#     [MOE_PEER_ARGS="--only tokens=4096"] bash benchmarks/moe_multi_gpu.sh
# NVLink stores are unpaced by default (not measured yet); to measure pacing there add variants, e.g.
#   MOE_PEER_ARGS="--schedules expert_wave,lag:4,lag:8,lag:4@336:128,lag:8@336:128"   (0.9 x 373 GB/s)
set -u
if [ -z "${XSTAGE_GIT_COMMIT:-}" ]; then  # results must name the code that made them; no fallback
  echo "$(basename "$0"): set XSTAGE_GIT_COMMIT to this tree's commit, e.g." \
    "XSTAGE_GIT_COMMIT=\$(git rev-parse --short=12 HEAD) bash $0" >&2
  exit 2
fi
export XSTAGE_GIT_COMMIT
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
OUT_DIR=${OUT:-out}/moe-peer
BUDGET=${MOE_PEER_BUDGET_S:-180}
MARGIN=${MOE_PEER_MARGIN_S:-45}
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
mkdir -p "$OUT_DIR"

{ nvidia-smi topo -m
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT_DIR/topo.txt"

start=$(date +%s)
timeout -k 15 "$BUDGET" python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  -m xstage.bench.moe_dist -o "$OUT_DIR" --budget-s $(( BUDGET > MARGIN + 20 ? BUDGET - MARGIN : 20 )) \
  --warmup 2 --rep 7 ${MOE_PEER_ARGS:-} > "$OUT_DIR/run.log" 2>&1
rc=$?
echo "== torchrun ($NPROC processes) rc=$rc in $(( $(date +%s) - start )) s (budget $BUDGET s)"
if [ "$rc" -ne 0 ]; then tail -40 "$OUT_DIR/run.log"; fi
for pat in FAIL skipped "not bitwise" "budget reached" Traceback; do
  echo "lines with '$pat': $(grep -c "$pat" "$OUT_DIR/run.log")"
done
grep -m 3 skipped "$OUT_DIR/run.log"
if [ -s "$OUT_DIR/moe.csv" ]; then
  python3 -m xstage.bench.moe_dist -o "$OUT_DIR" --summarize-only 2>&1 | tail -32
fi
ls -la "$OUT_DIR"
