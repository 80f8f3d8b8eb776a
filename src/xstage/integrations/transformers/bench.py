"""`xstage bench experts`: a transformers experts module on `experts_implementation="xstage"` against the
same module on `"grouped_mm"`, call against call (what a model's MoE block waits for at EP = 1).

Per architecture (`ARCHS`: real widths of Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B, OLMoE-1B-7B and
GPT-OSS-20B), token count (`TOKENS`, decode to prefill) and routing (`uniform`: every token's top-k
drawn at random; `skewed`: nine tokens in ten route only to the first E/8 experts), one experts module of
the model's own class is built from its config at that width with random weights (BF16, unit-scale
rows). Both sides are that module: its forward is transformers' own, which dispatches on
`config._experts_implementation`, so the sides differ only in the backend (two configs over the same
parameters). xstage's side is the integration as a user runs it (`register()`, the module's
defaults: zero-padding, `max_tokens` chunks, the planner's decisions); transformers' side is its
`grouped_mm` experts forward, the backend a transformers 5 model picks when none is asked for.

`dtype="fp8"` rows: xstage's side is the module converted by transformers' own
`replace_with_fp8_linear` (a fine-grained FP8 checkpoint's `FP8Experts`, 128x128 block-scaled e4m3,
weights and scales read in place by the FP8 fused layer), against BF16 `grouped_mm` on the dequantized
weights: the FP8 target is a speedup over the BF16 baseline. GPT-OSS (hidden 2880, off the 128 blocks)
has no FP8 row.

Each side is timed by `xstage.bench.calls.measure_call` (`call_ns` over back-to-back calls cycling
through distinct routings, `host_ns`, `launches`, `syncs`, `graph_ns`: the call replayed from a CUDA
graph), after its output on the first routing is held to the other side's within `TOLERANCE` (FP8:
`FP8_TOLERANCE`, quantization against BF16; the accuracy bounds themselves are the tests'). summary.md
gives grouped_mm's call over xstage's per row (above 1: xstage is faster), and the issue's targets.

Example (GPU, transformers 5.17):
    xstage bench experts -o out/experts --only arch=qwen3-30b-a3b --only tokens=1,64,4096
"""

from __future__ import annotations

import copy
import json
import math
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from xstage.bench.call_summary import check_call_cells
from xstage.bench.calls import CALL_COLUMNS, measure_call, relative_error
from xstage.calibrate.experts import fit_experts_calls, source_of
from xstage.errors import InputError
from xstage.integrations.transformers import backend
from xstage.moe.fp8 import dequantize_weights, quantize_weights
from xstage.results import ResultWriter, select
from xstage.results.io import cell_count, cell_text, read_table
from xstage.results.output import write_text
from xstage.spec.moe import MoeShape


@dataclass(frozen=True)
class Arch:
    """A model's experts at their real width: transformers' package, config and experts class names, and
    the config's arguments."""

    name: str
    package: str
    config: str
    experts: str
    kwargs: tuple

    @property
    def width(self) -> tuple[int, int, int, int]:
        """(H, I, E, K) read from the config arguments."""
        kw = dict(self.kwargs)
        inter = kw.get("moe_intermediate_size", kw.get("intermediate_size"))
        experts = kw.get("num_experts", kw.get("n_routed_experts", kw.get("num_local_experts")))
        return kw["hidden_size"], inter, experts, kw["num_experts_per_tok"]

    @property
    def shape(self) -> str:
        return "H{}-I{}-E{}-K{}".format(*self.width)


ARCHS = {a.name: a for a in (
    Arch("qwen3-30b-a3b", "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeExperts",
         (("hidden_size", 2048), ("moe_intermediate_size", 768), ("num_experts", 128), ("num_experts_per_tok", 8))),
    Arch("deepseek-v3", "deepseek_v3", "DeepseekV3Config", "DeepseekV3Experts",
         (("hidden_size", 7168), ("moe_intermediate_size", 2048), ("n_routed_experts", 256),
          ("num_experts_per_tok", 8))),
    Arch("mixtral-8x7b", "mixtral", "MixtralConfig", "MixtralExperts",
         (("hidden_size", 4096), ("intermediate_size", 14336), ("num_local_experts", 8), ("num_experts_per_tok", 2))),
    Arch("olmoe-1b-7b", "olmoe", "OlmoeConfig", "OlmoeExperts",
         (("hidden_size", 2048), ("intermediate_size", 1024), ("num_experts", 64), ("num_experts_per_tok", 8))),
    Arch("gpt-oss-20b", "gpt_oss", "GptOssConfig", "GptOssExperts",
         (("hidden_size", 2880), ("intermediate_size", 2880), ("num_local_experts", 32), ("num_experts_per_tok", 4))),
)}
TOKENS = (1, 8, 64, 512, 4096, 16384)
ROUTINGS = ("uniform", "skewed")
DTYPES = ("bf16", "fp8")
SIDES = ("xstage", "grouped_mm")
COLUMNS = ["arch", "shape", "tokens", "routing", "dtype", "side", "kernel", *CALL_COLUMNS, "max_err"]
KEYS = ["arch", "tokens", "routing", "dtype", "side"]
RESULTS = "experts.csv"
SUMMARY_FILES = ("summary.md", "experts-calls.json")
TOLERANCE = 2e-2  # BF16 against BF16: the two backends' rounding (max |a - b| / max |b|)
FP8_TOLERANCE = 1e-1  # FP8 against BF16 on the dequantized weights: the activations' 1x128 quantization
DISTINCT = 8  # routings the timed calls cycle through
HOT_SHARE, HOT_FRACTION = 0.9, 8  # skewed: 9 tokens in 10 route to the first E / 8 experts
# Calls per timing: enough for a stable median at decode sizes, bounded where one call takes milliseconds.
CALL_BUDGET_NS, MIN_CALLS, MAX_CALLS = 0.6e9, 10, 200


def grid_configs() -> list[dict]:
    """Architecture by architecture (the weights are built once per architecture and dtype)."""
    return [dict(arch=a, dtype=d, routing=r, tokens=t) for a in ARCHS for d in DTYPES for r in ROUTINGS
            for t in TOKENS if not (d == "fp8" and ARCHS[a].width[0] % 128)]


def routings(tokens: int, E: int, K: int, kind: str, device, seed: int, n: int = DISTINCT) -> list[tuple]:
    """`n` distinct routings `(top_k_index int64, top_k_weights)` of `tokens` tokens, weights summing
    to 1 per token, in BF16 as the models' routers hand them over."""
    out = []
    for s in range(n):
        g = torch.Generator(device=device).manual_seed(seed + s)
        scores = torch.rand(tokens, E, generator=g, device=device)
        if kind == "skewed":
            hot = max(K, E // HOT_FRACTION)
            cold = torch.rand(tokens, 1, generator=g, device=device) >= HOT_SHARE
            scores[:, :hot] += (~cold).float() * 2.0  # a hot token's top-k all lie among the hot experts
        w, idx = torch.topk(scores, K, dim=1)
        out.append((idx.contiguous(), (w / w.sum(1, keepdim=True)).to(torch.bfloat16).contiguous()))
    return out


def _config(arch: Arch, impl: str):
    import importlib

    backend.require_transformers()
    root = f"transformers.models.{arch.package}"
    cls = getattr(importlib.import_module(f"{root}.configuration_{arch.package}"), arch.config)
    return cls(experts_implementation=impl, **dict(arch.kwargs))


def _experts_class(arch: Arch):
    import importlib

    return getattr(importlib.import_module(f"transformers.models.{arch.package}.modeling_{arch.package}"),
                   arch.experts)


class Pair:
    """One architecture's experts module on both sides (module docstring), on `device`."""

    def __init__(self, arch: Arch, dtype: str, device="cuda", seed: int = 0):
        self.arch, self.dtype, self.device = arch, dtype, torch.device(device)
        backend.register()
        config = _config(arch, "grouped_mm")
        with torch.device("meta"):
            base = _experts_class(arch)(config).to(torch.bfloat16)
        # BF16 from the start, drawn expert by expert: DeepSeek-V3's experts are 22.5 GB in BF16, and a
        # float32 copy of them with its temporaries would not fit beside them on an 80 GB card.
        base.to_empty(device=self.device)
        g = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in base.named_parameters():
                scale = 0.1 if name.endswith("bias") else (  # unit-scale outputs: gate_up_proj reads H, down_proj I
                    arch.width[0] if name.startswith("gate_up") else arch.width[1]) ** -0.5
                for e in range(p.shape[0]):
                    p[e].copy_(torch.randn(p.shape[1:], generator=g, device=self.device) * scale)
        base = base.requires_grad_(False)
        if dtype == "fp8":
            self.xstage = self._fp8(base, config)
        else:
            self.xstage = copy.copy(base)
            self.xstage.config = copy.copy(config)
            self.xstage.config._experts_implementation = backend.NAME
        self.grouped_mm = base
        self.holder = torch.nn.Module()  # for `decisions`, which reads a model's modules
        self.holder.experts = self.xstage

    def _fp8(self, base, config):
        """transformers' fine-grained FP8 experts on `base`'s weights, quantized 128x128; `base` then
        holds the dequantized weights (the BF16 baseline computes with what the FP8 side reads)."""
        from transformers import FineGrainedFP8Config
        from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

        holder, holder.mlp = torch.nn.Module(), torch.nn.Module()  # it converts modules named "*.experts"
        holder.config = copy.copy(config)
        holder.config._experts_implementation = backend.NAME
        with torch.device("meta"):
            holder.mlp.experts = _experts_class(self.arch)(holder.config)
        replace_with_fp8_linear(holder, quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128)),
                                pre_quantized=True)
        fp8 = holder.mlp.experts
        if type(fp8).__name__ != "FP8Experts":
            raise InputError(f"{self.arch.experts}: transformers did not convert it to FP8Experts")
        fp8.to_empty(device=self.device)
        with torch.no_grad():
            for name, scale in (("gate_up_proj", "gate_up_proj_scale_inv"), ("down_proj", "down_proj_scale_inv")):
                w = getattr(base, name)
                for e in range(0, w.shape[0], 8):  # a few experts at a time (float32 temporaries)
                    q, s = quantize_weights(w[e:e + 8].float())
                    getattr(fp8, name)[e:e + 8].copy_(q)
                    getattr(fp8, scale)[e:e + 8].copy_(s)
                    w[e:e + 8].copy_(dequantize_weights(q, s).to(torch.bfloat16))
        return fp8.requires_grad_(False)

    def _kernel(self, side: str, tokens: int) -> str:
        """What ran the side's eager calls: for xstage, the integration's choice (`decisions`)."""
        if side == "grouped_mm":
            return "grouped_mm"
        choices = backend.decisions(self.holder)
        d = next(iter(choices.values()), {}).get((tokens, False))
        return "fused" if d is None else d.choice

    def measure(self, tokens: int, kind: str, seed: int = 0) -> list[dict]:
        """Both sides' rows at `tokens` and routing `kind`, xstage's first."""
        H, _, E, K = self.arch.width
        g = torch.Generator(device=self.device).manual_seed(seed + 7)
        x = torch.randn(tokens, H, generator=g, device=self.device).to(torch.bfloat16)
        routes = routings(tokens, E, K, kind, self.device, seed)
        sides = {s: (lambda m: (lambda idx, w: m(x, idx, w)))(getattr(self, s)) for s in SIDES}
        tol = FP8_TOLERANCE if self.dtype == "fp8" else TOLERANCE
        rows = []
        with torch.no_grad():
            out = {s: call(*routes[0]) for s, call in sides.items()}
            err = relative_error(out["xstage"], out["grouped_mm"])
            t0 = time.perf_counter()
            sides["grouped_mm"](*routes[0])
            torch.cuda.synchronize()
            est = max(1.0, (time.perf_counter() - t0) * 1e9)
            calls = int(min(MAX_CALLS, max(MIN_CALLS, CALL_BUDGET_NS // est)))
            for side, call in sides.items():
                other = out["grouped_mm" if side == "xstage" else "xstage"]
                m = measure_call(call, routes, other, tol, calls=calls)
                rows.append(dict(arch=self.arch.name, shape=self.arch.shape, tokens=tokens, routing=kind,
                                 dtype=self.dtype, side=side, kernel=self._kernel(side, tokens), max_err=err,
                                 **m.columns()))
        return rows


def run_grid(out_dir, only=None, budget_s: float | None = None, log=print) -> dict:
    """Resumable: rows already in `out_dir/experts.csv` are skipped; stops starting new configurations
    after `budget_s`. Returns the summary (`summarize`)."""
    if not torch.cuda.is_available():
        raise InputError("needs a CUDA GPU (--summarize-only runs anywhere)")
    backend.require_transformers()
    out = Path(out_dir)
    writer = ResultWriter(out / RESULTS, COLUMNS, KEYS, require_commit=True)
    configs = [c for c in select(grid_configs(), only) if not writer.done(dict(c, side="grouped_mm"))]
    t0 = time.time()
    for arch, dtype in dict.fromkeys((c["arch"], c["dtype"]) for c in configs):
        if budget_s is not None and time.time() - t0 > budget_s:
            log("time budget reached; rerun to continue")
            break
        pair = None
        try:
            pair = Pair(ARCHS[arch], dtype)
            for c in (c for c in configs if (c["arch"], c["dtype"]) == (arch, dtype)):
                if budget_s is not None and time.time() - t0 > budget_s:
                    break
                rows = pair.measure(int(c["tokens"]), c["routing"])
                writer.write_many(rows)
                r = {row["side"]: row for row in rows}
                log(f"{arch} {dtype} {c['routing']} T={c['tokens']}: xstage {_us(r['xstage']['call_ns'])} us, "
                    f"grouped_mm {_us(r['grouped_mm']['call_ns'])} us, graphs {_us(r['xstage']['graph_ns'])} / "
                    f"{_us(r['grouped_mm']['graph_ns'])} us, err {r['xstage']['max_err']:.2e} "
                    f"{r['xstage']['call_note']} {r['grouped_mm']['call_note']}")
        except Exception:  # one architecture failing must not lose the others
            log(f"{arch} {dtype}: " + traceback.format_exc()[-2500:])
        del pair
        torch.cuda.empty_cache()
    return summarize(out)


REQUIRED = ("arch", "shape", "tokens", "routing", "dtype", "side", "call_ns")
KERNEL_NAMES = ("fused", "grouped_mm")


def read_experts_csv(path) -> list[dict]:
    """The rows of an `experts.csv`, each cell checked before anything is summarised (one `InputError`
    line naming the row and column)."""
    table = read_table(path, {"experts": REQUIRED})
    for i, r in enumerate(table.rows):
        at = table.where(i)
        if not cell_text(r, "arch", at):
            raise InputError(f"{at}, column arch: empty")
        MoeShape.parse(cell_text(r, "shape", at), f"{at}, column shape")
        cell_count(r, "tokens", at)
        for col, allowed in (("routing", ROUTINGS), ("dtype", DTYPES), ("side", SIDES)):
            if cell_text(r, col, at) not in allowed:
                raise InputError(f"{at}, column {col}: {r[col]!r} is not one of {', '.join(allowed)}")
        if "kernel" in r and cell_text(r, "kernel", at) not in ("", *KERNEL_NAMES):
            raise InputError(f"{at}, column kernel: {r['kernel']!r} is not one of {', '.join(KERNEL_NAMES)}")
        check_call_cells(r, at)  # and max_err
    return table.rows


def _us(v) -> str:
    return f"{float(v) / 1e3:.1f}" if v not in ("", None) else "-"


def _num(row, col: str) -> float | None:
    v = (row or {}).get(col, "")
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) and f > 0 else None


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def summarize(out_dir, rows: list[dict] | None = None) -> dict:
    """summary.md of `out_dir/experts.csv`: grouped_mm's call over xstage's per configuration, eager and
    under graphs, and the targets. Returns {dtype: {"geomean_512": ..., "min_512": ..., "min": ...}}."""
    out = Path(out_dir)
    rows = read_experts_csv(out / RESULTS) if rows is None else rows
    by = {(r["arch"], r["dtype"], r["routing"], int(r["tokens"]), r["side"]): r for r in rows}
    lines = ["# xstage experts backend against transformers' grouped_mm (call against call, EP = 1)", "",
             "Ratios are grouped_mm's time over xstage's (above 1: xstage is faster); FP8 rows: xstage's FP8 "
             "experts against BF16 grouped_mm. An xstage call marked (grouped_mm) ran transformers' chain: the "
             "integration's choice (`xstage.sched.policy.choose_experts`).", "",
             "| arch | dtype | routing | tokens | xstage call (us) | grouped_mm call (us) | ratio | "
             "xstage graph (us) | grouped_mm graph (us) | graph ratio | launches (xstage / grouped_mm) | "
             "host us (xstage) | max_err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios: dict = {}
    for key in sorted({k[:4] for k in by}, key=lambda k: (list(ARCHS).index(k[0]) if k[0] in ARCHS else 99, *k[1:])):
        xs, gm = by.get((*key, "xstage")), by.get((*key, "grouped_mm"))
        call = (_num(gm, "call_ns") / _num(xs, "call_ns")) if _num(gm, "call_ns") and _num(xs, "call_ns") else None
        graph = (_num(gm, "graph_ns") / _num(xs, "graph_ns")) if _num(gm, "graph_ns") and _num(xs, "graph_ns") else None
        if call is not None:
            ratios.setdefault(key[1], []).append((key[0], key[3], call))
        ran = (xs or {}).get("kernel") or "fused"
        cells = [key[0], key[1], key[2], str(key[3]),
                 _us(_num(xs, "call_ns")) + ("" if ran == "fused" else f" ({ran})"), _us(_num(gm, "call_ns")),
                 f"**{call:.2f}**" if call else "-", _us(_num(xs, "graph_ns")), _us(_num(gm, "graph_ns")),
                 f"{graph:.2f}" if graph else "-",
                 f"{(xs or {}).get('launches', '')} / {(gm or {}).get('launches', '')}",
                 _us(_num(xs, "host_ns")), (xs or {}).get("max_err", "")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    summary = {}
    lines.append("")
    for dtype, rs in ratios.items():
        big = [r for _, t, r in rs if t >= 512]
        s = dict(geomean_512=_geomean(big), min_512=min(big) if big else None, min=min(r for *_, r in rs),
                 configurations=len(rs))
        summary[dtype] = s
        worst = min(rs, key=lambda r: r[2])
        lines.append(f"- {dtype}: geomean from 512 tokens {_fmt(s['geomean_512'])} over {len(big)} rows; lowest "
                     f"from 512 tokens {_fmt(s['min_512'])}; lowest anywhere {_fmt(s['min'])} ({worst[0]}, "
                     f"{worst[1]} tokens)")
    write_text(out / "summary.md", "\n".join(lines) + "\n")
    source = source_of(out / RESULTS) if (out / RESULTS).is_file() else "rows given to summarize"
    doc = fit_experts_calls([dict(r, gpu=r.get("gpu") or "unknown") for r in rows], source)
    write_text(out / "experts-calls.json", json.dumps(doc, indent=1) + "\n")
    return summary


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"
