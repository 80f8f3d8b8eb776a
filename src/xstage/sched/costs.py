"""Task costs of persistent kernels, measured on the GPU and stored beside the path profile.

Between tiles a CTA spends `fetch_ns` taking its next task and checking its inputs (measured as the
median gap between a CTA's consecutive traced tiles). A tile's compute time comes, in this order,
from the measured medians of its shape (`table`, interpolated in rows per expert), from the tile
model (`tile_model`, `xstage.sched.tilecost`: a roofline over the tile's FLOPs and bytes that carries
to unmeasured shapes and operand sizes), or from a per-kind `overhead_ns + work / rate` (one CTA on
one SM; work is FLOPs for GEMM tiles and bytes for copy tasks such as dispatch), fitted to in-kernel
timings of the kernel's own tiles (`xstage.calibrate.tiles`). Those are traced in the `expert_wave`
order; the order effect (`order`, `xstage.sched.ordercost`) scales them for the schedule that runs
them. The JSON keeps all of it, the data it came from and provenance, so a planner on a machine
without a GPU uses measured costs, never guessed ones.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from xstage.errors import InputError
from xstage.results.io import read_json
from xstage.sched.ordercost import OrderEffect
from xstage.sched.tilecost import TileModel


def _number(v, field: str, positive: bool = True) -> float:
    """`v` if it is a JSON number (not a boolean or a string), finite and > 0 (>= 0 unless `positive`)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{field} must be a number, got {v!r}")
    x = float(v)
    if not (math.isfinite(x) and (x > 0 if positive else x >= 0)):
        raise ValueError(f"{field} must be finite and {'> 0' if positive else '>= 0'}, got {v!r}")
    return x


# A kind of task, alone or at one tile config: `dispatch`, `linear1@128x128x256x64`, `attention@128x128x64`
# (`cost` reads the BLOCK_M of the config).
_KIND_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(@[1-9][0-9]*(x[1-9][0-9]*)+)?")


@dataclass(frozen=True)
class KindCost:
    overhead_ns: float
    rate: float

    def __post_init__(self):
        if not (self.overhead_ns >= 0 and math.isfinite(self.overhead_ns)):
            raise InputError(f"overhead_ns must be finite and >= 0, got {self.overhead_ns!r}")
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise InputError(f"rate must be finite and > 0, got {self.rate!r}")

    def time_ns(self, work: float) -> float:
        return self.overhead_ns + work / self.rate


@dataclass(frozen=True)
class TaskCosts:
    """Measured per-kind tile costs of one kernel (e.g. MoE `dispatch`, `linear1`, `linear2`)."""

    kernel: str
    kinds: dict[str, KindCost]
    provenance: dict = field(default_factory=dict)
    quality: dict = field(default_factory=dict)
    # Measured medians: shape, block, kind, rows_per_expert, median_ns (and elem_bytes where not 2).
    table: list = field(default_factory=list)
    fetch_ns: float = 0.0  # per task, between tiles: taking the task and checking its inputs (median gap)
    tile_model: TileModel | None = None  # for shapes the table lacks; None in JSON from before the model
    order: OrderEffect | None = None  # tile times under other schedules than the traced one; None: no effect

    def __post_init__(self):
        if not (self.fetch_ns >= 0 and math.isfinite(self.fetch_ns)):
            raise InputError(f"fetch_ns must be finite and >= 0, got {self.fetch_ns!r}")

    def tile_ns(self, kind: str, block: str, shape: str, rows_per_expert: float, work: float,
                elem_bytes: int = 2, schedule: str | None = None) -> float:
        """A task's compute time under `schedule` (None: the traced order), the traced time times the
        order effect's factor."""
        base = self._traced_tile_ns(kind, block, shape, rows_per_expert, work, elem_bytes)
        if self.order is None:
            return base
        return base * self.order.factor(schedule, shape, kind, rows_per_expert, elem_bytes)

    def _traced_tile_ns(self, kind: str, block: str, shape: str, rows_per_expert: float, work: float,
                        elem_bytes: int) -> float:
        """A task's traced compute time: the measured medians of this shape, kind, tile config and operand
        size, interpolated in log(rows per expert) and held constant beyond the measured range (how much
        each expert's weights are reused changes a tile's time); where this shape was not measured, the
        tile model, or the per-kind fit of `work` in costs from before the tile model."""
        pts = sorted((r["rows_per_expert"], r["median_ns"]) for r in self.table
                     if r["kind"] == kind and r["block"] == block and r["shape"] == shape
                     and r.get("elem_bytes", 2) == elem_bytes)
        if not pts:
            if self.tile_model is not None:
                return self.tile_model.tile_ns(kind, shape, block, rows_per_expert, elem_bytes)
            return self.cost(kind, block).time_ns(work)
        xs = np.log([max(p[0], 1e-9) for p in pts])
        return float(np.interp(np.log(max(rows_per_expert, 1e-9)), xs, [p[1] for p in pts]))


    def cost(self, kind: str, block: str | None = None) -> KindCost:
        """The cost of `kind`, measured at tile config `block` when given (keys `kind@block`).

        A tile config that was not calibrated takes the calibrated config of the same kind with the
        nearest BLOCK_M, its rate scaled by the BLOCK_M ratio: the H200 calibration shows tiles of
        these shapes bound by weight traffic, so a tile's FLOP rate grows with its rows (64-row tiles
        ran at 0.5-0.54x the rate of 128-row ones)."""
        for key in ((f"{kind}@{block}", kind) if block else (kind,)):
            if key in self.kinds:
                return self.kinds[key]
        if block:
            bm = int(block.split("x")[0])
            same_kind = [(int(k.split("@")[1].split("x")[0]), k) for k in self.kinds if k.startswith(f"{kind}@")]
            if same_kind:
                bm_key, key = min(same_kind, key=lambda c: (abs(c[0] - bm), c[1]))
                base = self.kinds[key]
                return KindCost(base.overhead_ns, base.rate * bm / bm_key)
        want = f"{kind}@{block}" if block else kind
        raise InputError(f"task costs of {self.kernel}: nothing measured for {want!r}; have {sorted(self.kinds)}")

    @classmethod
    def merged(cls, *parts: TaskCosts) -> TaskCosts:
        """One table from calibrations of different tile configs (later parts win on equal keys)."""
        if not parts or len({p.kernel for p in parts}) != 1:
            raise InputError("merged task costs: give one or more calibrations of the same kernel")
        kinds: dict[str, KindCost] = {}
        quality: dict = {}
        table: list = []
        for p in parts:
            kinds.update(p.kinds)
            quality.update(p.quality)
            table.extend(p.table)
        models = [p.tile_model for p in parts if p.tile_model is not None]
        orders = [p.order for p in parts if p.order is not None]
        return cls(parts[0].kernel, kinds, {"parts": [p.provenance for p in parts]}, quality, table,
                   fetch_ns=parts[-1].fetch_ns, tile_model=models[-1] if models else None,
                   order=orders[-1] if orders else None)

    def to_dict(self) -> dict:
        d = {
            "kernel": self.kernel,
            "kinds": {k: {"overhead_ns": c.overhead_ns, "rate": c.rate} for k, c in self.kinds.items()},
            "provenance": self.provenance,
            "quality": self.quality,
            "table": self.table,
            "fetch_ns": self.fetch_ns,
        }
        if self.tile_model is not None:
            d["tile_model"] = self.tile_model.to_dict()
        if self.order is not None:
            d["order_effect"] = self.order.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "task costs") -> TaskCosts:
        if not isinstance(d, dict):
            raise InputError(f"{source}: expected an object with 'kernel' and 'kinds', got {type(d).__name__}")
        try:
            if not isinstance(d["kernel"], str):
                raise ValueError(f"kernel must be a name such as 'moe', got {d['kernel']!r}")
            bad = [k for k in d["kinds"] if not (isinstance(k, str) and _KIND_KEY.fullmatch(k))]
            if bad:
                raise ValueError(f"kinds: {bad[0]!r} is not KIND or KIND@BMxBN... (e.g. linear1@128x128x256x64)")
            kinds = {k: KindCost(_number(v["overhead_ns"], f"kinds.{k}.overhead_ns", positive=False),
                                 _number(v["rate"], f"kinds.{k}.rate")) for k, v in d["kinds"].items()}
            table = [{"shape": str(r["shape"]), "block": str(r["block"]), "kind": str(r["kind"]),
                      "rows_per_expert": _number(r["rows_per_expert"], f"table[{i}].rows_per_expert"),
                      "median_ns": _number(r["median_ns"], f"table[{i}].median_ns"),
                      **({"elem_bytes": _elem_bytes(r["elem_bytes"], i)} if "elem_bytes" in r else {})}
                     for i, r in enumerate(d.get("table", []))]
            fetch_ns = _number(d.get("fetch_ns", 0.0), "fetch_ns", positive=False)
            model, order = d.get("tile_model"), d.get("order_effect")
            return cls(d["kernel"], kinds, dict(d.get("provenance", {})), dict(d.get("quality", {})), table,
                       fetch_ns=fetch_ns,
                       tile_model=None if model is None else TileModel.from_dict(model, f"{source}: tile_model"),
                       order=None if order is None else OrderEffect.from_dict(order, f"{source}: order_effect"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"{source}: malformed task costs ({type(exc).__name__}: {exc})") from None

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> TaskCosts:
        d = read_json(path, "task costs file")  # the checks every input file gets (xstage.results.io)
        path = Path(path)
        if not isinstance(d, dict):
            raise InputError(f"task costs file {path}: expected a JSON object with 'kernel' and 'kinds'")
        return cls.from_dict(d, f"task costs file {path}")


def _elem_bytes(v, i: int) -> int:
    if isinstance(v, bool) or v not in (1, 2, 4):
        raise ValueError(f"table[{i}].elem_bytes must be 1, 2 or 4 (bytes per operand element), got {v!r}")
    return int(v)


def _gaps_of_shapes(provenance: dict, shapes: list[str]) -> list[float]:
    """Per-run task gaps of `shapes` from a calibration's provenance (runs go shape by shape, then token
    count, then tile config: `calibrate_moe`); empty where the provenance does not list them so."""
    gaps, traced = provenance.get("task_gap_ns_per_run"), provenance.get("shapes")
    per_shape = len(provenance.get("tokens", [])) * len(provenance.get("block_specs", [None]))
    if not gaps or not traced or per_shape < 1 or len(gaps) != len(traced) * per_shape:
        return []
    return [float(g) for i, g in enumerate(gaps) if traced[i // per_shape] in shapes]


def fit_kind(works: np.ndarray, times: np.ndarray) -> KindCost:
    """Least squares `time = overhead + work / rate` (overhead clipped at 0: then a pure rate)."""
    if len(works) == 1 or np.ptp(works) == 0:
        return KindCost(0.0, float(np.mean(works / times)))
    slope, icpt = np.polyfit(works, times, 1)
    if slope <= 0:
        raise InputError("calibration: tile time does not grow with tile work; the measurement is broken")
    if icpt < 0:
        return KindCost(0.0, float(np.sum(works * works) / np.sum(works * times)))
    return KindCost(float(icpt), float(1.0 / slope))


def load_default_costs(kernel: str = "moe", dtype: str = "bf16") -> TaskCosts:
    """The embedded H200 task costs of `kernel` (measured; see `xstage/data/README`); `dtype` "fp8":
    those traced on an FP8 MoE buffer (1-byte operands, its default tiles)."""
    name = f"h200-{kernel}-task-costs.json" if dtype != "fp8" else f"h200-{kernel}-fp8-task-costs.json"
    ref = resources.files("xstage.data").joinpath(name)
    if not ref.is_file():
        raise InputError(f"no embedded task costs for kernel {kernel!r} ({name}); run `xstage plan calibrate`")
    return TaskCosts.from_dict(json.loads(ref.read_text()), name)
