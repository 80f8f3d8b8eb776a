"""Which kernel a transformers experts call runs: xstage's fused layer or transformers' `grouped_mm` chain.

The fused layer is not faster everywhere: on one H100 (`benchmarks/results/h100-experts-backend/`), with
eight experts of width 14336 (Mixtral) it is 0.70-0.79x `grouped_mm` from 4096 tokens, and where an
eager call is bound by its host time (OLMoE at 8-64 tokens) it is 0.77-0.80x. The integration asks
`xstage.sched.policy.choose_experts` per call; this module holds what that decision stands on.

Model: the measured call times themselves (`ExpertsCalls`), per GPU, dtype and shape (`H-I-E-K`), kernel
(`fused`, `grouped_mm`) and mode (`eager`: back-to-back calls; `graph`: replayed from a CUDA graph), each
the geometric mean over the measured routings (uniform and skewed) at a token count. Between two
measured token counts a time is interpolated linearly in log(time) against log(tokens); below the
smallest it is the smallest's, above the largest it grows in proportion to the tokens. A shape, dtype or
GPU without measurements has no prediction: the decision is the fused layer, and says why.

The data is a fit of an `xstage bench experts` CSV (`xstage.calibrate.experts.fit_experts_calls`) that
`xstage/data/experts-calls.json` ships (a test holds it equal to a fresh fit of the committed CSV).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from importlib import resources

from xstage.errors import InputError
from xstage.results.io import read_json

KERNELS = ("fused", "grouped_mm")
MODES = ("eager", "graph")
DATA_JSON = "experts-calls.json"
FORMAT = "xstage-experts-calls/1"


@dataclass(frozen=True)
class ExpertsCalls:
    """Measured call times (ns) by (gpu, dtype, shape, kernel, mode): sorted `(tokens, ns)` points;
    `margin`: how much faster `grouped_mm` must be predicted before it is chosen (the fused layer is
    the default: noise must not flip it); `source`: where the rows came from."""

    points: dict
    margin: float
    source: str

    def predict(self, gpu: str, dtype: str, shape: str, kernel: str, mode: str, tokens: int) -> float | None:
        pts = self.points.get((gpu, dtype, shape, kernel, mode))
        return None if not pts else interpolate(pts, tokens)

    def gpus(self) -> list[str]:
        return sorted({k[0] for k in self.points})

    @classmethod
    def from_dict(cls, doc, where: str) -> ExpertsCalls:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise InputError(f"{where}: not an experts-calls file (format {FORMAT!r})")
        margin = doc.get("margin")
        if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise InputError(f"{where}: margin must be a number in [0, 1), got {margin!r}")
        points: dict = {}
        for i, r in enumerate(doc.get("rows") or []):
            at = f"{where}, rows[{i}]"
            if not isinstance(r, dict):
                raise InputError(f"{at}: not an object")
            key = tuple(r.get(k) for k in ("gpu", "dtype", "shape", "kernel", "mode"))
            if not all(isinstance(k, str) and k for k in key) or key[3] not in KERNELS or key[4] not in MODES:
                raise InputError(f"{at}: gpu, dtype, shape, kernel ({', '.join(KERNELS)}) and mode "
                                 f"({', '.join(MODES)}) must be given")
            t, ns = r.get("tokens"), r.get("ns")
            if not isinstance(t, int) or isinstance(t, bool) or t < 1 or not isinstance(ns, (int, float)) \
                    or not math.isfinite(ns) or ns <= 0:
                raise InputError(f"{at}: tokens must be an integer >= 1 and ns a finite time > 0")
            points.setdefault(key, []).append((t, float(ns)))
        for key, pts in points.items():
            pts.sort()
            if len({t for t, _ in pts}) != len(pts):
                raise InputError(f"{where}: {'/'.join(key)} lists a token count twice")
        return cls(points, float(margin), str(doc.get("source", where)))


def interpolate(points: list[tuple[int, float]], tokens: int) -> float:
    """The time at `tokens` from sorted `(tokens, ns)` points (module docstring)."""
    ts = [t for t, _ in points]
    if tokens <= ts[0]:
        return points[0][1]
    if tokens >= ts[-1]:
        return points[-1][1] * tokens / ts[-1]
    j = bisect.bisect_left(ts, tokens)
    (t0, a), (t1, b) = points[j - 1], points[j]
    f = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
    return math.exp(math.log(a) + f * (math.log(b) - math.log(a)))


_DEFAULT: list[ExpertsCalls] = []


def default_experts_calls() -> ExpertsCalls:
    """The embedded measurements (`xstage/data/experts-calls.json`), read once per process."""
    if not _DEFAULT:
        path = resources.files("xstage.data").joinpath(DATA_JSON)
        _DEFAULT.append(ExpertsCalls.from_dict(read_json(path, "experts-calls file"), DATA_JSON))
    return _DEFAULT[0]


def load_experts_calls(path) -> ExpertsCalls:
    """An experts-calls file a user fitted (`xstage bench experts` writes one beside its summary)."""
    return ExpertsCalls.from_dict(read_json(path, "experts-calls file"), str(path))
