"""Why is an FP8 tile barely faster than a BF16 one? Persistent GEMM tiles in isolation, variant by variant.

In the fused MoE kernel an FP8 Linear-1 tile of H1152-I4608-E8-K2 (1024 rows per expert, compute-bound)
takes 16.3 us against 16.2 us in BF16, and a Linear-2 tile 26.1 us against 29.3 us
(`benchmarks/results/h200-moe-fp8/tiles/`): 38% of the FP8 tensor-core peak per K block, where BF16
runs at 69%. Each 128-wide K block's FP8 product must be scaled before it is added, so Triton waits for
each `tl.dot` at once (the product is no MMA accumulator) and the promotion, the operand barrier and
the next loads do not overlap the tensor cores. Loading the scales a block ahead changed nothing
(a547919). This times the tile functions alone on that shape's tiles, one persistent CTA per SM, 8 warps
unless named:
- Linear-2: `single` one scale block per loop step (the library before the pair loop), `lib` the
  library's `_linear2_fp8_acc` (two blocks per step; `lib:s2` one stage fewer, `lib:w16` 16 warps),
  `k3` three blocks per step, `acc` an FP8 accumulator chain without per-block scales (wrong numbers:
  the bound of this loop structure), `bf16` the BF16 kernel's accumulator chain (BK 64); `tma` its
  operands through TMA descriptors, one block per step, `tma:ws` the same K loop warp-specialized
  (Triton's `warp_specialize`: a producer partition issues the loads), `tma:acc` / `tma:ws:acc` both
  unscaled (bounds); `gluon` the scaled tile in Gluon (`fp8_gluon_tile.py`: a TMA producer warp, two
  4-warp consumers of 64 rows each that promote out of phase, 4 stages; `gluon:s3`, `gluon:s6` 3 or 6);
  `single:64x2`, `lib:64x2`, `tma:64x2` those loops on 64-row tiles, one warpgroup per CTA, two CTAs per SM;
- Linear-1: `lib` the library's `_linear1_fp8` (SwiGLU, 1x128 requantization), `k2` its loop with two
  K blocks (four dots) per step and 2 stages, `noepi` the K loop alone (stores g + u), `recip` its
  epilogue dividing through one reciprocal per row, `bf16` the library's BF16 `_linear1`.
The first round (c928eb1, 1024 rows per expert) measured, against one block per step: 16 warps 0.90x,
two blocks per step 1.33x, 256-row tiles (16 warps) 0.54x, the unscaled chain 1.90x; on Linear-1 the
epilogue 7% of the tile and 16 warps or the reciprocal within noise.
Rows: variant, median/p10/p90 us of a launch over all tiles (`xstage.results.time_device`; the two
committed rounds timed each call with its own events), us per tile per SM, TFLOP/s, and the largest
difference from the first variant of the same kind (0 where the variant computes the same numbers).

    PYTHONPATH=src python3 benchmarks/experiments/fp8_tile_variants.py --out DIR
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from xstage.env import environment
from xstage.moe.kernels import _linear1  # internal: the fused kernel's BF16 Linear-1 tile, timed alone
from xstage.moe.kernels_fp8 import FP8_MAX, _linear1_fp8, _linear2_fp8_acc  # internal: its FP8 tiles, timed alone
from xstage.results import time_device
from xstage.results.io import write_csv_atomic

FP8 = torch.float8_e4m3fn
H, I, E = 1152, 4608, 8  # H1152-I4608-E8-K2; 4096 rows per expert: 16384 tokens at EP=1


@triton.jit
def _tile_rows(t, n_blocks, RPE: tl.constexpr, BM: tl.constexpr):
    """Persistent tile `t` over `n_blocks` column blocks: (row block, column block, expert, its rows)."""
    mb = t // n_blocks
    return mb, t % n_blocks, mb * BM // RPE, (mb * BM + tl.arange(0, BM)).to(tl.int64)


@triton.jit
def _l2_lib(p_act, p_as, p_w2, p_w2s, p_out, H, I, n_m, RPE: tl.constexpr, BM: tl.constexpr, BN2: tl.constexpr,
            BK: tl.constexpr, PAIR_STAGES: tl.constexpr):
    n2 = H // BN2
    for t in range(tl.program_id(0), n_m * n2, tl.num_programs(0)):
        mb = t // n2
        nb = t % n2
        acc = _linear2_fp8_acc(mb * BM // RPE, mb * BM, BM, nb, p_act, p_act, p_as, p_w2, p_w2, p_w2s, H, I, BM, BN2,
                               BK, False, PAIR_STAGES)
        o_m = (mb * BM + tl.arange(0, BM)).to(tl.int64)
        tl.store(p_out + o_m[:, None] * H + nb * BN2 + tl.arange(0, BN2)[None, :], acc.to(tl.bfloat16))


@triton.jit
def _l2_variant(p_act, p_as, p_w2, p_w2s, p_out, H, I, n_m, RPE: tl.constexpr, BM: tl.constexpr,
                BN2: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    # MODE 0: one 128-wide scale block per loop step (the library before a2c); 1: two per step; 4: three
    # per step; 2: FP8 accumulator chain, no scales (a bound); 3: BF16 operands, accumulator chain (BK 64).
    n2 = H // BN2
    for t in range(tl.program_id(0), n_m * n2, tl.num_programs(0)):
        mb, nb, e, o_m = _tile_rows(t, n2, RPE, BM)
        o_n = nb * BN2 + tl.arange(0, BN2)
        o_k = tl.arange(0, BK)
        nkb = I // BK
        p_a = p_act + o_m[:, None] * I + o_k[None, :]
        p_b = p_w2 + e.to(tl.int64) * H * I + o_n.to(tl.int64)[None, :] * I + o_k[:, None]
        p_a_s = p_as + o_m * nkb
        p_bs = p_w2s + (e.to(tl.int64) * (H // 128) + (nb * BN2) // 128) * nkb
        acc = tl.zeros([BM, BN2], dtype=tl.float32)
        if MODE == 0:
            for kb in range(0, nkb):
                acc += tl.dot(tl.load(p_a), tl.load(p_b), out_dtype=tl.float32) * (
                    tl.load(p_a_s + kb)[:, None] * tl.load(p_bs + kb))
                p_a += BK
                p_b += BK
        elif MODE == 1 or MODE == 4:
            STEP: tl.constexpr = 2 if MODE == 1 else 3
            for kb in range(0, nkb, STEP):  # nkb is a multiple of STEP on this shape
                for j in tl.static_range(STEP):
                    s_j = tl.load(p_a_s + kb + j)[:, None] * tl.load(p_bs + kb + j)
                    acc += tl.dot(tl.load(p_a + j * BK), tl.load(p_b + j * BK), out_dtype=tl.float32) * s_j
                p_a += STEP * BK
                p_b += STEP * BK
        else:
            for _kb in range(0, nkb):
                acc = tl.dot(tl.load(p_a), tl.load(p_b), acc, out_dtype=tl.float32)
                p_a += BK
                p_b += BK
        tl.store(p_out + o_m[:, None] * H + o_n[None, :], acc.to(tl.bfloat16))


@triton.jit
def _l2_desc(d_act, p_as, d_w2, p_w2s, p_out, H, I, n_m, RPE: tl.constexpr, BM: tl.constexpr, BN2: tl.constexpr,
             BK: tl.constexpr, WS: tl.constexpr, SCALED: tl.constexpr):
    # Operands through TMA descriptors, one scale block per step; WS: the K loop warp-specialized
    # (`tl.range(..., warp_specialize=True)`: loads in a producer partition, the MMAs and the
    # promotion in the consumer); SCALED 0: the unscaled accumulator chain (a bound, wrong numbers).
    n2 = H // BN2
    nkb = I // BK
    for t in range(tl.program_id(0), n_m * n2, tl.num_programs(0)):
        mb, nb, e, o_m = _tile_rows(t, n2, RPE, BM)
        o_n = nb * BN2 + tl.arange(0, BN2)
        p_a_s = p_as + o_m * nkb
        p_bs = p_w2s + (e.to(tl.int64) * (H // 128) + (nb * BN2) // 128) * nkb
        acc = tl.zeros([BM, BN2], dtype=tl.float32)
        for kb in tl.range(0, nkb, warp_specialize=WS):
            b_a = d_act.load([mb * BM, kb * BK])
            b_b = d_w2.load([e * H + nb * BN2, kb * BK]).T
            if SCALED:
                acc += tl.dot(b_a, b_b, out_dtype=tl.float32) * (tl.load(p_a_s + kb)[:, None] * tl.load(p_bs + kb))
            else:
                acc = tl.dot(b_a, b_b, acc, out_dtype=tl.float32)
        tl.store(p_out + o_m[:, None] * H + o_n[None, :], acc.to(tl.bfloat16))


@triton.jit
def _l1_lib(p_recv, p_rs, p_w1, p_w1s, p_act, p_as, p_ready, H, I, n_m, RPE: tl.constexpr, BM: tl.constexpr,
            BN1: tl.constexpr, BK: tl.constexpr, FP8_TILE: tl.constexpr):
    n1 = I // BN1
    for t in range(tl.program_id(0), n_m * n1, tl.num_programs(0)):
        mb = t // n1
        if FP8_TILE:
            _linear1_fp8(t, mb * BM // RPE, mb * BM, BM, t % n1, p_recv, p_recv, p_rs, p_w1, p_w1, p_w1s, p_act, p_as,
                         p_ready, H, I, BM, BN1, BK, False, True, False)
        else:  # the interleaved layout, no biases, SwiGLU (p_w1 stands in for the unread bias pointer)
            _linear1(t, mb * BM // RPE, mb * BM, BM, t % n1, p_recv, p_recv, p_w1, p_w1, p_act, p_ready, H, I, p_w1,
                     0.0, 0.0, BM, BN1, BK, False, True, False, False, 0)


@triton.jit
def _l1_variant(p_recv, p_rs, p_w1, p_w1s, p_act, p_as, H, I, n_m, RPE: tl.constexpr, BM: tl.constexpr,
                BN1: tl.constexpr, BK: tl.constexpr, EPI: tl.constexpr):
    # The library's K loop; EPI 1: quantize through one reciprocal per row; 2: no epilogue (stores g + u);
    # 3: the library's epilogue, two K blocks per loop step (four dots; nkb odd: the last one alone).
    n1 = I // BN1
    for t in range(tl.program_id(0), n_m * n1, tl.num_programs(0)):
        mb, nb, e, o_row = _tile_rows(t, n1, RPE, BM)
        o_n = tl.arange(0, BN1)
        o_k = tl.arange(0, BK)
        nkb = H // BK
        b_g = tl.zeros([BM, BN1], dtype=tl.float32)
        b_u = tl.zeros([BM, BN1], dtype=tl.float32)
        p_a = p_recv + o_row[:, None] * H + o_k[None, :]
        p_a_s = p_rs + o_row * nkb
        p_g = p_w1 + e.to(tl.int64) * 2 * I * H + (nb * 2 * BN1 + o_n).to(tl.int64)[None, :] * H + o_k[:, None]
        p_u = p_g + BN1 * H
        p_gs = p_w1s + (e.to(tl.int64) * (2 * I // 128) + 2 * nb) * nkb
        p_us = p_gs + nkb
        STEP: tl.constexpr = 2 if EPI == 3 else 1
        for kb in range(0, nkb - STEP + 1, STEP):
            for j in tl.static_range(STEP):
                b_s = tl.load(p_a_s + kb + j)[:, None]
                b_a = tl.load(p_a + j * BK)
                b_g += tl.dot(b_a, tl.load(p_g + j * BK), out_dtype=tl.float32) * (b_s * tl.load(p_gs + kb + j))
                b_u += tl.dot(b_a, tl.load(p_u + j * BK), out_dtype=tl.float32) * (b_s * tl.load(p_us + kb + j))
            p_a += STEP * BK
            p_g += STEP * BK
            p_u += STEP * BK
        if STEP == 2 and nkb % 2 == 1:
            b_s = tl.load(p_a_s + nkb - 1)[:, None]
            b_a = tl.load(p_a)
            b_g += tl.dot(b_a, tl.load(p_g), out_dtype=tl.float32) * (b_s * tl.load(p_gs + nkb - 1))
            b_u += tl.dot(b_a, tl.load(p_u), out_dtype=tl.float32) * (b_s * tl.load(p_us + nkb - 1))
        p_o = p_act + o_row[:, None] * I + (nb * BN1 + o_n)[None, :]
        if EPI == 2:
            tl.store(p_o, (b_g + b_u).to(p_act.dtype.element_ty))
        else:
            b_h = b_g * tl.sigmoid(b_g) * b_u
            amax = tl.max(tl.abs(b_h), axis=1)
            b_sc = tl.where(amax == 0, 1.0, tl.div_rn(amax, FP8_MAX))
            if EPI == 1:
                b_v = b_h * tl.div_rn(1.0, b_sc)[:, None]
            else:
                b_v = tl.div_rn(b_h, b_sc[:, None])
            b_v = tl.minimum(tl.maximum(b_v, -FP8_MAX), FP8_MAX)
            tl.store(p_o, b_v.to(p_act.dtype.element_ty))
            tl.store(p_as + o_row * (I // 128) + nb, b_sc)


def _gluon_tile():
    """`fp8_gluon_tile.py` beside this file, loaded by path (it is no package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fp8_gluon_tile", Path(__file__).with_name("fp8_gluon_tile.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fp8_data(shape, g, dev):
    return (torch.randn(shape, generator=g, device=dev) * 2).clamp(-8, 8).to(FP8)


def _scales(shape, g, dev, base):
    return (torch.rand(shape, generator=g, device=dev) + 0.5) * base


def run(out_dir: Path, warmup: int, rep: int, rows_per_expert: int, only=()) -> list[dict]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    P = E * rows_per_expert
    n_m = P // 128
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    recv, recv_s = _fp8_data((P, H), g, dev), _scales((P, H // 128), g, dev, 0.1)
    w1, w1_s = _fp8_data((E * 2 * I, H), g, dev), _scales((E, 2 * I // 128, H // 128), g, dev, 0.01)
    act, act_s = _fp8_data((P, I), g, dev), _scales((P, I // 128), g, dev, 0.1)
    w2, w2_s = _fp8_data((E * H, I), g, dev), _scales((E, H // 128, I // 128), g, dev, 0.01)
    recv16, w1_16 = recv.to(torch.bfloat16), w1.to(torch.bfloat16)
    act16, w2_16 = act.to(torch.bfloat16), w2.to(torch.bfloat16)
    ready = torch.zeros(n_m * (I // 128), dtype=torch.int32, device=dev)
    # variant: (BM, warps, stages) of its launch
    l2_variants = {"single": (0, 128, 8, 4), "lib": (None, 128, 8, 4), "lib:s2": (None, 128, 8, 3),
                   "lib:w16": (None, 128, 16, 4), "k3": (4, 128, 8, 2), "acc": (2, 128, 8, 4), "bf16": (3, 128, 8, 4),
                   # TMA operands, one block per step: plain, warp-specialized, and both unscaled
                   "tma": ("desc", 128, 8, 4), "tma:ws": ("desc:ws", 128, 8, 4), "tma:acc": ("desc:acc", 128, 8, 4),
                   "tma:ws:acc": ("desc:ws:acc", 128, 8, 4),
                   # Gluon: the default partition's 4 warps (one consumer), a 4-warp consumer, a producer warp
                   "gluon": ("gluon", 128, 4, 4), "gluon:s3": ("gluon", 128, 4, 3), "gluon:s6": ("gluon", 128, 4, 6),
                   # one warpgroup per CTA (64-row tiles, 4 warps), two CTAs per SM: the two promote
                   # independently, as Gluon's two consumers do, at twice the weight loads
                   "single:64x2": (0, 64, 4, 4, 2), "lib:64x2": (None, 64, 4, 4, 2), "tma:64x2": ("desc", 64, 4, 4, 2)}
    l1_variants = {"lib": None, "k2": 3, "noepi": 2, "recip": 1, "bf16": None}

    def l2(variant):
        out = torch.empty(P, H, dtype=torch.bfloat16, device=dev)
        mode, bm, warps, stages, per_sm = (*l2_variants[variant], 1)[:5]
        n = P // bm
        grid = (sms * per_sm,)
        if mode == "gluon":  # imported here: a Triton without Gluon's Hopper API still runs the rest
            launch = _gluon_tile().launch_l2_gluon(act, act_s, w2, w2_s, out, H, I, rows_per_expert, sms,
                                                   num_stages=stages)
        elif isinstance(mode, str):
            from triton.tools.tensor_descriptor import TensorDescriptor

            d_a = TensorDescriptor(act, shape=[P, I], strides=[I, 1], block_shape=[bm, 128])
            d_b = TensorDescriptor(w2, shape=[E * H, I], strides=[I, 1], block_shape=[128, 128])
            launch = lambda: _l2_desc[grid](d_a, act_s, d_b, w2_s, out, H, I, n, RPE=rows_per_expert, BM=bm,  # noqa: E731
                                              BN2=128, BK=128, WS=":ws" in mode, SCALED=":acc" not in mode,
                                              num_warps=warps, num_stages=stages)
        elif mode is None:  # the library's pair loop: PAIR_STAGES = stages - 1, as the fused kernel passes it
            launch = lambda: _l2_lib[grid](act, act_s, w2, w2_s, out, H, I, n, RPE=rows_per_expert, BM=bm,  # noqa: E731
                                             BN2=128, BK=128, PAIR_STAGES=stages - 1, num_warps=warps,
                                             num_stages=stages)
        else:
            a, w = (act16, w2_16) if variant == "bf16" else (act, w2)
            launch = lambda: _l2_variant[grid](a, act_s, w, w2_s, out, H, I, n, RPE=rows_per_expert, BM=bm,  # noqa: E731
                                                 BN2=128, BK=64 if variant == "bf16" else 128, MODE=mode,
                                                 num_warps=warps, num_stages=stages)
        return launch, (out,), 2.0 * P * H * I

    def l1(variant):
        a_out = torch.zeros(P, I, dtype=torch.bfloat16 if variant == "bf16" else FP8, device=dev)
        s_out = torch.zeros(P, I // 128, device=dev)
        epi = l1_variants[variant]
        if epi is None:
            fp8 = variant != "bf16"
            args = (recv, recv_s, w1, w1_s) if fp8 else (recv16, recv_s, w1_16, w1_s)
            launch = lambda: _l1_lib[(sms,)](*args, a_out, s_out, ready, H, I, n_m, RPE=rows_per_expert, BM=128,  # noqa: E731
                                             BN1=128, BK=128 if fp8 else 64, FP8_TILE=fp8, num_warps=8, num_stages=4)
        else:
            launch = lambda: _l1_variant[(sms,)](recv, recv_s, w1, w1_s, a_out, s_out, H, I, n_m,  # noqa: E731
                                                 RPE=rows_per_expert, BM=128, BN1=128, BK=128, EPI=epi, num_warps=8,
                                                 num_stages=2 if epi == 3 else 4)
        return launch, (a_out, s_out), 2.0 * P * H * 2 * I

    cases = [("l2", v, l2) for v in l2_variants] + [("l1", v, l1) for v in l1_variants]
    if only:
        unknown = sorted(set(only) - {f"{k}:{v}" for k, v, _ in cases})
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; known: {[f'{k}:{v}' for k, v, _ in cases]}")
        cases = [c for c in cases if f"{c[0]}:{c[1]}" in only]
    rows, ref = [], {}
    labels = {k: v for k, v in environment().items() if k in ("gpu", "driver", "torch", "triton", "git_commit", "date")}
    for kind, variant, make in cases:
        row = dict(kind=kind, variant=variant)
        try:
            launch, outs, flops = make(variant)
            compiled = launch()
            torch.cuda.synchronize()
            ttgir = getattr(compiled, "asm", {}).get("ttgir", "")
            # whether the compiler split the loop into partitions, and the kernel's registers
            row.update(warp_specialized=int("warp_specialize" in ttgir), n_regs=getattr(compiled, "n_regs", ""))
            if kind not in ref:  # the first variant of each kind is the reference of the rest
                ref[kind] = [o.float().clone() for o in outs]
            diff = max(float((o.float() - r).abs().max()) for o, r in zip(outs, ref[kind]))
            timing = time_device(launch, warmup=warmup, rep=rep)
            med = timing.median_ns / 1e3
            tiles = n_m * (H // 128 if kind == "l2" else I // 128)
            row.update(median_us=med, p10_us=timing.p10_ns / 1e3, p90_us=timing.p90_ns / 1e3, tiles=tiles,
                       us_per_tile_sm=med * sms / tiles, tflops=flops / med / 1e6, max_diff_vs_first=diff)
        except Exception as ex:  # a variant that fails to compile or run is reported, the rest go on
            row.update(error=f"{type(ex).__name__}: {str(ex).splitlines()[0][:160] if str(ex) else ''}")
        row.update(labels)
        rows.append(row)
        print(row, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(out_dir / "fp8_tile_variants.csv", rows, list(dict.fromkeys(k for r in rows for k in r)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--rows-per-expert", type=int, default=4096)
    ap.add_argument("--variants", default="", help="KIND:VARIANT,... to run (default: all), e.g. l2:lib,l2:tma:ws")
    args = ap.parse_args(argv)
    rows = run(Path(args.out), args.warmup, args.rep, args.rows_per_expert,
               [v for v in args.variants.split(",") if v])
    print("| kind | variant | median us | p10 | p90 | us/tile/SM | TFLOP/s | max diff vs first |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kind']} | {r['variant']} | {r['error']} |")
        else:
            print(f"| {r['kind']} | {r['variant']} | {r['median_us']:.1f} | {r['p10_us']:.1f} | {r['p90_us']:.1f} | "
                  f"{r['us_per_tile_sm']:.2f} | {r['tflops']:.0f} | {r['max_diff_vs_first']:.3g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
