"""Path profiles: fitted Burst-Gap parameters with their evidence, stored as JSON.

Problem: a scheduler or a report needs a path's parameters together with how far to trust them
(intervals, identifiability, held-out error, cross-checks) and where they came from (GPU, driver,
software, data file). A `Profile` carries all of it; `load_default_profile("host")` returns the
embedded H200 host-link profile fitted to the reference data (`xstage fit --reference` regenerates
it, see `xstage.model.commands`).

JSON layout (`FORMAT`): `format`, `path`, `params` (PathParams fields, "inf" for no window),
`units`, `intervals` (name -> [lo, hi], bootstrap 95%), `fitted`, `identified`, `rel_se`,
`fit_quality` (`loco`: median/p90 held-out relative error; `residuals`; `cross_checks`),
`structure` (the chosen structure and the held-out error of each candidate), `provenance`
(gpu, driver, torch, triton, date, path, sm_counts, data_file, fitted_with), `classes`.

Example:
    >>> from xstage.model.profile import load_default_profile
    >>> prof = load_default_profile()
    >>> prof.path, prof.params.drain > 0
    ('host', True)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from importlib import resources
from pathlib import Path

from xstage.errors import InputError
from xstage.model.data import atomic_open
from xstage.model.params import PARAM_UNITS, PathParams
from xstage.model.predict import DEFAULT_CLASSES

FORMAT = "xstage-profile/1"
# The host default is xstage's own H200 measurement (`xstage probe --path host`); the fit to the
# independent reference run stays beside it as `h200-host-profile.json` (`load_reference_profile`).
DEFAULT_PROFILES = {"host": "h200-host-probe-profile.json", "peer": "h200-nvlink-peer-profile.json"}
REFERENCE_PROFILE = "h200-host-profile.json"


def _jsonable(x):
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return _jsonable(x.item())
    return x


@dataclasses.dataclass
class Profile:
    """One path's parameters and the evidence for them."""

    path: str
    params: PathParams
    intervals: dict = dataclasses.field(default_factory=dict)
    fitted: list = dataclasses.field(default_factory=list)
    identified: dict = dataclasses.field(default_factory=dict)
    rel_se: dict = dataclasses.field(default_factory=dict)
    fit_quality: dict = dataclasses.field(default_factory=dict)
    structure: dict = dataclasses.field(default_factory=dict)
    provenance: dict = dataclasses.field(default_factory=dict)
    classes: int = DEFAULT_CLASSES

    @property
    def sm_count(self) -> int:
        """The SM count of the GPU the profile was measured on: the largest issuing-SM count of its
        calibration, else the `(N SMs` of its GPU description."""
        counts = [int(c) for c in self.provenance.get("sm_counts") or () if str(c).isdigit()]
        if counts:
            return max(counts)
        m = re.search(r"\((\d+) SMs", str(self.provenance.get("gpu", "")))
        if m:
            return int(m.group(1))
        raise InputError(f"profile of path {self.path!r}: its provenance names no SM count (sm_counts or gpu)")

    def to_dict(self) -> dict:
        return _jsonable({
            "format": FORMAT, "path": self.path, "params": self.params.to_dict(), "units": PARAM_UNITS,
            "intervals": {k: list(v) for k, v in self.intervals.items()}, "fitted": list(self.fitted),
            "identified": self.identified, "rel_se": self.rel_se, "fit_quality": self.fit_quality,
            "structure": self.structure, "provenance": self.provenance, "classes": self.classes,
        })

    @classmethod
    def from_dict(cls, d: dict, source: str = "profile") -> Profile:
        if not isinstance(d, dict):
            raise InputError(f"{source}: a profile must be a JSON object")
        if d.get("format") != FORMAT:
            raise InputError(f"{source}: field 'format' must be {FORMAT!r}, got {d.get('format')!r}")
        for key in ("path", "params"):
            if key not in d:
                raise InputError(f"{source}: missing field {key!r}")
        try:
            params = PathParams.from_dict(d["params"])
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None
        intervals = {}
        for k, v in (d.get("intervals") or {}).items():
            if not (isinstance(v, list) and len(v) == 2):
                raise InputError(f"{source}: intervals.{k} must be [lo, hi]")
            intervals[k] = (float(v[0]), float(v[1]))
        classes = d.get("classes", DEFAULT_CLASSES)
        if not (isinstance(classes, int) and classes >= 1):
            raise InputError(f"{source}: field 'classes' must be an integer >= 1, got {classes!r}")
        return cls(path=str(d["path"]), params=params, intervals=intervals, fitted=list(d.get("fitted", [])),
                   identified=dict(d.get("identified", {})), rel_se=dict(d.get("rel_se", {})),
                   fit_quality=dict(d.get("fit_quality", {})), structure=dict(d.get("structure", {})),
                   provenance=dict(d.get("provenance", {})), classes=classes)

    @classmethod
    def load(cls, path) -> Profile:
        path = Path(path)
        if not path.is_file():
            raise InputError(f"profile {str(path)!r} does not exist")
        try:
            d = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"profile {str(path)!r} is not valid JSON: {exc}") from None
        return cls.from_dict(d, source=f"profile {str(path)!r}")

    def save(self, path) -> None:
        """Write through a temporary file and a rename: a failure leaves an existing file untouched."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        with atomic_open(path) as f:
            f.write(text)


def default_profile_path(path: str = "host") -> Path:
    if path not in DEFAULT_PROFILES:
        raise InputError(f"path: no embedded default profile for {path!r}; available: {sorted(DEFAULT_PROFILES)}")
    return Path(str(resources.files("xstage.data") / DEFAULT_PROFILES[path]))


def load_reference_profile() -> Profile:
    """The H200 host-link profile fitted to the independent reference probe run."""
    return Profile.load(Path(str(resources.files("xstage.data") / REFERENCE_PROFILE)))


def load_default_profile(path: str = "host") -> Profile:
    """The embedded profile of a path (only the H200 host link ships today)."""
    return Profile.load(default_profile_path(path))
