"""The unfused MoE pipeline on the same routing as the fused kernel: the baseline of the benchmarks.

`Unfused(pb, path)` gathers rank 0's routed rows, sends the rows for peers across the same store
path as the fused kernel (pinned host memory on `host`, device memory on `hbm`), runs Linear-1 as a
grouped GEMM, SwiGLU, Linear-2 as a grouped GEMM, and sends the output rows for peers back: the same
exchange bytes as the fused kernel, without the top-k reduce. `chain` is the compute alone (the EP=1
baseline).

`ChainFP8(un)` is the EP=1 FP8 chain on the same routing: quantize the rows (one scale per row),
`torch._scaled_grouped_mm` against the weights quantized per output column (rowwise scales, the
fastest FP8 grouped GEMM torch offers), SwiGLU, quantize, `torch._scaled_grouped_mm` again, with the
same `chain(a)` / `combine(out)` interface. It needs a CUDA GPU with FP8 tensor cores; elsewhere it
refuses with an `InputError` before computing anything.
"""

from __future__ import annotations

import warnings

import torch

from xstage.errors import InputError
from xstage.moe.fp8 import quantize_rowwise
from xstage.moe.problem import Problem
from xstage.moe.reference import loopback_inputs

_grouped_mm_failed: list[bool] = []


def _grouped_mm(a, w, offs):
    """`a [M, K]` rows sorted by group, `w [G, N, K]` -> `[M, N]`; torch._grouped_mm where available."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is not None and a.is_cuda and not _grouped_mm_failed:
        try:
            return fn(a, w.transpose(-2, -1), offs=offs)
        except RuntimeError as exc:  # an unsupported layout on this build: fall back to a loop of mm
            warnings.warn(f"torch._grouped_mm unavailable ({str(exc)[:120]}); using per-expert mm", stacklevel=2)
            _grouped_mm_failed.append(True)
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ w[e].t()
        start = end
    return out


class Unfused:
    """The serial pipeline on the same routing: exchange copies, grouped GEMMs, SwiGLU."""

    def __init__(self, pb: Problem, path: str):
        self.pb = pb
        _, idx_all, _, _, _ = loopback_inputs(pb.x, pb.idx, pb.w, pb.l1, pb.l2, pb.ep)
        el = pb.E // pb.ep
        rows_t, rows_k, experts, remote = [], [], [], []
        for s in range(pb.ep):
            owner = idx_all[s] // el
            t, k = torch.nonzero(owner == 0, as_tuple=True)
            rows_t.append(t)
            rows_k.append(k)
            experts.append(idx_all[s][t, k] % el)
            remote.append(torch.full_like(t, int(s != 0)))
        t, k, e, r = (torch.cat(v) for v in (rows_t, rows_k, experts, remote))
        order = torch.argsort(e, stable=True)
        self.t, self.k, self.remote = t[order], k[order], r[order].bool()
        self.offs = torch.cumsum(torch.bincount(e, minlength=el), 0).to(torch.int32)
        self.n_remote = int(self.remote.sum())
        pin = path == "host" and pb.x.is_cuda
        self.dst_in = torch.empty(self.n_remote, pb.H, dtype=pb.x.dtype, pin_memory=pin,
                                  device="cpu" if pin else pb.x.device)
        self.dst_out = torch.empty_like(self.dst_in)
        self.sel_remote = torch.nonzero(self.remote).flatten()
        self.x_sorted = pb.x[self.t].contiguous()
        self.w1, self.w2 = pb.l1, pb.l2

    def chain(self, a):
        h = _grouped_mm(a, self.w1, self.offs)
        inter = self.pb.I
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        return _grouped_mm(act, self.w2, self.offs)

    def full(self):
        a = self.pb.x[self.t]  # dispatch: gather, then the rows for peers cross the path
        if self.n_remote:
            self.dst_in.copy_(a[self.sel_remote], non_blocking=True)
        out = self.chain(a)
        if self.n_remote:
            self.dst_out.copy_(out[self.sel_remote], non_blocking=True)
        return out

    def combine(self, out):
        """Top-k weighted sum from the sorted expert outputs (used for the correctness check)."""
        y = torch.zeros(self.pb.T, self.pb.K, self.pb.H, dtype=torch.float32, device=out.device)
        y[self.t, self.k] = out.float()
        return (y * self.pb.w[:, :, None]).sum(1)


def _scaled_grouped_mm_or_refuse(device: torch.device):
    """torch._scaled_grouped_mm, or an InputError saying why this device cannot run the FP8 chain."""
    fn = getattr(torch, "_scaled_grouped_mm", None)
    if fn is None:
        raise InputError(f"dtype fp8: this torch ({torch.__version__}) has no torch._scaled_grouped_mm; the FP8 "
                         "chain needs it")
    if device.type != "cuda":
        raise InputError(f"device={device}: the FP8 chain needs torch._scaled_grouped_mm on a CUDA GPU with "
                         "FP8 tensor cores (Hopper or newer)")
    return fn


class ChainFP8:
    """The EP=1 FP8 chain on an `Unfused`'s routing: rowwise-scaled `_scaled_grouped_mm`, SwiGLU, again.

    `l1 [E, 2I, H]`, `l2 [E, H, I]`: the expert weights in any float dtype (default: the problem's);
    a block-scaled FP8 checkpoint is first dequantized (`xstage.moe.fp8.dequantize_weights`), then
    quantized here per output column, the granularity `_scaled_grouped_mm` takes."""

    def __init__(self, un: Unfused, l1: torch.Tensor | None = None, l2: torch.Tensor | None = None):
        self.un, self.pb = un, un.pb
        self._mm = _scaled_grouped_mm_or_refuse(self.pb.x.device)
        # [E, N, K] with one scale per row N = per output column; used transposed ([E, K, N], column-major).
        self.w1, self.s1 = quantize_rowwise(un.w1 if l1 is None else l1)
        self.w2, self.s2 = quantize_rowwise(un.w2 if l2 is None else l2)
        self.offs = un.offs
        self.x_sorted = un.x_sorted

    def _gemm(self, a, w8, ws):
        a8, sa = quantize_rowwise(a)
        try:
            return self._mm(a8, w8.transpose(-2, -1), sa, ws, offs=self.offs, out_dtype=torch.bfloat16)
        except RuntimeError as exc:  # an unsupported GPU or layout: one clear line instead of a C++ trace
            raise InputError(f"dtype fp8: torch._scaled_grouped_mm failed on {a.device}: "
                             f"{str(exc).splitlines()[0][:200]}") from exc

    def chain(self, a):
        h = self._gemm(a, self.w1, self.s1)  # [M, 2I] bf16
        inter = self.pb.I
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        return self._gemm(act, self.w2, self.s2)

    def combine(self, out):
        """Top-k weighted sum from the sorted expert outputs (used for the correctness check)."""
        return self.un.combine(out)
