"""`xstage bench moe-calls`: the fused MoE call against transformers' `grouped_mm` experts, call against call.

Both sides get the same weights, inputs and routings on one GPU (EP = 1). transformers' side is the
model's own experts module (`Qwen3MoeExperts`, `DeepseekV3Experts`, `MixtralExperts`), built from its
config class with `experts_implementation="grouped_mm"` (the implementation a transformers 5 model
picks when none is asked for: `PreTrainedModel.get_correct_experts_implementation`), so its forward
is `transformers.integrations.moe.grouped_mm_experts_forward`: sort by expert, `torch.histc` offsets,
`grouped_mm` up, SwiGLU, `grouped_mm` down, weighted top-k sum. Its weights are `gate_up_proj [E, 2I, H]`
(gate rows, then up rows) and `down_proj [E, H, I]`: the layout `xstage.moe.transform_weights` takes,
which gives the fused kernel's (the down projection is shared, not copied). xstage's side is
`fused_moe(x, topk_idx, topk_weights, w1t, w2, buf)` with every other argument at its default, on a
buffer at its defaults sized for the run's largest token count of the model.

Per model (the widths of `MODELS`) and token count (`TOKENS`), two rows (`side`): each with its call
(`xstage.bench.calls.measure_call`: `call_ns`, `host_ns`, `launches`, `syncs`, and `graph_ns`, the
call replayed from a CUDA graph) and `kernel_ns`, the kernels' own time: for xstage the main kernel
and the reduce on a plan built before the timed runs (as `time_ns + reduce_ns` in `xstage bench moe`),
for transformers the summed device time of its kernels in torch's profiler. `max_err`: the largest
difference between the two outputs over the largest of transformers' (routing 0). summary.md gives
transformers over xstage per call, per kernels, under graphs, and how much of the kernels' ratio the
call keeps. transformers is imported only when the grid runs (it is not a dependency of xstage).

Example (GPU, transformers 5 installed):
    xstage bench moe-calls -o out/moe-calls --only model=qwen3-30b-a3b --only tokens=64,4096
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from xstage.bench.call_summary import check_call_cells
from xstage.bench.calls import CALL_COLUMNS, CALLS, count_launches, measure_call, relative_error
from xstage.bench.moe import call_routings, time_main_and_reduce, tolerance
from xstage.dtypes import dtype_name
from xstage.errors import InputError, XstageError
from xstage.moe.buffer import LoopbackGroup, MoEBuffer
from xstage.moe.fused import fused_moe, plan
from xstage.moe.layout import transform_weights
from xstage.moe.problem import routing
from xstage.results import ResultWriter, select, synchronize
from xstage.results.io import cell_count, cell_text, cell_time, read_table
from xstage.results.output import write_text
from xstage.spec.moe import BlockConfig, MoeShape

EXPERTS_IMPLEMENTATION = "grouped_mm"


@dataclass(frozen=True)
class ModelSpec:
    """A model's MoE width (`shape`) and where transformers keeps its experts: the package under
    `transformers.models`, its config and experts classes, and the config's names of the expert
    width and count."""

    name: str
    shape: str
    package: str
    config: str
    experts: str
    intermediate_key: str
    experts_key: str

    def dims(self) -> MoeShape:
        return MoeShape.parse(self.shape)


MODELS = {m.name: m for m in (
    ModelSpec("qwen3-30b-a3b", "H2048-I768-E128-K8", "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeExperts",
              "moe_intermediate_size", "num_experts"),
    ModelSpec("deepseek-v3", "H7168-I2048-E256-K8", "deepseek_v3", "DeepseekV3Config", "DeepseekV3Experts",
              "moe_intermediate_size", "n_routed_experts"),
    ModelSpec("mixtral-8x7b", "H4096-I14336-E8-K2", "mixtral", "MixtralConfig", "MixtralExperts",
              "intermediate_size", "num_local_experts"),
)}
TOKENS = (64, 512, 4096, 16384)
SIDES = ("xstage", "transformers")
COLUMNS = ["model", "shape", "H", "I", "E", "K", "tokens", "dtype", "side", "impl", "kernel_ns", *CALL_COLUMNS,
           "max_err"]
KEYS = ["model", "tokens", "dtype", "side"]
RESULTS = "moe-calls.csv"  # appended to by every run
SUMMARY_FILES = ("summary.md",)
KEPT_FROM_TOKENS, KEPT = 512, 0.95  # from 512 tokens the call keeps >= 95% of the kernels' ratio
GRAPH_TOKENS = 64  # under CUDA graphs the call is >= 1.0x at 64 tokens


def grid_configs() -> list[dict]:
    """Every model at every token count, model by model (their weights are built once per model)."""
    return [dict(model=m, tokens=t) for m in MODELS for t in TOKENS]


def require_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        raise InputError("needs transformers (pip install transformers; 5.x, whose experts take "
                         "experts_implementation='grouped_mm')")


def transformers_experts(spec: ModelSpec, l1: torch.Tensor, l2: torch.Tensor):
    """transformers' experts module of `spec` on the weights `l1 [E, 2I, H]`, `l2 [E, H, I]` (shared,
    not copied), dispatching to `grouped_mm`; refused when this transformers dispatches elsewhere."""
    require_transformers()
    H, I, E, K = MoeShape.parse(spec.shape)
    root = f"transformers.models.{spec.package}"
    config_cls = getattr(importlib.import_module(f"{root}.configuration_{spec.package}"), spec.config)
    experts_cls = getattr(importlib.import_module(f"{root}.modeling_{spec.package}"), spec.experts)
    config = config_cls(hidden_size=H, num_experts_per_tok=K, experts_implementation=EXPERTS_IMPLEMENTATION,
                        **{spec.intermediate_key: I, spec.experts_key: E})
    with torch.device("meta"):  # no weights of its own: it takes ours
        module = experts_cls(config)
    module.gate_up_proj = torch.nn.Parameter(l1, requires_grad=False)
    module.down_proj = torch.nn.Parameter(l2, requires_grad=False)
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    forward = ALL_EXPERTS_FUNCTIONS.get_interface(config._experts_implementation, None)
    if left or getattr(forward, "__name__", "") != "grouped_mm_experts_forward":
        raise XstageError(f"{spec.experts}: not the grouped_mm experts of this transformers (dispatches to "
                          f"{getattr(forward, '__name__', forward)}; tensors left without data: {left})")
    return module


class CallPair:
    """One model's weights on both sides: transformers' experts module and xstage's buffer (`tokens_max`
    tokens, defaults otherwise) with the transformed weights."""

    def __init__(self, spec: ModelSpec, tokens_max: int, device, dtype=torch.bfloat16, seed: int = 0,
                 config: BlockConfig | None = None):
        H, I, E, K = self.dims = spec.dims()
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        g = torch.Generator(device=self.device).manual_seed(seed)
        l1 = torch.randn(E, 2 * I, H, generator=g, device=self.device, dtype=dtype).mul_(H**-0.5)
        l2 = torch.randn(E, H, I, generator=g, device=self.device, dtype=dtype).mul_(I**-0.5)
        self.experts = transformers_experts(spec, l1, l2)
        del l1, l2
        self.buf = MoEBuffer(tokens_max, E, K, H, I, LoopbackGroup(1), device=self.device, dtype=dtype,
                             config=config)
        self.w1t, self.w2 = transform_weights(self.experts.gate_up_proj.data, self.experts.down_proj.data,
                                              self.buf.cfg.block_n1)

    def inputs(self, tokens: int, seed: int = 0) -> tuple[torch.Tensor, list[tuple]]:
        """`x [tokens, H]` and the distinct routings the calls cycle through (weights in the model's
        dtype, as transformers' routers hand them over)."""
        H, _, E, K = self.dims
        g = torch.Generator(device=self.device).manual_seed(seed + 1)
        x = torch.randn(tokens, H, generator=g, device=self.device, dtype=self.dtype)
        idx, w = routing(tokens, E, K, self.device, seed)
        routes = call_routings(idx, w, E, K, first_seed=seed + 1)
        return x, [(i, r.to(self.dtype)) for i, r in routes]

    def xstage_call(self, x):
        return lambda idx, w: fused_moe(x, idx, w, self.w1t, self.w2, self.buf)

    def transformers_call(self, x):
        return lambda idx, w: self.experts(x, idx, w)

    def kernels(self, x, idx, w, warmup: int, rep: int) -> tuple[float, torch.Tensor]:
        """xstage's kernels (main + reduce medians, ns) on a plan built first, with the call's default
        schedule, and their output."""
        schedule = inspect.signature(fused_moe).parameters["schedule"].default
        p = plan(idx, self.buf, schedule)
        pb = SimpleNamespace(x_in=x, w1t=self.w1t, w2=self.w2, buf=self.buf, idx=idx, w=w)
        y = torch.empty_like(x)
        if warmup:
            time_main_and_reduce(pb, p, y, warmup)
        main, reduce_ns = time_main_and_reduce(pb, p, y, rep)
        return main.median_ns + reduce_ns, y


def measure_pair(pair: CallPair, tokens: int, warmup: int = 5, rep: int = 30, calls: int = CALLS,
                 profiled: int = 5) -> list[dict]:
    """Both sides at `tokens` (module docstring): the two rows, xstage's first."""
    x, routes = pair.inputs(tokens)
    tol = tolerance(pair.dtype)
    with torch.no_grad():
        kernel_ns, y_kernels = pair.kernels(x, *routes[0], warmup, rep)
        sides = dict(xstage=pair.xstage_call(x), transformers=pair.transformers_call(x))
        out = {s: call(*routes[0]) for s, call in sides.items()}
        synchronize()
        err = relative_error(out["xstage"], out["transformers"])
        # Each call is held to the xstage kernels' output: the two sides agree, or neither is timed.
        measured = {s: measure_call(call, routes, y_kernels, tol, calls=calls,
                                    after=pair.buf.check if s == "xstage" else None) for s, call in sides.items()}
        tf_kernels = count_launches(lambda: sides["transformers"](*routes[0]), calls=profiled)
    H, I, E, K = pair.dims
    base = dict(model=pair.spec.name, shape=pair.spec.shape, H=H, I=I, E=E, K=K, tokens=tokens,
                dtype=dtype_name(pair.dtype), max_err=err)
    schedule = inspect.signature(fused_moe).parameters["schedule"].default
    return [dict(base, side="xstage", impl=schedule, kernel_ns=kernel_ns, **measured["xstage"].columns()),
            dict(base, side="transformers", impl=EXPERTS_IMPLEMENTATION,
                 kernel_ns="" if tf_kernels is None or tf_kernels.kernel_ns is None else tf_kernels.kernel_ns,
                 **measured["transformers"].columns())]


def run_grid(out_dir, only=None, warmup: int = 5, rep: int = 30, budget_s: float | None = None, log=print) -> dict:
    """Resumable: (model, tokens) pairs already in `out_dir/moe-calls.csv` are skipped; stops starting
    new ones after `budget_s`. Returns the summary (`summarize`)."""
    if not torch.cuda.is_available():
        raise InputError("needs a CUDA GPU (--summarize-only runs anywhere)")
    require_transformers()
    out = Path(out_dir)
    writer = ResultWriter(out / RESULTS, COLUMNS, KEYS, require_commit=True)
    configs = select(grid_configs(), only)
    t0 = time.time()
    for name in dict.fromkeys(c["model"] for c in configs):
        todo = [int(c["tokens"]) for c in configs if c["model"] == name
                and not writer.done(dict(model=name, tokens=c["tokens"], dtype="bf16", side="transformers"))]
        if not todo:
            continue
        if budget_s is not None and time.time() - t0 > budget_s:
            log("time budget reached; rerun to continue")
            break
        try:
            pair = CallPair(MODELS[name], max(int(c["tokens"]) for c in configs if c["model"] == name), "cuda")
            for tokens in todo:
                if budget_s is not None and time.time() - t0 > budget_s:
                    log("time budget reached; rerun to continue")
                    break
                rows = measure_pair(pair, tokens, warmup, rep)
                writer.write_many(rows)
                for r in rows:
                    log(f"{name} T={tokens} {r['side']:>12}: call {_us(r['call_ns'])} us, kernels "
                        f"{_us(r['kernel_ns'])} us, graph {_us(r['graph_ns'])} us, {r['launches']} launches, "
                        f"err {r['max_err']:.2e}" + (f" [{r['call_note']}]" if r["call_note"] else ""))
        except Exception:  # one model failing must not lose the others
            log(f"model {name}: " + traceback.format_exc()[-2500:])
        pair = None
        torch.cuda.empty_cache()
    return summarize(out)


def _us(v) -> str:
    return f"{float(v) / 1e3:.1f}" if v not in ("", None) else "-"


# ---- reading and summarising -------------------------------------------------------------------------

REQUIRED = ("model", "shape", "H", "I", "E", "K", "tokens", "side", "kernel_ns", "call_ns")


def read_calls_csv(path) -> list[dict]:
    """The rows of a `moe-calls.csv`, checked before anything is summarised: the file
    (`xstage.results.io.read_table`), the shape and its sizes, the side, the times and call columns
    (`xstage.bench.call_summary.check_call_cells`) and the measured error."""
    table = read_table(path, {"moe-calls": REQUIRED})
    for i, r in enumerate(table.rows):
        at = table.where(i)
        if not cell_text(r, "model", at):
            raise InputError(f"{at}, column model: empty")
        shape = MoeShape.parse(cell_text(r, "shape", at), f"{at}, column shape")
        for c, v in zip("HIEK", shape):
            if cell_count(r, c, at) != v:
                raise InputError(f"{at}, column {c}: {r[c]} differs from the shape {shape}")
        cell_count(r, "tokens", at)
        if cell_text(r, "side", at) not in SIDES:
            raise InputError(f"{at}, column side: {r['side']!r} is not one of {', '.join(SIDES)}")
        cell_time(r, "kernel_ns", at, optional=True)
        check_call_cells(r, at)  # and max_err
    return table.rows


def _f(row, column: str) -> float | None:
    text = str(row.get(column) or "").strip() if row else ""
    return float(text) if text else None


def _ratio(a, b) -> float | None:
    return a / b if a and b else None


def _us_of(row, column: str) -> str:
    return _us(row.get(column) if row else None)


def _cell(v, fmt: str = ".2f") -> str:
    return "" if v is None else format(v, fmt)


def summarize(out_dir, rows: list[dict] | None = None) -> dict:
    """summary.md of `out_dir/moe-calls.csv` (module docstring); returns {model: {tokens: {call, kernels,
    graph, kept}}}, each transformers' time over xstage's (None where a side has none)."""
    out = Path(out_dir)
    rows = read_calls_csv(out / RESULTS) if rows is None else rows
    by = {(r["model"], int(r["tokens"]), r["side"]): r for r in rows}
    lines = ["# The fused MoE call against transformers' grouped_mm experts (one GPU, EP = 1)", "",
             "Same weights, inputs and routings on both sides. Each ratio is transformers' time over xstage's "
             "(above 1: xstage is faster). `call`: the public call with its defaults, back to back on 16 routings "
             "(`call_ns`); `kernels`: the kernels' own time (xstage: main + reduce on a plan built before the "
             "timed runs; transformers: its kernels' summed device time in torch's profiler); `graph`: the call "
             "replayed from a CUDA graph (both sides captured); `kept`: the call ratio over the kernels' ratio. "
             "Times in us.", "",
             "| model | shape | tokens | call: transformers | call: xstage | call ratio | kernels: transformers | "
             "kernels: xstage | kernels' ratio | kept | graph: transformers | graph: xstage | graph ratio | "
             "launches (transformers / xstage) | max_err |", "|" + "---|" * 15]
    summary: dict = {}
    kept_flags, graph_flags, not_captured = [], [], []
    for model, tokens in sorted({k[:2] for k in by}, key=lambda k: (list(MODELS).index(k[0]) if k[0] in MODELS
                                                                     else len(MODELS), k)):
        tf, xs = by.get((model, tokens, "transformers")), by.get((model, tokens, "xstage"))
        call = _ratio(_f(tf, "call_ns"), _f(xs, "call_ns"))
        kern = _ratio(_f(tf, "kernel_ns"), _f(xs, "kernel_ns"))
        graph = _ratio(_f(tf, "graph_ns"), _f(xs, "graph_ns"))
        kept = _ratio(call, kern)
        summary.setdefault(model, {})[tokens] = dict(call=call, kernels=kern, graph=graph, kept=kept)
        if tokens >= KEPT_FROM_TOKENS and kept is not None:
            kept_flags.append(kept >= KEPT)
        if tokens == GRAPH_TOKENS:
            if graph is not None:
                graph_flags.append(graph >= 1.0)
            else:
                not_captured += [f"{model} {s}: {n.strip()}" for s, r in (("transformers", tf), ("xstage", xs)) if r
                                 for n in str(r.get("call_note") or "").split(";") if n.strip().startswith("graph:")]
        shape = (xs or tf)["shape"]
        launches = " / ".join(str(r.get("launches") or "-") if r else "-" for r in (tf, xs))
        cells = [model, shape, str(tokens), _us_of(tf, "call_ns"), _us_of(xs, "call_ns"), _cell(call),
                 _us_of(tf, "kernel_ns"), _us_of(xs, "kernel_ns"), _cell(kern), _cell(kept), _us_of(tf, "graph_ns"),
                 _us_of(xs, "graph_ns"), _cell(graph), launches, _cell(_f(xs or tf, "max_err"), ".2e")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"- from {KEPT_FROM_TOKENS} tokens the call keeps >= {KEPT:.0%} of the kernels' ratio: "
              + (f"met in {sum(kept_flags)} of {len(kept_flags)}" if kept_flags else "no pair measured"),
              f"- under CUDA graphs the call is >= 1.0x transformers' at {GRAPH_TOKENS} tokens: "
              + (f"met in {sum(graph_flags)} of {len(graph_flags)}" if graph_flags else "no pair captured")
              + (f"; not captured: {'; '.join(not_captured)}" if not_captured else "")]
    if rows:
        env = rows[-1]
        commits = sorted({r.get("git_commit", "") or "unknown" for r in rows})
        lines += ["", f"Machine: {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, "
                      f"triton {env.get('triton')}, {env.get('date')}; commit {', '.join(commits)}."]
    write_text(out / "summary.md", "\n".join(lines) + "\n")
    return summary


# ---- the command ---------------------------------------------------------------------------------------------

