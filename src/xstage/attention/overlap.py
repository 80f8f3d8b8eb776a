"""The `overlap` and `serial` exchanges: attention by any core, the rows moved by the copy engine.

`overlap` cuts the gathered sequence into blocks of query rows and runs attention block by block.
When a block is done its completion flag is raised (a CUDA event on the stream that computed it)
and a copy stream waits for that flag and has the copy engine send the block's rows to the ranks
that own them, while the SMs compute the next block: no SM spends a cycle on stores, and the
attention core can be the Triton kernel or cuDNN. The blocks run in a rotated order, the rows of
the ranks after this one first and this rank's own rows last, so that the last remote copy hides
behind the own rows' compute (which needs no copy).

The blocks' launches alternate between two compute streams: block i + 2 queues behind block i, and
two blocks at a time share the SMs, so the next block's tiles take the SMs that the previous block's
last, partial wave leaves idle. Measured on one H200 (`benchmarks/results/h200-ulysses-overlap/`):
- one stream, one launch after another, leaves those SMs idle at every block's end (at 32760 tokens,
  three heads, four blocks: seven waves of work where one launch needs six);
- every block on its own stream at once, earlier blocks at higher priority, was slower than two
  streams with three or four cuDNN blocks in 17 and 15 of the 18 configurations of that check (up
  to 1.40x at 4608 tokens; each time relative to attention alone of its own run);
- two blocks on two streams run side by side, so the remote block ends late and its copy shows:
  the planner models the two lanes' sharing (`xstage.sched.exchange`) and picks three or four
  blocks where that matters.

Where rows go: rank p keeps, for every source s, a contiguous region `[S_p, B, h_s, D]` of its
staging buffer at element offset `B * S_p * head0[s] * D` (the layout an all-to-all delivers), so
that any run of a block's rows for p is one contiguous copy. After the last copy, a group's ranks
pass a device barrier (bounded by the context's watchdog) and each moves its regions into its
output; a loopback group does that for its stand-in ranks when asked (`unpack`).

On a machine without a GPU the blocks run one after another and the host issues each block's
copies right after its flag; `on_send(block, dest, row_start, row_end)` sees every copy in issue
order (the tests check that each remote row is sent once, in flag order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xstage.attention.flash import FlashConfig, flash_attention
from xstage.comm.stamps import stamp
from xstage.errors import InputError
from xstage.spec.exchange import Exchange
from xstage.spec.ulysses import UlyssesPlan, default_blocks, overlap_blocks  # noqa: F401  (re-exported: this module's names before xstage.spec)

_STREAMS: dict = {}


def concurrent_tiles(core: str, device: torch.device, config: FlashConfig | None) -> int:
    """Attention tiles that `core` runs at once on `device`: the Triton kernel's persistent grid, or
    one per SM for cuDNN (its fused attention kernel on Hopper holds one CTA per SM)."""
    # without a GPU (the interpreter runs the logic only) the H200's SM count stands in
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    if core == "triton" and config is not None and config.ctas_per_sm > 0:
        return sms * config.ctas_per_sm
    return sms


def attend(core: str, q, k, v, out, *, softmax_scale=None, config: FlashConfig | None = None) -> None:
    """Attention of `q` against `k`, `v` (`[B, S, h, D]` views) written into `out` (same shape as q)."""
    if out.numel() == 0:
        return  # a rank without heads, or a block without rows: cuDNN may refuse an empty launch
    if core == "triton":
        flash_attention(q, k, v, softmax_scale=softmax_scale, out=out, config=config)
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if q.is_cuda:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            res = sdpa(*args, scale=softmax_scale)
    else:
        # no cuDNN without a GPU: torch's own SDPA stands in so that the logic runs on CPU
        res = sdpa(*(t.float() for t in args), scale=softmax_scale).to(q.dtype)
    out.copy_(res.transpose(1, 2))


def stage_offset(plan: UlyssesPlan, dest: int, source: int) -> int:
    """Element offset of source `source`'s region in rank `dest`'s staging buffer."""
    return plan.batch * plan.seq_lens[dest] * plan.head0[source] * plan.head_dim


def _row_elems(plan: UlyssesPlan) -> int:
    return plan.batch * plan.heads_of(plan.rank) * plan.head_dim


def send_rows(plan: UlyssesPlan, og_seq: torch.Tensor, stage_peers, row_lo: int, row_hi: int,
              on_send=None, block: int = -1) -> None:
    """Copy gathered rows `[row_lo, row_hi)` of `og_seq` (`[S, B, h_r, D]`, contiguous) into the
    staging regions of the remote ranks that own them (one contiguous copy per owner)."""
    r, tok0, n = plan.rank, plan.tok0, _row_elems(plan)
    for p in range(plan.world):
        lo, hi = max(row_lo, tok0[p]), min(row_hi, tok0[p + 1])
        if p == r or hi <= lo:
            continue
        off = stage_offset(plan, p, r) + (lo - tok0[p]) * n
        dst = stage_peers[p].view(-1)[off:off + (hi - lo) * n]
        dst.copy_(og_seq[lo:hi].reshape(-1), non_blocking=True)
        if on_send is not None:
            on_send(block, p, lo, hi)


def unpack_stage(plan: UlyssesPlan, stage_local: torch.Tensor, out: torch.Tensor, sources) -> None:
    """Move the regions of `sources` from this rank's staging buffer into `out` `[B, S_r, H, D]`."""
    r, B, D = plan.rank, plan.batch, plan.head_dim
    S_r = plan.seq_lens[r]
    flat = stage_local.view(-1)
    for s in sources:
        h = plan.heads_of(s)
        if h == 0 or S_r == 0:
            continue
        off = stage_offset(plan, r, s)
        region = flat[off:off + S_r * B * h * D].view(S_r, B, h, D)
        out[:, :, plan.head0[s]:plan.head0[s + 1]].copy_(region.transpose(0, 1))


@triton.jit
def _copy_rows_kernel(p_src, p_dst, n_rows, row_elems, src_row_stride, dst_row_stride, dst_batch_stride, rows_per_batch,
                      BLOCK: tl.constexpr):
    """Row i of `p_src` (rows of `src_row_stride`, batch-minor: i = s * batches + b) into row s of batch
    b of `p_dst`; each row is `row_elems` contiguous elements."""
    i_row = tl.program_id(0)
    i_s = (i_row // rows_per_batch).to(tl.int64)
    i_b = (i_row % rows_per_batch).to(tl.int64)
    p_row_src = p_src + i_row.to(tl.int64) * src_row_stride
    p_row_dst = p_dst + i_b * dst_batch_stride + i_s * dst_row_stride
    for o_start in range(0, row_elems, BLOCK):
        o_elem = o_start + tl.arange(0, BLOCK)  # [BLOCK]
        m_elem = o_elem < row_elems
        tl.store(p_row_dst + o_elem, tl.load(p_row_src + o_elem, mask=m_elem), mask=m_elem)


def copy_region(region: torch.Tensor, dest: torch.Tensor) -> None:
    """`dest` (`[B, S, h, D]`, a view whose rows of `h * D` elements are contiguous) := `region`
    (`[S, B, h, D]`, contiguous), by one kernel on the current stream.

    Why a kernel rather than `dest.copy_(region.transpose(0, 1))`: on the `host` path both tensors
    live in pinned host memory, where torch copies on the CPU at once, before the stream's copies
    into `region` have landed, and outside any CUDA graph. The kernel reads and writes them through
    their device-visible addresses (zero-copy), in stream order."""
    S, B, h, D = region.shape
    if S == 0 or B == 0 or h * D == 0:
        return
    if not region.is_contiguous() or dest.stride(3) != 1 or dest.stride(2) != D:
        raise InputError("copy_region: expected a contiguous [S, B, h, D] region and rows of h * D contiguous "
                         "elements in dest")
    row = h * D
    _copy_rows_kernel[(S * B,)](region, dest, S * B, row, row, dest.stride(1), dest.stride(0), B,
                                BLOCK=min(1024, triton.next_power_of_2(row)), num_warps=4)


def _side_streams(device: torch.device):
    """(copy stream, second compute stream) of `device`, made once and kept."""
    if device not in _STREAMS:
        _STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _STREAMS[device]


def run_overlap(plan: UlyssesPlan, ex: Exchange, qg, kg, vg, og: torch.Tensor, own_out: torch.Tensor,
                stage_peers, *, softmax_scale=None, config: FlashConfig | None = None, on_send=None,
                stamps: torch.Tensor | None = None) -> None:
    """Attention of this rank's heads block by block into `og` (`[B, S, h_r, D]`, a view of a
    sequence-major buffer), each finished block's remote rows copied by the copy engine into
    `stage_peers` while the next block computes, and the own rows into `own_out` (`[B, S_r, h_r, D]`).
    Returns when every copy is ordered before the caller's next work on the current stream.

    `stamps` (optional, int64 `[blocks, 4]` on `og`'s device, for traces): per block the times
    (`xstage.comm.stamps`, ns) at which its stream starts and ends its attention and at which the copy
    stream starts and ends its copies; they work inside CUDA graphs. Read them after a synchronize."""
    og_seq = og.transpose(0, 1)
    if not og_seq.is_contiguous():
        raise InputError("og: expected a view of a sequence-major [S, B, h, D] buffer")
    cfg = config
    blocks = overlap_blocks(plan, ex.blocks or default_blocks(plan), cfg.block_m if cfg else 128, cut=ex.cut,
                            slots=concurrent_tiles(ex.core, og.device, cfg))
    a, b = plan.tok0[plan.rank], plan.tok0[plan.rank + 1]
    if stamps is not None and (stamps.dtype != torch.int64 or tuple(stamps.shape) != (len(blocks), 4)
                               or stamps.device != og.device):
        raise InputError(f"stamps: expected int64 [{len(blocks)}, 4] on {og.device} (one row per block), got "
                         f"{stamps.dtype} {tuple(stamps.shape)} on {stamps.device}")

    def mark(i: int, what: int) -> None:
        if stamps is not None:
            stamp(stamps, 4 * i + what)

    if not og.is_cuda:
        for i, ranges in enumerate(blocks):
            mark(i, 0)
            for lo, hi in ranges:
                attend(ex.core, qg[:, lo:hi], kg, vg, og[:, lo:hi], softmax_scale=softmax_scale, config=cfg)
            mark(i, 1)
            mark(i, 2)
            for lo, hi in ranges:
                send_rows(plan, og_seq, stage_peers, lo, hi, on_send, i)
            mark(i, 3)
        if b > a:
            own_out.copy_(og[:, a:b])
        return
    main = torch.cuda.current_stream(og.device)
    copier, second = _side_streams(og.device)
    for s in (copier, second):
        s.wait_stream(main)  # nothing may start before the inputs of this call exist
    lanes = (main, second)
    for i, ranges in enumerate(blocks):
        lane = lanes[i % 2]
        with torch.cuda.stream(lane):
            mark(i, 0)
            for lo, hi in ranges:
                attend(ex.core, qg[:, lo:hi], kg, vg, og[:, lo:hi], softmax_scale=softmax_scale, config=cfg)
            mark(i, 1)
        flag = torch.cuda.Event()
        flag.record(lane)
        copier.wait_event(flag)
        with torch.cuda.stream(copier):
            mark(i, 2)
            for lo, hi in ranges:
                send_rows(plan, og_seq, stage_peers, lo, hi, on_send, i)
            mark(i, 3)
    main.wait_stream(second)
    if b > a:
        own_out.copy_(og[:, a:b])
    main.wait_stream(copier)


def run_serial_copies(plan: UlyssesPlan, og: torch.Tensor, own_out: torch.Tensor, stage_peers) -> None:
    """The serial exchange by the copy engine (a loopback group): every remote rank's rows in one copy."""
    og_seq = og.transpose(0, 1)
    send_rows(plan, og_seq, stage_peers, 0, plan.seq_total)
    a, b = plan.tok0[plan.rank], plan.tok0[plan.rank + 1]
    if b > a:
        own_out.copy_(og[:, a:b])


__all__ = ["attend", "concurrent_tiles", "copy_region", "default_blocks", "overlap_blocks", "run_overlap",
           "run_serial_copies", "send_rows", "stage_offset", "unpack_stage"]
