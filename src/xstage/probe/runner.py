"""Launch the injection kernel for one configuration and turn its timers into long-format rows.

A `BurstConfig` names one measurement: path, destination mode, issuing SMs, CTAs per SM, warps,
store width, burst size, compute gap, number of bursts and how completion is observed. `launch`
runs it once on a `CommContext` destination buffer and returns the raw timers; `rows_from_launch`
converts them (cycles -> ns with each CTA's own `%globaltimer`/`clock64` ratio) into rows of
`LONG_COLUMNS`, one per CTA per burst.

Example (runs on a CPU in the interpreter too, where every timer reads 0):

    from xstage.comm import create_context
    cfg = BurstConfig(path="hbm", n_sm=2, warps=1, burst_bytes=2048, n_bursts=2)  # peer_mode "none"
    with create_context(path="hbm", loopback_world=2) as ctx:
        dest = ctx.alloc("probe_dst", (dest_elems(cfg, ctx.world),), torch.int32)
        raw = launch(ctx, dest, cfg)
        rows = rows_from_launch(cfg, raw, launch_index=0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from xstage import backend
from xstage.comm import STAGE_PROBE_FLAG
from xstage.comm.device import use_ptx, wait_bounds
from xstage.env import interpreter_active
from xstage.errors import InputError
from xstage.model.data import CONFIG_COLUMNS
from xstage.probe.kernels import (
    CTA_VALUE_STRIDE,
    TIMES_PER_BURST,
    TIMES_PER_CTA,
    burst_kernel,
    wait_flags_kernel,
)

COMPLETIONS = {"none": 0, "fence": 1, "flag": 2}
PEER_MODES = ("none", "one", "all")
VECTOR_BYTES = (4, 8, 16)
WARPS = (1, 2, 4, 8, 16, 32)
MAX_BURSTS = 4096


@dataclass(frozen=True)
class BurstConfig:
    """One probe configuration. On path `peer`, `peer_mode` is "one" (every CTA stores to the next
    rank) or "all" (CTA i stores to rank `rank + 1 + i % (world - 1)`); on the loopback paths `hbm`
    and `host` it is "none" (the stores go to the one other buffer)."""

    path: str = "host"
    peer_mode: str = "none"
    n_sm: int = 1
    ctas_per_sm: int = 1
    warps: int = 8
    vector_bytes: int = 16
    burst_bytes: int = 4096
    gap_iters: int = 0
    n_bursts: int = 1
    completion: str = "none"

    @property
    def n_ctas(self) -> int:
        return self.n_sm * self.ctas_per_sm

    @property
    def block_elems(self) -> int:
        """int32 elements one CTA stores per step (every thread one vector)."""
        return self.warps * 32 * self.vector_bytes // 4

    @property
    def step_bytes(self) -> int:
        return self.block_elems * 4

    def validate(self, sm_count: int | None = None) -> BurstConfig:
        if self.path not in ("hbm", "host", "peer"):
            raise InputError(f"path {self.path!r}: must be hbm, host or peer")
        if self.peer_mode not in PEER_MODES:
            raise InputError(f"peer_mode {self.peer_mode!r}: must be one of {PEER_MODES}")
        if (self.path == "peer") != (self.peer_mode != "none"):
            raise InputError(f"peer_mode {self.peer_mode!r}: must be 'one' or 'all' on path peer, 'none' on "
                             f"hbm and host (path {self.path})")
        if self.warps not in WARPS:
            raise InputError(f"warps {self.warps}: must be one of {WARPS}")
        if self.vector_bytes not in VECTOR_BYTES:
            raise InputError(f"vector_bytes {self.vector_bytes}: must be one of {VECTOR_BYTES}")
        if self.n_sm < 1 or (sm_count and self.n_sm > sm_count):
            raise InputError(f"n_sm {self.n_sm}: must be in 1..{sm_count or 'SM count'}")
        if not 1 <= self.ctas_per_sm <= 8:
            raise InputError(f"ctas_per_sm {self.ctas_per_sm}: must be in 1..8")
        if self.burst_bytes < self.step_bytes or self.burst_bytes % self.step_bytes:
            raise InputError(
                f"burst_bytes {self.burst_bytes}: must be a positive multiple of warps*32*vector_bytes "
                f"= {self.step_bytes}"
            )
        if self.gap_iters < 0:
            raise InputError(f"gap_iters {self.gap_iters}: must be >= 0")
        if not 1 <= self.n_bursts <= MAX_BURSTS:
            raise InputError(f"n_bursts {self.n_bursts}: must be in 1..{MAX_BURSTS}")
        if self.completion not in COMPLETIONS:
            raise InputError(f"completion {self.completion!r}: must be one of {sorted(COMPLETIONS)}")
        if self.completion == "flag" and self.path != "peer":
            raise InputError("completion 'flag': needs path 'peer' (a receiving rank)")
        return self

    def fields(self) -> dict:
        return dataclasses.asdict(self)

    def label(self) -> str:
        return (f"{self.path}-{self.peer_mode}-sm{self.n_sm}x{self.ctas_per_sm}-w{self.warps}-v{self.vector_bytes}"
                f"-B{self.burst_bytes}-g{self.gap_iters}-n{self.n_bursts}-{self.completion}")


@dataclass
class LaunchResult:
    """Raw timers of one launch: `times` [n_ctas, n_bursts, 6] (clk_gap, clk_start, clk_issued,
    clk_done, gt_start, gt_issued) and `cta` [n_ctas, 6] (gt_begin, clk_begin, gt_end, clk_end, smid,
    unused), int64 numpy arrays; `kernel` the compiled kernel (its `.asm["ptx"]`) on a GPU."""

    times: np.ndarray
    cta: np.ndarray
    kernel: object = None

    def ns_per_cycle(self) -> np.ndarray:
        """Per CTA: globaltimer ns per clock64 cycle over the whole kernel (0 where timers read 0)."""
        d_gt = (self.cta[:, 2] - self.cta[:, 0]).astype(np.float64)
        d_clk = (self.cta[:, 3] - self.cta[:, 1]).astype(np.float64)
        return np.divide(d_gt, d_clk, out=np.zeros_like(d_gt), where=d_clk > 0)

    def sm_ids(self) -> list[int]:
        return sorted({int(s) for s in self.cta[:, 4]})


def dest_elems(cfg: BurstConfig, world: int) -> int:
    """int32 elements of the destination buffer: one region per CTA of every sending rank."""
    return world * cfg.n_ctas * cfg.burst_bytes // 4


def destinations(cfg: BurstConfig, rank: int, world: int) -> list[int]:
    """Destination rank of each CTA."""
    if world < 2:
        raise InputError(f"world {world}: a probe needs at least 2 ranks (one to store to)")
    if cfg.peer_mode != "all":
        return [(rank + 1) % world] * cfg.n_ctas
    return [(rank + 1 + i % (world - 1)) % world for i in range(cfg.n_ctas)]


def expected_region(region: int, burst_bytes: int, n_bursts: int) -> torch.Tensor:
    """What region `region` holds after the last burst (int32, computed in int64 then wrapped)."""
    e = torch.arange(burst_bytes // 4, dtype=torch.int64)
    vals = (e + region * int(CTA_VALUE_STRIDE) + (n_bursts - 1)) & 0xFFFFFFFF
    return torch.where(vals >= 2**31, vals - 2**32, vals).to(torch.int32)


def launch(ctx, dest, cfg: BurstConfig) -> LaunchResult:
    """Run `cfg` once: CTAs of rank `ctx.rank` store into `dest` (a `SymmBuffer` of int32 with at least
    `dest_elems(cfg, ctx.world)` elements) of their destination ranks. Synchronises."""
    backend.require()
    cfg.validate()
    need = dest_elems(cfg, ctx.world)
    if dest.local.dtype != torch.int32 or dest.local.numel() < need:
        raise InputError(f"dest: must be int32 with >= {need} elements for {cfg.label()}")
    if cfg.completion == "flag" and ctx.signal_pad.local.numel() < ctx.world * cfg.n_ctas:
        raise InputError(f"signal_slots: need >= {ctx.world * cfg.n_ctas} for {cfg.n_ctas} CTAs per rank")
    dev = ctx.device
    dst_of_cta = torch.tensor(destinations(cfg, ctx.rank, ctx.world), dtype=torch.int32, device=dev)
    times = torch.zeros((cfg.n_ctas, cfg.n_bursts, int(TIMES_PER_BURST)), dtype=torch.int64, device=dev)
    cta = torch.zeros((cfg.n_ctas, int(TIMES_PER_CTA)), dtype=torch.int64, device=dev)
    sync = torch.zeros(1, dtype=torch.int64, device=dev)
    sink = torch.zeros(cfg.n_ctas, dtype=torch.float32, device=dev)
    compiled = burst_kernel[(cfg.n_ctas,)](
        dest.ptrs, dest.local, dst_of_cta, ctx.signal_pad.ptrs, ctx.signal_pad.local, ctx.rank * cfg.n_ctas,
        times, cta, sync, sink, cfg.n_bursts, cfg.burst_bytes // cfg.step_bytes, cfg.gap_iters,
        BLOCK=cfg.block_elems, VEC=cfg.vector_bytes // 4, COMPLETION=COMPLETIONS[cfg.completion],
        USE_PTX=use_ptx(), num_warps=cfg.warps,
    )
    return LaunchResult(times=times.cpu().numpy(), cta=cta.cpu().numpy(),
                        kernel=compiled if hasattr(compiled, "asm") else None)


def rows_from_launch(cfg: BurstConfig, raw: LaunchResult, launch_index: int) -> list[dict]:
    """Rows of `LONG_COLUMNS` (without the environment columns): one per CTA per burst, times in ns.
    `gap_ns` is empty for burst 0 (no gap before it); `completion_ns` (from the burst's start) is
    empty unless the launch observed completion. `launch_index` must differ between launches and
    configurations of one file."""
    scale = raw.ns_per_cycle()[:, None]                               # [n_ctas, 1]
    t = raw.times.astype(np.float64)
    issue = (t[:, :, 2] - t[:, :, 1]) * scale
    done = (t[:, :, 3] - t[:, :, 1]) * scale
    gap = (t[:, :, 1] - t[:, :, 0]) * scale
    base = {k: getattr(cfg, k) for k in CONFIG_COLUMNS}
    rows = []
    for i in range(raw.times.shape[0]):
        for k in range(raw.times.shape[1]):
            rows.append({
                **base, "gap_ns": round(float(gap[i, k]), 1) if k else "", "launch": launch_index, "cta": i,
                "burst_index": k, "issue_ns": round(float(issue[i, k]), 1),
                "completion_ns": round(float(done[i, k]), 1) if cfg.completion != "none" else "",
            })
    return rows


def receive(ctx, dest, cfg: BurstConfig) -> dict:
    """Receiver side of a `completion="flag"` launch on path `peer`: wait (bounded) for the last flag
    of every CTA of every rank that stores here, then check each received region byte for byte.

    Raises `CommTimeoutError` (naming this rank, the sender and stage `probe.peer_flag`) when a flag
    never comes. Returns {"regions": checked, "bad": regions whose data differ}."""
    if cfg.completion != "flag":
        raise InputError(f"completion {cfg.completion!r}: receive() needs completion 'flag'")
    slots, peers = [], []
    for s in range(ctx.world):
        if s == ctx.rank:
            continue
        for i, d in enumerate(destinations(cfg, s, ctx.world)):
            if d == ctx.rank:
                slots.append(s * cfg.n_ctas + i)
                peers.append(s)
    if not slots:
        return {"regions": 0, "bad": []}
    dev = ctx.device
    t_slot = torch.tensor(slots, dtype=torch.int32, device=dev)
    t_peer = torch.tensor(peers, dtype=torch.int32, device=dev)
    ok = torch.zeros(len(slots), dtype=torch.int32, device=dev)
    wait_flags_kernel[(len(slots),)](
        ctx.signal_pad.local, t_slot, t_peer, ok, ctx.error, cfg.n_bursts, wait_bounds(ctx.timeout_ns, use_ptx())[1],
        STAGE=STAGE_PROBE_FLAG, WAIT=True, USE_PTX=use_ptx(),
    )
    ctx.check()
    elems = cfg.burst_bytes // 4
    local = dest.local.cpu()
    bad = [r for r in slots
           if not torch.equal(local[r * elems:(r + 1) * elems], expected_region(r, cfg.burst_bytes, cfg.n_bursts))]
    return {"regions": len(slots), "bad": bad}


BURST_SIGNATURE = {
    "p_table": "*i64", "p_like": "*i32", "p_dst_of_cta": "*i32", "p_flag_table": "*i64", "p_flag_like": "*i32",
    "cta_base": "i32", "p_times": "*i64", "p_cta": "*i64", "p_sync": "*i64", "p_sink": "*fp32", "n_bursts": "i32",
    "n_steps": "i32", "gap_iters": "i32", "BLOCK": "constexpr", "VEC": "constexpr", "COMPLETION": "constexpr",
    "USE_PTX": "constexpr",
}


def compile_ptx(cfg: BurstConfig, arch: int = 90) -> str:
    """PTX of the injection kernel for `cfg` on CUDA compute capability `arch` (no GPU needed; not in
    the interpreter). Used to check that stores are vectors (`st.global.v4.b32` for 16-byte stores)."""

    if interpreter_active():
        raise InputError("compile_ptx: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg.validate()
    src = ASTSource(burst_kernel, BURST_SIGNATURE, constexprs={
        "BLOCK": cfg.block_elems, "VEC": cfg.vector_bytes // 4, "COMPLETION": COMPLETIONS[cfg.completion],
        "USE_PTX": True})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg.warps}).asm["ptx"]
