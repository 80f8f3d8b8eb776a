"""Can Triton issue bulk (TMA) tensor stores into the destinations a Ulysses all-to-all writes to?

One program loads a [128, D] bf16 tile and stores it with a tensor descriptor into the [S, H, D] region
of one rank (row stride H*D, column h*D) at a row offset inside the region or straddling its start or
end (TMA must clip the rows of the neighbouring rank). The region lies inside a larger sentinel-filled
buffer, so a write outside the clipped rows shows up. Descriptors: host-side `TensorDescriptor` or
device-side `tl.make_tensor_descriptor`; destinations: device memory, pinned host memory, a peer GPU.

    PYTHONPATH=src python benchmarks/experiments/tma_store_repro.py [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import xstage  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU, before any kernel is defined)
from xstage.env import interpreter_active

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # never NVLink multicast, also in the child processes

BLOCK_M, H, HEAD, S, PAD = 128, 4, 1, 192, 16  # region rows S; PAD sentinel rows of other ranks each side
CASES = {"inside": 32, "straddle_start": -48, "straddle_end": S - 80}
DESTS, KINDS, DIMS = ("device", "host_pinned", "peer_gpu"), ("host_desc", "device_desc"), (128, 64)
SENTINEL = -7.0
COLUMNS = ["destination", "descriptor", "D", "case", "result"]


@triton.jit
def _load_tile(p_src, BLOCK_M: tl.constexpr, D: tl.constexpr):
    return tl.load(p_src + tl.arange(0, BLOCK_M)[:, None] * D + tl.arange(0, D)[None, :])


@triton.jit
def _publish(p_flag, WAIT_ASM: tl.constexpr):
    # After a descriptor store Triton emits only `cp.async.bulk.wait_group.read 0`: the shared-memory
    # source may be reused, but the global writes can still be in flight. A consumer that sees the flag
    # must see the data, so wait for the bulk stores to complete before the release.
    if WAIT_ASM:
        w = tl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tmov.u32 $0, 0;", "=r", [],
                                      dtype=tl.int32, is_pure=False, pack=1)
    else:
        w = tl.full([], 0, tl.int32)  # interpreter: no inline PTX; the store is done when it returns
    tl.debug_barrier()  # the thread that issued the bulk store need not be the one doing the atomic
    tl.atomic_add(p_flag, 1 + w, sem="release", scope="sys")  # `+ w` keeps the wait before the atomic


@triton.jit
def store_host_desc(desc, p_src, p_flag, row, col, BLOCK_M: tl.constexpr, D: tl.constexpr,
                    WAIT_ASM: tl.constexpr):
    desc.store([row, col], _load_tile(p_src, BLOCK_M, D))
    _publish(p_flag, WAIT_ASM)


@triton.jit
def store_device_desc(p_table, p_src, p_flag, n_rows, row_stride, row, col, BLOCK_M: tl.constexpr,
                      D: tl.constexpr, WAIT_ASM: tl.constexpr):
    # The base comes from an int64 address table, as xstage.comm hands peer and pinned-host buffers over.
    base = tl.multiple_of(tl.load(p_table).to(tl.pointer_type(tl.bfloat16)), 16)
    desc = tl.make_tensor_descriptor(base, shape=[n_rows, row_stride], strides=[row_stride, 1],
                                     block_shape=[BLOCK_M, D])
    desc.store([row, col], _load_tile(p_src, BLOCK_M, D))
    _publish(p_flag, WAIT_ASM)


def _error(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [""]
    # Triton's compilation errors start with a source location ("at 3:4:"); the reason is the last line.
    line = lines[-1] if lines[0].startswith("at ") else lines[0]
    return f"error: {type(e).__name__}: {line[:160]}".replace("|", "/")


def run_case(dest: str, kind: str, d: int, row: int, dev: torch.device) -> str:
    if dest == "host_pinned":
        full = torch.empty((PAD + S + PAD, H, d), dtype=torch.bfloat16, pin_memory=True)
    else:
        full = torch.empty((PAD + S + PAD, H, d), dtype=torch.bfloat16,
                           device=torch.device("cuda", 1) if dest == "peer_gpu" else dev)
    full.fill_(SENTINEL)
    region = full[PAD:PAD + S].view(S, H * d)
    src = (torch.randn(BLOCK_M, d, generator=torch.Generator().manual_seed(d + row)) + 1).to(torch.bfloat16)
    expected = full.cpu().clone().view(PAD + S + PAD, H * d)  # clone: .cpu() of a CPU tensor aliases it
    lo, hi = max(row, 0), min(row + BLOCK_M, S)
    expected[PAD + lo:PAD + hi, HEAD * d:(HEAD + 1) * d] = src[lo - row:hi - row]
    src, flag = src.to(dev), torch.zeros(1, dtype=torch.int32, device=dev)
    kw = dict(BLOCK_M=BLOCK_M, D=d, WAIT_ASM=not interpreter_active(), num_warps=4)
    if kind == "host_desc":
        desc = TensorDescriptor.from_tensor(region, [BLOCK_M, d])
        store_host_desc[(1,)](desc, src, flag, row, HEAD * d, **kw)
    else:
        table = torch.tensor([region.data_ptr()], dtype=torch.int64, device=dev)
        store_device_desc[(1,)](table, src, flag, S, H * d, row, HEAD * d, **kw)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    wrong = int((full.cpu().view(PAD + S + PAD, -1) != expected).any(dim=1).sum())
    if wrong:
        return f"mismatch: {wrong} rows wrong"
    return "ok" if int(flag.item()) == 1 else f"mismatch: flag {int(flag.item())} != 1"


def _enable_peer() -> None:
    """Let cuda:0 map cuda:1's memory (kernels run on cuda:0 and store into cuda:1)."""
    torch.empty(1, device="cuda:1")  # both primary contexts exist before enabling
    torch.cuda.set_device(0)
    from cuda.bindings import runtime as rt
    print("cudaDeviceEnablePeerAccess(1):", rt.cudaDeviceEnablePeerAccess(1, 0)[0])  # already enabled: fine


def run_group(dest: str, kind: str, d: int) -> list[dict]:
    """All row cases of one (destination, descriptor, D); skips where the hardware is missing."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip = ("skipped: no GPU" if gpus == 0 and dest != "device" else
            f"skipped: needs 2 GPUs ({gpus} visible)" if dest == "peer_gpu" and gpus < 2 else
            "skipped: cuda:0 cannot access cuda:1" if dest == "peer_gpu" and not torch.cuda.can_device_access_peer(0, 1)
            else None)
    dev = torch.device("cuda", 0) if gpus else torch.device("cpu")
    try:
        if skip is None:
            if dest == "peer_gpu":
                _enable_peer()
            # Device-side descriptors live in a global scratch that Triton takes from this allocator.
            triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    except Exception as e:  # noqa: BLE001
        skip = _error(e)
    results = []
    for row in CASES.values():
        try:
            results.append(skip or run_case(dest, kind, d, row, dev))
        except Exception as e:  # noqa: BLE001  (compile errors included)
            traceback.print_exc()
            results.append(_error(e))
    return _rows(dest, kind, d, results)


def _rows(dest: str, kind: str, d: int, results: list[str]) -> list[dict]:
    return [dict(destination=dest, descriptor=kind, D=d, case=c, result=r) for c, r in zip(CASES, results)]


def _child_groups(dest: str, kind: str, d: int) -> list[dict]:
    """Run one group in a fresh process: a faulting TMA store poisons the CUDA context of its process."""
    cmd = [sys.executable, __file__, "--group", f"{dest},{kind},{d}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=25)
    except subprocess.TimeoutExpired:
        return _rows(dest, kind, d, ["error: timed out after 25 s (hang?)"] * len(CASES))
    rows = [json.loads(ln[4:]) for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
    sys.stdout.write("".join(ln + "\n" for ln in p.stdout.splitlines() if not ln.startswith("ROW ")) + p.stderr)
    if not rows:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        rows = _rows(dest, kind, d, [f"error: child rc {p.returncode}: {tail}"] * len(CASES))
    return rows


def _environment() -> list[str]:
    env = [f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
           f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
           f"interpreter: {interpreter_active()}"]
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return env + ["- GPU: none (Triton CPU interpreter; `device` cases on CPU tensors)"]
    env.append(f"- GPUs: {n} x {torch.cuda.get_device_name(0)}")
    for args in [["--query-gpu=driver_version", "--format=csv,noheader"]] + [["topo", "-m"]] * (n > 1):
        try:
            out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30).stdout
            env.append(f"- nvidia-smi {' '.join(args)}:\n```\n{out.strip()}\n```")
        except (OSError, subprocess.SubprocessError) as e:
            env.append(f"- nvidia-smi: {e}")
    peers = [f"{i}->{j}: {torch.cuda.can_device_access_peer(i, j)}" for i in range(n) for j in range(n) if i != j]
    return env + (["- can_device_access_peer: " + ", ".join(peers)] if peers else [])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    ap.add_argument("--group", help=argparse.SUPPRESS)  # internal: DEST,KIND,D in this process
    ap.add_argument("--in-process", action="store_true", help="on a GPU, do not isolate groups in subprocesses")
    args = ap.parse_args(argv)
    if args.group:
        dest, kind, d = args.group.split(",")
        for r in run_group(dest, kind, int(d)):
            print("ROW " + json.dumps(r), flush=True)
        return []
    isolate = torch.cuda.is_available() and not args.in_process
    rows = [r for dest in DESTS for kind in KINDS for d in DIMS
            for r in (_child_groups if isolate else run_group)(dest, kind, d)]
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "tma_store_repro.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    md = ["# TMA (tensor-descriptor) stores into Ulysses all-to-all destinations", "",
          f"Tile [{BLOCK_M}, D] bf16 into region [S={S}, H={H}, D] at column {HEAD}*D; row offsets "
          f"{CASES}; {PAD} sentinel rows each side of the region.", "", *_environment(), "", *table, ""]
    (args.out / "tma_store_repro.md").write_text("\n".join(md))
    print("\n".join(table))
    return rows


if __name__ == "__main__":
    main()
