"""Reference MoE layer in plain torch: the ground truth for the fused kernels.

Problem: each of R ranks holds `x_r [T, H]` with top-k routing `topk_idx_r [T, K]` into E experts and
weights `topk_w_r [T, K]`; rank `q` owns experts `q*E/R .. (q+1)*E/R - 1` with Linear-1 weights
`l1_q [E/R, 2I, H]` (rows `0..I-1` gate, `I..2I-1` up) and Linear-2 weights `l2_q [E/R, H, I]`.
Output: `y_r[t] = sum_k w[t,k] * L2_e(silu(gate_e(x_t)) * up_e(x_t))` with `e = topk_idx_r[t,k]`.
Optional expert biases (`b1 [E/R, 2I]`, gate then up, added before the activation; `b2 [E/R, H]`, added
to each expert's output before the router weight multiplies it) and another gated activation
(`activation`: `"silu"` or `xstage.spec.activation.ClampedSwiGLU`, GPT-OSS's clamped SwiGLU).

Algorithm (explicit expert parallelism): all-to-all dispatch of routed rows to the owning ranks,
per-expert GEMMs with SwiGLU, all-to-all combine back, top-k weighted sum, all in float32 (or the
dtype given). Two drivers: `reference_moe_virtual` simulates R ranks in one process;
`reference_moe_dist` runs on a process group with `all_to_all_single`.

Example:
    >>> import torch
    >>> from xstage.moe.reference import reference_moe_virtual
    >>> R, T, H, I, E, K = 2, 4, 8, 6, 4, 2
    >>> xs = [torch.randn(T, H) for _ in range(R)]
    >>> idx = [torch.stack([torch.randperm(E)[:K] for _ in range(T)]) for _ in range(R)]
    >>> ws = [torch.rand(T, K) for _ in range(R)]
    >>> l1 = [torch.randn(E // R, 2 * I, H) for _ in range(R)]
    >>> l2 = [torch.randn(E // R, H, I) for _ in range(R)]
    >>> [y.shape for y in reference_moe_virtual(xs, idx, ws, l1, l2)]
    [torch.Size([4, 8]), torch.Size([4, 8])]
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xstage.bounds import MAX_RANKS, check_instance, check_int
from xstage.errors import InputError
from xstage.spec.activation import SILU, check_activation


def gated(gate: torch.Tensor, up: torch.Tensor, activation=SILU) -> torch.Tensor:
    """The gated activation of `gate` and `up` (`xstage.spec.activation`)."""
    activation = check_activation(activation)
    if activation == SILU:
        return torch.nn.functional.silu(gate) * up
    g = gate.clamp(max=activation.limit)  # the gate is clamped from above only
    u = up.clamp(min=-activation.limit, max=activation.limit)
    return (u + 1) * (g * torch.sigmoid(activation.alpha * g))


def expert_mlp(x: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, b1: torch.Tensor | None = None,
               b2: torch.Tensor | None = None, activation=SILU) -> torch.Tensor:
    """One expert: `x [M, H]`, `l1 [2I, H]`, `l2 [H, I]`, optional biases `b1 [2I]`, `b2 [H]` -> `[M, H]`
    (the gated `activation` between the GEMMs)."""
    inter = l1.shape[0] // 2
    h = x @ l1.t()  # [M, 2I]
    if b1 is not None:
        h = h + b1
    out = gated(h[:, :inter], h[:, inter:], activation) @ l2.t()
    return out if b2 is None else out + b2


def _expert_outputs(rows: torch.Tensor, experts: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor,
                    b1=None, b2=None, activation=SILU):
    """Rows received by one rank, `experts` their local expert ids -> expert outputs, same order."""
    out = torch.zeros(rows.shape[0], l2.shape[1], dtype=rows.dtype, device=rows.device)
    for e in torch.unique(experts).tolist():
        sel = experts == e
        out[sel] = expert_mlp(rows[sel], l1[e], l2[e], None if b1 is None else b1[e], None if b2 is None else b2[e],
                              activation)
    return out


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


def _rank(per_rank, q: int):
    return None if per_rank is None else per_rank[q]


def check_topk_idx(topk_idx: torch.Tensor, num_experts: int, label: str = "topk_idx") -> None:
    """Refuse expert ids outside [0, num_experts) or a non-integer / non-2-d `topk_idx` (`InputError`)."""
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.is_meta:
        raise InputError(f"{label}: must be a 2-d [tokens, topk] tensor of expert ids (holding data)")
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        raise InputError(f"{label}: must hold integer expert ids, got dtype {topk_idx.dtype}")
    if topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            raise InputError(f"{label}: expert id {bad} is outside [0, {num_experts}) "
                             f"({num_experts} experts = local experts x ranks)")


def reference_moe_virtual(xs, topk_idx, topk_w, l1, l2, dtype=torch.float32, b1=None, b2=None, activation=SILU):
    """R virtual ranks in one process: lists of per-rank tensors in, list of per-rank `y [T, H]` out.
    `b1`, `b2` (optional) are lists of per-rank biases like `l1`, `l2`; `activation` as `expert_mlp`."""
    R = len(xs)
    activation = check_activation(activation)
    for name, b in (("b1", b1), ("b2", b2)):
        if b is not None and len(b) != R:
            raise InputError(f"{name}: {len(b)} tensors for {R} ranks (one per rank, or None)")
    e_local = l1[0].shape[0]
    if len(topk_idx) != R:
        raise InputError(f"topk_idx: {len(topk_idx)} tensors for {R} ranks (one per rank)")
    for s in range(R):
        check_topk_idx(topk_idx[s], e_local * R, f"topk_idx[{s}]")
    # send[s][q]: rows (token, slot) of rank s routed to rank q, in (token, slot) order.
    recv_rows = [[None] * R for _ in range(R)]
    sends = []
    for s in range(R):
        idx = topk_idx[s].long()
        owner = idx // e_local
        per_dest = []
        for q in range(R):
            t, k = torch.nonzero(owner == q, as_tuple=True)
            per_dest.append((t, k))
            recv_rows[q][s] = (xs[s][t].to(dtype), idx[t, k] % e_local)
        sends.append(per_dest)
    outs = [[None] * R for _ in range(R)]
    for q in range(R):
        rows = torch.cat([recv_rows[q][s][0] for s in range(R)])
        experts = torch.cat([recv_rows[q][s][1] for s in range(R)])
        out = _expert_outputs(rows, experts, l1[q].to(dtype), l2[q].to(dtype), _cast(_rank(b1, q), dtype),
                              _cast(_rank(b2, q), dtype), activation)
        sizes = [recv_rows[q][s][0].shape[0] for s in range(R)]
        for s, chunk in enumerate(torch.split(out, sizes)):
            outs[s][q] = chunk
    ys = []
    for s in range(R):
        T, K = topk_idx[s].shape
        comb = torch.zeros(T, K, xs[s].shape[1], dtype=dtype, device=xs[s].device)
        for q in range(R):
            t, k = sends[s][q]
            comb[t, k] = outs[s][q]
        ys.append((comb * topk_w[s].to(dtype)[:, :, None]).sum(1))
    return ys


def reference_moe_dist(x, topk_idx, topk_w, l1, l2, group=None, dtype=torch.float32, b1=None, b2=None,
                       activation=SILU):
    """This rank's `y [T, H]` over a process group (gloo or NCCL) with explicit all-to-alls; `b1`, `b2`
    (optional) this rank's expert biases, `activation` as `expert_mlp`."""
    activation = check_activation(activation)

    R = dist.get_world_size(group)
    e_local = l1.shape[0]
    check_topk_idx(topk_idx, e_local * R)
    idx = topk_idx.long()
    owner = (idx // e_local).reshape(-1)
    order = torch.argsort(owner, stable=True)
    t_of = order // idx.shape[1]
    send_rows = x[t_of].to(dtype)
    send_exp = (idx.reshape(-1)[order] % e_local).to(torch.int64)
    send_counts = torch.bincount(owner, minlength=R)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    recv_rows = send_rows.new_empty(sum(rc), x.shape[1])
    dist.all_to_all_single(recv_rows, send_rows.contiguous(), rc, sc, group=group)
    recv_exp = send_exp.new_empty(sum(rc))
    dist.all_to_all_single(recv_exp, send_exp, rc, sc, group=group)
    out = _expert_outputs(recv_rows, recv_exp, l1.to(dtype), l2.to(dtype), _cast(b1, dtype), _cast(b2, dtype),
                          activation)
    back = out.new_empty(send_rows.shape)
    dist.all_to_all_single(back, out.contiguous(), sc, rc, group=group)
    comb = torch.empty(idx.numel(), x.shape[1], dtype=dtype, device=x.device)
    comb[order] = back
    comb = comb.view(idx.shape[0], idx.shape[1], -1)
    return (comb * topk_w.to(dtype)[:, :, None]).sum(1)


def loopback_inputs(x, topk_idx, topk_w, l1, l2, num_ranks: int):
    """The virtual-rank inputs that a one-GPU loopback run of rank 0 stands for.

    Peer r holds the same tokens as rank 0 with expert ids rotated by `r * E/R` and the same local
    weights as rank 0, so every row rank 0 would receive from a peer is one that rank 0 can
    synthesise from its own tokens, and every row a peer would send back equals one rank 0 computes.
    Returns `(xs, idx, ws, l1s, l2s)` lists for `reference_moe_virtual`; `y` of rank 0 is the target.
    """
    num_ranks = check_int(num_ranks, "num_ranks", 1, MAX_RANKS, "ranks the loopback run stands for")
    check_instance(l1, "l1", torch.Tensor, "a tensor [experts per rank, 2I, H]")
    if l1.dim() != 3:
        raise InputError(f"l1: expected a 3-d tensor [experts per rank, 2I, H], got shape {tuple(l1.shape)}")
    e_local = l1.shape[0]
    num_experts = e_local * num_ranks
    check_topk_idx(topk_idx, num_experts)
    idx = [(topk_idx.long() + r * e_local) % num_experts for r in range(num_ranks)]
    return [x] * num_ranks, idx, [topk_w] * num_ranks, [l1] * num_ranks, [l2] * num_ranks
