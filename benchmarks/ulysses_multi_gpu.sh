#!/usr/bin/env bash
# Ulysses attention on a multi-GPU node: one process per GPU (torchrun, NCCL), the fused exchange over
# NVLink against the serial baselines, for the grid's shapes and sequence lengths with P = the GPU count.
# Prints the topology, then measures as much of the grid as BUDGET_S allows (resumable: run again with
# the same OUT to continue). Results in $OUT/ulysses-peer/: topo.txt, run.log, ulysses_peer.csv, summary.md.
#   usage (repository root): XSTAGE_GIT_COMMIT=$(git rev-parse --short=12 HEAD) OUT=out BUDGET_S=150 \
#     bash benchmarks/ulysses_multi_gpu.sh [--only KEY=V1,V2]...
#   NPROC (default: every visible GPU), WARMUP (1), REP (7).
set -uo pipefail
if [ -z "${XSTAGE_GIT_COMMIT:-}" ]; then  # results must name the code that made them; no fallback
  echo "$(basename "$0"): set XSTAGE_GIT_COMMIT to this tree's commit, e.g." \
    "XSTAGE_GIT_COMMIT=\$(git rev-parse --short=12 HEAD) bash $0" >&2
  exit 2
fi
export XSTAGE_GIT_COMMIT
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}
RES="$OUT/ulysses-peer"
BUDGET_S=${BUDGET_S:-150}
NPROC=${NPROC:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
mkdir -p "$RES"

{ nvidia-smi topo -m; python3 -c "
import torch
n = torch.cuda.device_count()
print('peer access:', [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)])
"; } 2>&1 | tee "$RES/topo.txt"
if [ "$NPROC" -lt 2 ]; then echo "ulysses_multi_gpu: needs 2 or more GPUs (NPROC=$NPROC)"; exit 2; fi

# New configurations stop starting 30 s before the budget (start-up and the last one's tail); the
# hard limit ends whatever is left. Every finished configuration is already in the CSV.
start=$(date +%s)
timeout -k 10 "$BUDGET_S" torchrun --standalone --nproc-per-node "$NPROC" -m xstage.bench.ulysses_dist \
  -o "$RES" --budget-s $((BUDGET_S > 60 ? BUDGET_S - 30 : BUDGET_S / 2)) \
  --warmup "${WARMUP:-1}" --rep "${REP:-7}" "$@" > "$RES/run.log" 2>&1
rc=$?
echo "torchrun rc=$rc in $(( $(date +%s) - start )) s (124: stopped by the ${BUDGET_S} s limit)"
sed '/^# Ulysses attention/,$d' "$RES/run.log" | grep -v "OMP_NUM_THREADS\|^W.*run.py.*\*\*\*\|run.py:[0-9]*\] *$" | tail -n 40
# the summary again, in case the time limit ended the run before rank 0 wrote it
if [ -f "$RES/ulysses_peer.csv" ]; then
  python3 -m xstage.bench.ulysses_dist -o "$RES" --summarize-only > /dev/null && cat "$RES/summary.md"
fi
ls -la "$RES"
exit $rc
