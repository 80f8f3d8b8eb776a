"""Irregular trains: every CTA runs its own train of bursts, recorded burst by burst as a trace.

The regular sweeps (`xstage.probe.sweeps`) give every CTA one burst size and one gap, all starting
together: what the Burst-Gap model was fitted on. A kernel's own traffic is not that. A `Train` is
one launch in which CTA i runs its own program: per burst, its bytes and the compute (gap
iterations) before it, burst 0's being a start delay. `train_kernel` runs it and times each burst as
the regular probe does; `trace_rows` turns the timers into rows of the trace format
(`xstage.model.trace`), which `xstage model score` reads.

Families (`FAMILIES`) generate trains from a seed; which families a fit may see and which are held
out is fixed in `xstage/data/irregular-trains.json` (`split()`), committed before any was measured:

| family | what varies |
|---|---|
| mixed | sizes 4 KiB..1 MiB drawn per burst, gaps 0..20k iterations, 8..all SMs |
| zero_gap | mixed sizes back to back |
| long_gap | mixed sizes, 50k..200k iterations between bursts (the path drains in between) |
| ramp_up, ramp_down | sizes doubling 4 KiB -> 1 MiB (or halving), short random gaps |
| odd_ctas | one size per launch, random gaps, CTA counts that are not powers of two |
| staggered | regular trains, each CTA starting after its own delay |
| big_small | 1 MiB and 4 KiB bursts alternating: a small burst right after a stalled large one |
| random_all | every CTA its own length, sizes, gaps and start |

Example (the CPU interpreter runs the kernel; every timer reads 0 there):

    from xstage.comm import create_context
    t = Train("mixed", 0, "hbm", programs=(((4096, 0), (8192, 10)), ((4096, 5),)))
    with create_context(path="hbm", loopback_world=2) as ctx:
        dest = ctx.alloc("trains", (t.dest_elems(ctx.world),), torch.int32)
        raw = launch_train(ctx, dest, t)
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import numpy as np
import torch

from xstage import backend
from xstage.comm.device import use_ptx
from xstage.errors import InputError
from xstage.probe.kernels import CTA_VALUE_STRIDE, TIMES_PER_BURST, TIMES_PER_TRAIN_CTA, train_kernel
from xstage.probe.runner import MAX_BURSTS, VECTOR_BYTES, WARPS, BurstConfig, LaunchResult, destinations

KIB, MIB = 1024, 1024 * 1024
MAX_TRAIN_BURST = 4 * MIB  # bytes of one burst of a train
MAX_GAP_ITERS = 10_000_000  # compute iterations before one burst (about 10 ms)
TRAIN_PATHS = ("hbm", "host")
_ONE_PEER = BurstConfig(n_sm=1)  # `destinations` of one CTA that stores to the next rank
TRACE_ROW_COLUMNS = ["launch", "cta", "burst_index", "burst_bytes", "start_ns", "issue_ns", "completion_ns",
                     "family", "path", "warps", "vector_bytes", "smid", "gap_iters", "seed", "n_cta"]


@dataclasses.dataclass(frozen=True)
class Train:
    """One launch of irregular trains: per CTA, a program of (burst_bytes, gap_iters before the burst)."""

    family: str
    seed: int
    path: str
    programs: tuple
    warps: int = 8
    vector_bytes: int = 16

    @property
    def n_ctas(self) -> int:
        return len(self.programs)

    @property
    def step_bytes(self) -> int:
        return self.warps * 32 * self.vector_bytes

    @property
    def region_bytes(self) -> int:
        """Each CTA's region of the destination: the launch's largest burst."""
        return max(b for prog in self.programs for b, _ in prog)

    def dest_elems(self, world: int) -> int:
        return world * self.n_ctas * self.region_bytes // 4

    def label(self) -> str:
        return f"{self.family}-s{self.seed}-{self.path}-c{self.n_ctas}-w{self.warps}-v{self.vector_bytes}"

    def validate(self, sm_count: int) -> Train:
        """Refuse, naming the CTA and burst, what the kernel cannot run as described."""
        if self.path not in TRAIN_PATHS:
            raise InputError(f"path {self.path!r}: irregular trains run on {' or '.join(TRAIN_PATHS)}")
        if self.warps not in WARPS or self.vector_bytes not in VECTOR_BYTES:
            raise InputError(f"warps {self.warps}, vector_bytes {self.vector_bytes}: must be in {WARPS} and "
                             f"{VECTOR_BYTES}")
        if not 1 <= self.n_ctas <= sm_count:
            raise InputError(f"{self.label()}: {self.n_ctas} CTAs; a train has 1..{sm_count} (one per SM)")
        for c, prog in enumerate(self.programs):
            if not 1 <= len(prog) <= MAX_BURSTS:
                raise InputError(f"{self.label()}, CTA {c}: {len(prog)} bursts; must be 1..{MAX_BURSTS}")
            for k, (b, g) in enumerate(prog):
                if not (isinstance(b, int) and 0 < b <= MAX_TRAIN_BURST and b % self.step_bytes == 0):
                    raise InputError(f"{self.label()}, CTA {c}, burst {k}: burst_bytes {b!r} must be a multiple "
                                     f"of warps*32*vector_bytes = {self.step_bytes} in 1..{MAX_TRAIN_BURST}")
                if not (isinstance(g, int) and 0 <= g <= MAX_GAP_ITERS):
                    raise InputError(f"{self.label()}, CTA {c}, burst {k}: gap_iters {g!r} must be an integer in "
                                     f"0..{MAX_GAP_ITERS}")
        return self


# ---- the families ------------------------------------------------------------------------------------------

SIZES = [4 * KIB * 2**i for i in range(9)]  # 4 KiB .. 1 MiB


def _ctas(rng, sm_count: int, lo: int = 8) -> int:
    return int(rng.integers(min(lo, sm_count), sm_count + 1))


def _size(rng) -> int:
    return int(rng.choice(SIZES))


def _mixed(rng, sm_count):
    return [[(_size(rng), int(rng.integers(0, 20_001))) for _ in range(int(rng.integers(8, 25)))]
            for _ in range(_ctas(rng, sm_count))]


def _zero_gap(rng, sm_count):
    return [[(_size(rng), 0) for _ in range(int(rng.integers(8, 25)))] for _ in range(_ctas(rng, sm_count))]


def _long_gap(rng, sm_count):
    return [[(_size(rng), int(rng.integers(50_000, 200_001))) for _ in range(int(rng.integers(4, 9)))]
            for _ in range(_ctas(rng, sm_count))]


def _ramp(rng, sm_count, up: bool):
    sizes = SIZES if up else SIZES[::-1]
    return [[(b, int(rng.integers(0, 2_001))) for b in sizes] for _ in range(_ctas(rng, sm_count))]


def _odd_ctas(rng, sm_count):
    odd = [n for n in (3, 7, 13, 29, 57, 101, sm_count - 1) if 1 <= n <= sm_count and n & (n - 1)]
    n, b = int(rng.choice(odd)), _size(rng)
    return [[(b, int(rng.integers(0, 10_001))) for _ in range(16)] for _ in range(n)]


def _staggered(rng, sm_count):
    b, g = _size(rng), int(rng.choice([0, 2_000, 10_000]))
    return [[(b, int(rng.integers(0, 100_001)) if k == 0 else g) for k in range(12)]
            for _ in range(_ctas(rng, sm_count))]


def _big_small(rng, sm_count):
    g = int(rng.choice([0, 1_000, 5_000]))
    return [[(MIB if k % 2 == 0 else 4 * KIB, g) for k in range(12)] for _ in range(_ctas(rng, sm_count))]


def _random_all(rng, sm_count):
    return [[(_size(rng), int(rng.integers(0, 100_001)) if k == 0 else int(rng.choice([0, rng.integers(0, 50_001)])))
             for k in range(int(rng.integers(1, 25)))] for _ in range(_ctas(rng, sm_count, lo=1))]


FAMILIES = {"mixed": _mixed, "zero_gap": _zero_gap, "long_gap": _long_gap,
            "ramp_up": lambda rng, n: _ramp(rng, n, True), "ramp_down": lambda rng, n: _ramp(rng, n, False),
            "odd_ctas": _odd_ctas, "staggered": _staggered, "big_small": _big_small, "random_all": _random_all}


def split() -> dict:
    """The committed split: {"seed", "launches", "families": {name: "train" | "heldout"}}."""
    text = (resources.files("xstage.data") / "irregular-trains.json").read_text()
    d = json.loads(text)
    if set(d["families"]) != set(FAMILIES) or set(d["families"].values()) - {"train", "heldout"}:
        raise InputError("xstage/data/irregular-trains.json: must give each family of xstage.probe.trains "
                         "'train' or 'heldout'")
    return d


def plan_trains(path: str, sm_count: int, families=None, launches: int | None = None) -> list[Train]:
    """Every family's trains (or those of `families`) on `path` for a GPU of `sm_count` SMs, each
    family `launches` launches (default: the split file's), seeded from the split file's seed."""
    d = split()
    names = list(FAMILIES) if families is None else list(families)
    bad = [f for f in names if f not in FAMILIES]
    if bad:
        raise InputError(f"families {bad}: must be among {list(FAMILIES)}")
    out = []
    for f in names:
        for i in range(d["launches"] if launches is None else launches):
            seed = d["seed"] * 1000 + list(FAMILIES).index(f) * 100 + i
            progs = FAMILIES[f](np.random.default_rng(seed), sm_count)
            out.append(Train(f, seed, path, tuple(tuple(p) for p in progs)).validate(sm_count))
    return out


# ---- running and recording ---------------------------------------------------------------------------------


def launch_train(ctx, dest, train: Train) -> LaunchResult:
    """Run `train` once from rank `ctx.rank` into `dest` (int32, `train.dest_elems(ctx.world)` elements
    at least). Synchronises. `cta` holds TIMES_PER_TRAIN_CTA timers per CTA."""
    backend.require()
    need = train.dest_elems(ctx.world)
    if dest.local.dtype != torch.int32 or dest.local.numel() < need:
        raise InputError(f"dest: must be int32 with >= {need} elements for {train.label()}")
    dev, n, nb = ctx.device, train.n_ctas, max(len(p) for p in train.programs)
    prog = np.zeros((n, nb, 2), dtype=np.int32)
    for c, p in enumerate(train.programs):
        prog[c, :len(p)] = [(b // train.step_bytes, g) for b, g in p]
    counts = torch.tensor([len(p) for p in train.programs], dtype=torch.int32, device=dev)
    # every CTA stores to the next rank: on the loopback paths, the one other buffer
    dst = torch.tensor(destinations(_ONE_PEER, ctx.rank, ctx.world)[:1] * n, dtype=torch.int32, device=dev)
    times = torch.zeros((n, nb, int(TIMES_PER_BURST)), dtype=torch.int64, device=dev)
    cta = torch.zeros((n, int(TIMES_PER_TRAIN_CTA)), dtype=torch.int64, device=dev)
    sync = torch.zeros(1, dtype=torch.int64, device=dev)
    sink = torch.zeros(n, dtype=torch.float32, device=dev)
    compiled = train_kernel[(n,)](
        dest.ptrs, dest.local, dst, ctx.rank * n, torch.from_numpy(prog).to(dev), counts, times, cta, sync, sink,
        nb, train.region_bytes // train.step_bytes,
        BLOCK=train.step_bytes // 4, VEC=train.vector_bytes // 4, USE_PTX=use_ptx(), num_warps=train.warps)
    return LaunchResult(times=times.cpu().numpy(), cta=cta.cpu().numpy(),
                        kernel=compiled if hasattr(compiled, "asm") else None)


def expected_regions(train: Train, rank: int) -> list[np.ndarray]:
    """What each CTA's region holds after its train: element e was last written by the latest burst k
    that reached it, with `e + region * CTA_VALUE_STRIDE + k` (int32, wrapping); -1 where none did."""
    out = []
    for c, prog in enumerate(train.programs):
        region = rank * train.n_ctas + c
        last = np.full(train.region_bytes // 4, -1, dtype=np.int64)
        for k, (b, _) in enumerate(prog):
            last[: b // 4] = k
        e = np.arange(len(last), dtype=np.int64)
        vals = (e + region * int(CTA_VALUE_STRIDE) + last) & 0xFFFFFFFF
        vals = np.where(vals >= 2**31, vals - 2**32, vals)
        out.append(np.where(last >= 0, vals, -1))
    return out


def trace_rows(train: Train, raw: LaunchResult, launch_index: int) -> list[dict]:
    """Rows of `TRACE_ROW_COLUMNS` (the trace format plus the train's description), one per CTA per
    burst. Times in ns from each CTA's own `%globaltimer`/`clock64` ratio. `start_ns` is measured from
    the instant the CTAs leave their common start (`%globaltimer`, one clock for all SMs) plus the
    cycles since, so CTAs are placed on one time line within a timer tick. `smid` is the SM the CTA ran
    on (`%smid`): a CTA's drain share is persistent but not ordered by its index
    (`benchmarks/results/h100-fair-share-window/weights/`), and the SM is the next suspect."""
    scale = raw.ns_per_cycle()[:, None]
    t = raw.times.astype(np.float64)
    go_gt = raw.cta[:, 6].astype(np.float64)
    go_clk = raw.cta[:, 7].astype(np.float64)[:, None]
    start = (go_gt - go_gt.min())[:, None] + (t[:, :, 1] - go_clk) * scale
    issue = (t[:, :, 2] - t[:, :, 1]) * scale
    rows = []
    for c, prog in enumerate(train.programs):
        for k, (b, g) in enumerate(prog):
            rows.append({"launch": launch_index, "cta": c, "burst_index": k, "burst_bytes": b,
                         "start_ns": round(float(start[c, k]), 1), "issue_ns": round(float(issue[c, k]), 1),
                         "completion_ns": "", "family": train.family, "path": train.path, "warps": train.warps,
                         "vector_bytes": train.vector_bytes, "smid": int(raw.cta[c, 4]), "gap_iters": g,
                         "seed": train.seed,
                         "n_cta": train.n_ctas})
    return rows


TRACE_FILE = "traces/irregular.csv"  # under a probe folder: one row per burst per CTA (`TRACE_ROW_COLUMNS`)


def score_trains(trace, params) -> dict:
    """`xstage model score` of a trace of trains (`xstage.model.trace.Trace`, e.g. `read_trace` of a
    probe folder's `TRACE_FILE`) on `params`, per split (the committed one) and per family:
    {"heldout": summary, "train": summary} (`xstage.model.trace.Score.summary`)."""
    from xstage.model.trace import Trace, score_trace

    sides = split()["families"]
    out = {}
    for side in ("heldout", "train"):
        part = Trace([la for la in trace.launches if sides.get(la.family) == side], trace.path, trace.source)
        if part.launches:
            out[side] = score_trace(part, params).summary()
    return out
