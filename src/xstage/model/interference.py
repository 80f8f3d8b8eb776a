"""Store/compute interference: loads slow down while a store path's shared level is full.

Problem: on the H200 host link, once enough stores wait in the fabric for the link, the loads of
*every* SM queue behind them, storing or not, so the tiles of a fused kernel compute slower beside
its own combine stores. The Burst-Gap parameters (`PathParams`) describe the stores only; this term
describes what they do to compute.

Model (played by `xstage.sched.simulate_kernel`): the fabric holds the bytes of the bursts in flight,
each SM at most `window_bytes` of its burst (the path's per-SM window `c_sm`), the whole path at most
its shared capacity (a paced kernel: its pacing budget). While that occupancy is at least
`onset_bytes`, a task whose time is bound by memory loads for a share `m` (`Task.mem_share`, 0 for
compute or L2-resident tiles, 1 for tiles that stream their operands from HBM) computes at rate
1 / (1 + `per_storer` x k x m), k being the number of CTAs with a burst in the fabric. Below the
onset the term is off: the SMs' own windows absorb the bursts and loads keep their speed.

Calibration (`xstage.calibrate.interference`): `onset_bytes` from the bystander benchmark (readers keep
their speed beside 8 storing SMs, not beside 16), `per_storer` from the fused MoE kernel's tiles
beside a store kernel that saturates the link.

Unpaced, the link also carries less: `unpaced_drain` (bytes per second, 0 for the path's own drain) is
the rate the host link sustains when many CTAs send tile-sized bursts of scattered rows without
pacing (`benchmarks/experiments/tiles_beside_tile_stores.py`: 40-47 GB/s where the probe's contiguous
bursts drain at 55 GB/s, and paced ones keep 46-48). `xstage.sched.moe.remote_path` gives an unpaced
kernel's store path that drain.

What the term still misses: `unpaced_bias` is the measured ratio of an unpaced kernel's time to its
paced twin's over the same ratio predicted (geometric mean). A planner comparing paced with unpaced
candidates multiplies the unpaced predictions by it (`xstage.sched.plan.rank_ns`); 1 means none.

Example:
    >>> from xstage.model.interference import Interference
    >>> i = Interference(per_storer=0.25, onset_bytes=2e6, window_bytes=150e3)
    >>> i.active(i.occupancy([1 << 20] * 16, capacity=4.7e6)), round(i.stretch(16, 1.0), 2)
    (True, 4.0)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from importlib import resources

from xstage.errors import InputError


@dataclass(frozen=True)
class Interference:
    """How a full store path slows the compute of tasks that load memory (see the module docstring)."""

    per_storer: float
    onset_bytes: float
    window_bytes: float
    unpaced_bias: float = 1.0
    unpaced_drain: float = 0.0
    provenance: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for name in ("per_storer", "onset_bytes", "window_bytes", "unpaced_bias", "unpaced_drain"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InputError(f"Interference.{name}={v!r}: must be a finite number >= 0")

    def occupancy(self, bursts: Iterable[float], capacity: float) -> float:
        """Bytes in the fabric while bursts of these sizes are in flight on a path of `capacity` bytes."""
        return min(capacity, sum(min(b, self.window_bytes) for b in bursts))

    def active(self, occupancy: float) -> bool:
        return occupancy >= self.onset_bytes

    def stretch(self, storing: int, mem_share: float) -> float:
        """Extra time per unit of a task's own time while active (its rate is 1 / (1 + stretch))."""
        return self.per_storer * storing * mem_share

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d, source: str = "interference") -> Interference:
        if not isinstance(d, dict):
            raise InputError(f"{source}: expected a JSON object with per_storer, onset_bytes, window_bytes")
        missing = [k for k in ("per_storer", "onset_bytes", "window_bytes") if k not in d]
        if missing:
            raise InputError(f"{source}: missing {missing}")
        prov = d.get("provenance", {})
        if not isinstance(prov, dict):
            raise InputError(f"{source}: provenance must be an object")
        return cls(d["per_storer"], d["onset_bytes"], d["window_bytes"], d.get("unpaced_bias", 1.0),
                   d.get("unpaced_drain", 0.0), prov)


def load_default_interference(path: str) -> Interference | None:
    """The embedded H200 calibration of `path` (`xstage/data/h200-<path>-interference.json`), or None
    where none was measured (the term is then off: `hbm` has no slow link to fill, `peer` is
    not measured yet)."""
    ref = resources.files("xstage.data").joinpath(f"h200-{path}-interference.json")
    if not ref.is_file():
        return None
    return Interference.from_dict(json.loads(ref.read_text()), ref.name)
