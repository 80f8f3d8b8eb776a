"""The planner's policy: every choice a kernel leaves open is made here and returned as a `Decision`.

Three choices are open to the planner, and each has one function:
- `choose_schedule`: the task order of a fused MoE call (`schedule="model_guided"`);
- `choose_pacing`: the store pacing of a fused MoE call (`pacing="auto"`), for a given order or
  jointly with it;
- `choose_exchange`: the output exchange of a Ulysses attention call (`exchange="auto"`).

`choose_experts` picks the kernel of a transformers experts call (the fused layer, or transformers'
`grouped_mm` chain where that was measured faster; `xstage.sched.experts`).

`choose_layer` ranks the schemes of a whole Ulysses layer (both exchanges and attention) the same
way; it is a prediction that no kernel asks for yet.

The kernels call these functions directly (`xstage.moe.decision`, `xstage.attention.exchange`); no
planner writes into a kernel module. Each returns a `Decision`: the choice, the predicted times of
the alternatives, and what it stood on (store path, dtype, the calibration it used, and whether that
calibration was validated on this path). On a path without its own calibration the costs come from
that path's profile, and the decision says it was not validated there.

What a user controls:
- the costs: `profile=` (a `xstage.model.Profile` of the store path, e.g. one fitted with `xstage
  probe`) and `costs=` (`TaskCosts` or `ExchangeCosts`) replace the embedded H200 calibration;
- forcing: a call that names its schedule, pacing or exchange is never overridden, and a MoE buffer
  can force a variant per token bucket (`MoEBuffer.force_decision`);
- logging: every decision made is logged at INFO on the `xstage.decisions` logger
  (`logging.getLogger("xstage.decisions").setLevel(logging.INFO)` and a handler to see them).

Decisions are cached by the caller per shape: a MoE buffer per token bucket (`xstage.moe.decision`),
the exchange here per (heads, head dim, tokens, ranks, path, dtype) for the embedded costs.

Example:
    >>> from xstage.sched.policy import choose_exchange
    >>> d = choose_exchange(heads=16, dim=128, tokens=4096, ranks=2, path="peer", dtype="bf16")
    >>> d.kind, d.validated, d.choice == d.predicted_ns[0][0]
    ('exchange', False, True)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from xstage.errors import InputError
from xstage.model import Profile, load_default_profile
from xstage.model.interference import load_default_interference
from xstage.sched.calibration import calibration_of
from xstage.sched.costs import TaskCosts, load_default_costs
from xstage.sched.exchange import ExchangeCosts, default_exchange_costs, plan_exchange
from xstage.sched.experts import ExpertsCalls, default_experts_calls
from xstage.sched.layer import LayerConfig, layer_bound, plan_layer
from xstage.sched.moe import FP8_ELEM_BYTES, MoeConfig, routes_rows
from xstage.sched.pacing import resolve_pacing
from xstage.sched.plan import check_candidates, moe_path_params, plan_moe
from xstage.spec.pacing import PACING_CANDIDATES, StorePacing
from xstage.spec.paths import PATHS
from xstage.spec.schedule import CANDIDATES

LOG = logging.getLogger("xstage.decisions")

# Paths on which a kernel's predictions were checked against measurements: the MoE planner on the
# 924-kernel grid of the H200 host path (`benchmarks/results/h200-moe-validation/`), the exchange
# costs on their calibration grid, measured on the host path (`xstage/data/h200-ulysses-calibration.csv`).
VALIDATED_PATHS = {"schedule": ("host",), "pacing": ("host",), "exchange": ("host",)}
KINDS = tuple(VALIDATED_PATHS)


@dataclass(frozen=True)
class Decision:
    """One choice of the planner.

    `kind`: "schedule", "pacing", "exchange", "experts" (`choose_experts`: "fused" or "grouped_mm") or
    "layer" (`choose_layer`, a prediction no kernel asks for yet); `choice`: its spelling (a schedule
    name, a pacing spec of `xstage.spec.pacing`, an exchange of `xstage.spec.exchange`); `predicted_ns`:
    the alternatives as `(spelling, predicted ns)`, fastest first as the planner ranked them (for a
    joint pacing, the spelling is `SCHEDULE@PACING`); empty where nothing was predicted (`note` says
    why). `path`, `dtype`, `calibration`: what it stood on; `validated`: whether that calibration's
    predictions were checked on this path."""

    kind: str
    choice: str
    predicted_ns: tuple[tuple[str, float], ...]
    path: str
    dtype: str
    calibration: str
    validated: bool
    note: str = ""

    def __str__(self) -> str:
        shown = ", ".join(f"{name} {ns / 1e3:.1f} us" for name, ns in self.predicted_ns[:3])
        more = f" (+{len(self.predicted_ns) - 3} more)" if len(self.predicted_ns) > 3 else ""
        valid = "validated on this path" if self.validated else "not validated on this path"
        why = f"; {self.note}" if self.note else ""
        return (f"{self.kind} {self.choice} [{self.path}, {self.dtype}; {self.calibration}, {valid}{why}]"
                + (f": {shown}{more}" if shown else ""))


def _decided(d: Decision) -> Decision:
    LOG.info("%s", d)
    return d


def _check_path(path) -> str:
    if path not in PATHS:
        raise InputError(f"path={path!r}: must be one of {', '.join(PATHS)} (where the stores go)")
    return path


def _moe_calibration(path: str, dtype: str, profile: Profile | None, costs: TaskCosts | None, calibration):
    """(path parameters, tile costs, a label of both, whether both are the embedded calibration):
    `profile` and `costs` where given, else a user's calibration (`calibration=` or the setting
    `XSTAGE_CALIBRATION`, `xstage.sched.calibration`), else the embedded one."""
    if profile is not None and not isinstance(profile, Profile):
        raise InputError(f"profile: expected a xstage.model.Profile or None, got {type(profile).__name__}")
    if costs is not None and not isinstance(costs, TaskCosts):
        raise InputError(f"costs: expected a TaskCosts or None, got {type(costs).__name__}")
    cal = calibration_of(calibration)
    where = "given profile" if profile is not None else None
    what = "given tile costs" if costs is not None else None
    if cal is not None and profile is None and path in cal.profiles:
        profile, where = cal.profiles[path], f"profile {cal.source(path)}"
    if cal is not None and costs is None and dtype in cal.moe:
        costs, what = cal.moe[dtype], f"tile costs {cal.source(f'moe {dtype}')}"
    embedded = where is None and what is None
    label = f"{where or f'embedded H200 {path} path'}, {what or 'embedded H200 tile costs'}"
    params = profile.params if profile is not None else moe_path_params(path)
    costs = costs if costs is not None else load_default_costs("moe", "fp8" if dtype == "fp8" else "bf16")
    return params, costs, label, embedded


def choose_schedule(cfg: MoeConfig, path: str, ctas: int, pacing: StorePacing | None, *, dtype: str = "bf16",
                    candidates: Sequence[str] = CANDIDATES, profile: Profile | None = None,
                    costs: TaskCosts | None = None, calibration=None) -> Decision:
    """The order with the lowest predicted kernel time for `cfg` (a rank's shape, group and tokens) on
    `path` with `ctas` persistent CTAs and the store pacing `pacing`. Where the planner's synthetic
    routing routes no row to the rank at this count (`xstage.sched.moe.routes_rows`), every order runs
    no task, and the first candidate is the answer."""
    path = _check_path(path)
    params, costs, label, embedded = _moe_calibration(path, dtype, profile, costs, calibration)
    validated = embedded and path in VALIDATED_PATHS["schedule"]
    if not routes_rows(cfg):
        return _decided(Decision("schedule", check_candidates(candidates)[0], (), path, dtype, label, validated,
                                 "no row is routed to this rank at this count"))
    rows = plan_moe(cfg, params, costs, ctas, candidates=candidates, pacing=pacing,
                    interference=load_default_interference(path))
    return _decided(Decision("schedule", rows[0].schedule, tuple((r.schedule, r.rank_ns) for r in rows), path, dtype,
                             label, validated))


def choose_pacing(cfg: MoeConfig, path: str, ctas: int, schedule: str | None, *, dtype: str = "bf16",
                  candidates: Sequence[str] = CANDIDATES, profile: Profile | None = None,
                  costs: TaskCosts | None = None, calibration=None) -> Decision:
    """The pacing spec (one of `PACING_CANDIDATES`) with the lowest predicted time for `schedule`, or
    for the best schedule when `schedule` is None (chosen jointly). `"off"` with one rank, or where the
    synthetic routing routes no row to the rank at this count: there is no remote store to pace."""
    path = _check_path(path)
    params, costs, label, embedded = _moe_calibration(path, dtype, profile, costs, calibration)
    validated = embedded and path in VALIDATED_PATHS["pacing"]
    if cfg.ep < 2 or not routes_rows(cfg):
        why = "one rank: no remote store" if cfg.ep < 2 else "no row is routed to this rank at this count"
        return _decided(Decision("pacing", "off", (), path, dtype, label, validated, why))
    pacings = {spec: resolve_pacing(spec, path, cfg.ep) for spec in PACING_CANDIDATES}
    rows = plan_moe(cfg, params, costs, ctas, candidates=[schedule] if schedule else candidates, pacings=pacings,
                    interference=load_default_interference(path))
    alternatives = tuple((r.pacing if schedule else r.variant, r.rank_ns) for r in rows)
    return _decided(Decision("pacing", rows[0].pacing, alternatives, path, dtype, label, validated))


def pacing_of(decision: Decision, path: str, num_ranks: int) -> StorePacing | None:
    """The `StorePacing` a pacing decision names on `path` (None: unpaced)."""
    return resolve_pacing(decision.choice, path, num_ranks)


@functools.cache
def _embedded_exchange(heads: int, dim: int, tokens: int, ranks: int, path: str, dtype: str) -> Decision:
    return _exchange(heads, dim, tokens, ranks, path, dtype, None, None)


def _exchange(heads, dim, tokens, ranks, path, dtype, costs: ExchangeCosts | None, cal) -> Decision:
    label = None
    if costs is not None:
        label = f"given exchange costs ({costs.source or 'no source'})"
    elif cal is not None and cal.exchange is not None:
        costs, label = cal.exchange, f"exchange costs {cal.source('exchange')}"
    validated = label is None and path in VALIDATED_PATHS["exchange"]
    if costs is None:
        costs, label = default_exchange_costs(), "embedded H200 host-path exchange costs"
    if path == "peer":
        # The in-kernel stores drain at the NVLink profile's rate; the copy engine's and the attention's
        # costs stay those of the calibration, measured on the host path.
        user = cal.profiles.get("peer") if cal is not None else None
        drain = (user or load_default_profile("peer")).params.drain
        costs = dataclasses.replace(costs, drain=drain)
        label += f" with the drain of {'profile ' + cal.source('peer') if user else 'the embedded peer profile'}"
        validated = False
    preds = plan_exchange(heads, dim, tokens, ranks, costs)
    return Decision("exchange", preds[0].exchange, tuple((p.exchange, p.time_ns) for p in preds), path, dtype, label,
                    validated)


def choose_exchange(heads: int, dim: int, tokens: int, ranks: int, *, path: str, dtype: str,
                    costs: ExchangeCosts | None = None, calibration=None) -> Decision:
    """The exchange with the lowest predicted time for a Ulysses layer of `heads` heads of `dim`,
    `tokens` tokens in all and `ranks` ranks, predicted for rank 0 of the group (the ranks' shares
    differ by at most one head and one token) at batch 1. `costs` None: a user's calibration's
    (`calibration=` or `XSTAGE_CALIBRATION`), else the embedded host-path costs; on `peer` the
    in-kernel stores drain at the NVLink profile's rate, and the decision says it was not validated
    there. With fewer heads than ranks some ranks own no head, which the planner does not model:
    `serial` then."""
    path = _check_path(path)
    if costs is not None and not isinstance(costs, ExchangeCosts):
        raise InputError(f"costs: expected ExchangeCosts or None, got {type(costs).__name__}")
    cal = calibration_of(calibration)
    if heads < ranks:
        return _decided(Decision("exchange", "serial", (), path, dtype, "none", path in VALIDATED_PATHS["exchange"],
                                 "fewer heads than ranks: some rank owns no head"))
    if costs is None and cal is None:
        return _decided(_embedded_exchange(int(heads), int(dim), int(tokens), int(ranks), path, str(dtype)))
    return _decided(_exchange(heads, dim, tokens, ranks, path, dtype, costs, cal))


def choose_layer(heads: int, dim: int, tokens: int, ranks: int, *, path: str, dtype: str, batch: int = 1,
                 schemes: Sequence[str] | None = None, costs: ExchangeCosts | None = None) -> Decision:
    """The scheme of a whole Ulysses layer (pre exchange, attention, post exchange) with the lowest
    predicted time for rank 0 (`xstage.sched.layer`): today's exchanges with the pre exchange before
    them, and head-chunk pipelines of both exchanges (`heads:CORE:C`). A prediction only: the head-chunk
    pipeline runs on torch.distributed groups but no prediction of it has been measured, so
    `exchange="auto"` does not call it (`validated` is False; `note` gives the layer's lower bound). `costs`: host-path
    exchange costs (default: the embedded fit)."""
    path = _check_path(path)
    if costs is not None and not isinstance(costs, ExchangeCosts):
        raise InputError(f"costs: expected ExchangeCosts or None, got {type(costs).__name__}")
    cfg = LayerConfig(heads, dim, tokens, ranks, batch, path, dtype)
    preds = plan_layer(cfg, schemes, costs)
    bound = layer_bound(cfg, costs)
    label = (f"given exchange costs ({costs.source or 'no source'})" if costs is not None
             else "embedded H200 host-path exchange costs") + (", rates scaled to the peer profile" if path == "peer"
                                                               else "")
    return _decided(Decision("layer", preds[0].scheme, tuple((p.scheme, p.time_ns) for p in preds), path, dtype,
                             label, False, f"lower bound {bound.time_ns / 1e3:.1f} us; the pre exchange and the "
                             "head-chunk schemes are predicted, not measured"))


def choose_experts(shape: str, tokens: int, *, dtype: str, gpu: str, graph: bool = False,
                   calls: ExpertsCalls | None = None) -> Decision:
    """The kernel of one transformers experts call of `tokens` tokens at `shape` (`H-I-E-K`, the module's
    own sizes) on `gpu` (its name, as torch reports it): "fused" unless transformers' `grouped_mm` chain
    was measured faster there by more than the data's margin, eager or (`graph`) under CUDA-graph
    capture. `calls`: measurements to decide on (default: the embedded ones). Without a measurement of
    this GPU, dtype and shape the choice is "fused", and the note says so."""
    calls = default_experts_calls() if calls is None else calls
    mode = "graph" if graph else "eager"
    pred = {k: calls.predict(gpu, dtype, shape, k, mode, tokens) for k in ("fused", "grouped_mm")}
    if None in pred.values():
        return Decision("experts", "fused", (), "-", dtype, calls.source, False,
                        f"no {mode} measurement of {shape} {dtype} on {gpu}: the fused layer")
    ranked = tuple(sorted(pred.items(), key=lambda kv: kv[1]))
    choice = "grouped_mm" if pred["grouped_mm"] < pred["fused"] * (1 - calls.margin) else "fused"
    return Decision("experts", choice, ranked, "-", dtype, calls.source, True,
                    f"{mode}, measured on {gpu}, interpolated to {tokens} tokens")


def buffer_config(buf, tokens_per_rank: int) -> MoeConfig:
    """What the planner predicts for a MoE buffer (`xstage.moe.MoEBuffer`: its shape, group size,
    tiles and row pool) at `tokens_per_rank` tokens per rank."""
    c = buf.cfg
    return MoeConfig(hidden=buf.H, intermediate=buf.I, num_experts=buf.E, topk=buf.K,
                     tokens_per_rank=max(1, int(tokens_per_rank)), ep=buf.R, block_m=c.block_m,
                     block_n1=c.block_n1, block_n2=min(c.block_n2, buf.H), block_k=c.block_k, dynamic=c.dynamic,
                     pool_units=buf.pool_units,
                     # an FP8 buffer: 1-byte operands (its own traced tile costs), BF16 combine rows
                     **(FP8_ELEM_BYTES if buf.fp8 else {}))


def pick_for_moe_buffer(buf, tokens_per_rank: int, num_ctas: int, pacing: StorePacing | None,
                        candidates: Sequence[str] = CANDIDATES) -> str:
    """`choose_schedule`'s choice for a MoE buffer at `tokens_per_rank` tokens per rank."""
    return choose_schedule(buffer_config(buf, tokens_per_rank), buf.store_path, num_ctas, pacing,
                           dtype="fp8" if buf.fp8 else "bf16", candidates=candidates).choice


def pick_pacing_for_buffer(buf, tokens_per_rank: int, num_ctas: int, schedule: str | None,
                           candidates: Sequence[str] = CANDIDATES) -> str:
    """`choose_pacing`'s choice (a spec of `PACING_CANDIDATES`) for a MoE buffer."""
    return choose_pacing(buffer_config(buf, tokens_per_rank), buf.store_path, num_ctas, schedule,
                         dtype="fp8" if buf.fp8 else "bf16", candidates=candidates).choice


__all__ = ["KINDS", "VALIDATED_PATHS", "Decision", "buffer_config", "choose_exchange", "choose_layer",
           "choose_pacing", "choose_schedule", "pacing_of", "pick_for_moe_buffer", "pick_pacing_for_buffer"]
