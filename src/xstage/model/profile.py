"""Path profiles: fitted Burst-Gap parameters with their evidence, stored as JSON.

Problem: a scheduler or a report needs a path's parameters together with how far to trust them
(intervals, identifiability, held-out error, cross-checks) and where they came from (GPU, driver,
software, data file). A `Profile` carries all of it; `load_default_profile("host")` returns the
embedded H200 host-link profile of xstage's own probe, `load_reference_profile()` the one fitted to
the reference data (the command that regenerates it is in `xstage.cli.model`).

`Profile.load` / `Profile.from_dict` are the one validated loader of profiles: every field is
checked, and a malformed one raises `InputError` naming the file and the field.

JSON layout (`FORMAT`): `format`, `path` (hbm, host or peer), `params` (PathParams fields, "inf" for
no window), `units`, `intervals` (name -> [lo, hi]), `interval_method`, `interval_level` (0.95, or
null when too few bootstrap rounds made them), `bootstrap_rounds`, `intervals_widened` (see
`xstage.model.intervals`), `fitted`, `identified`, `rel_se`, `fit_quality` (`loco`: median/p90
held-out relative error; `heldout`; `residuals`; `cross_checks`), `structure` (the chosen structure
and the held-out error of each candidate), `provenance` (gpu, driver, torch, triton, date, path,
sm_counts, data_file, fitted_with), `classes`.

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
from xstage.model import intervals as iv
from xstage.model.params import PARAM_NAMES, PARAM_UNITS, PathParams
from xstage.model.predict import DEFAULT_CLASSES
from xstage.results.io import atomic_open, read_json
from xstage.results.output import jsonable

FORMAT = "xstage-profile/1"
PATHS = ("hbm", "host", "peer")
# The host default is xstage's own H200 measurement (`xstage probe --path host`); the fit to the
# independent reference run stays beside it as `h200-host-profile.json` (`load_reference_profile`).
DEFAULT_PROFILES = {"host": "h200-host-probe-profile.json", "peer": "h200-nvlink-peer-profile.json"}
REFERENCE_PROFILE = "h200-host-profile.json"
FIELDS = ("format", "path", "params", "units", "intervals", "interval_method", "interval_level", "bootstrap_rounds",
          "intervals_widened", "fitted", "identified", "rel_se", "fit_quality", "structure", "provenance",
          "classes")


def _number(v, allow_inf: bool = True) -> float | None:
    """`v` as a float if it is a JSON number (or "inf"/"-inf" when allowed), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        v = float(v)
        return v if (math.isfinite(v) or allow_inf) and not math.isnan(v) else None
    if allow_inf and v in ("inf", "-inf"):
        return float(v)
    return None


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
    interval_method: str = ""
    interval_level: float | None = None
    bootstrap_rounds: int | None = None
    intervals_widened: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        # Intervals contain their point estimates (widened where a percentile interval did not), and
        # say how they were made; a profile built without saying (older files, callers that pass only
        # the intervals) takes the rounds from its provenance.
        widened = set(self.intervals_widened)
        fixed = {}
        for name, (lo, hi) in self.intervals.items():
            v = getattr(self.params, name, None)
            lo, hi = float(lo), float(hi)
            if isinstance(v, float) and math.isfinite(v) and not lo <= v <= hi:
                lo, hi = min(lo, v), max(hi, v)
                widened.add(name)
            fixed[name] = (lo, hi)
        self.intervals = fixed
        if self.bootstrap_rounds is None:
            fw = self.provenance.get("fitted_with") if isinstance(self.provenance, dict) else None
            rounds = fw.get("bootstrap_rounds") if isinstance(fw, dict) else None
            if isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 0:
                self.bootstrap_rounds = rounds
        if not self.interval_method or sorted(widened) != sorted(self.intervals_widened):
            if self.intervals and self.bootstrap_rounds:
                info = iv.describe(self.bootstrap_rounds, widened)
                self.interval_method, self.interval_level = info["interval_method"], info["interval_level"]
            elif self.intervals:
                self.interval_method = self.interval_method or "unknown (the profile does not say)"
                self.interval_level = None
            else:
                self.interval_method, self.interval_level = "none (no intervals)", None
        self.intervals_widened = sorted(widened)
        if self.bootstrap_rounds is not None and self.bootstrap_rounds < iv.MIN_BOOTSTRAP_ROUNDS:
            self.interval_level = None  # never called a 95% interval, whatever a file says

    @property
    def interval_label(self) -> str:
        """'95%' for intervals that deserve the name, else e.g. '3-round range'."""
        return iv.label(self.interval_level, self.bootstrap_rounds)

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
        return jsonable({
            "format": FORMAT, "path": self.path, "params": self.params.to_dict(), "units": PARAM_UNITS,
            "intervals": {k: list(v) for k, v in self.intervals.items()},
            "interval_method": self.interval_method, "interval_level": self.interval_level,
            "bootstrap_rounds": self.bootstrap_rounds, "intervals_widened": list(self.intervals_widened),
            "fitted": list(self.fitted), "identified": self.identified, "rel_se": self.rel_se,
            "fit_quality": self.fit_quality, "structure": self.structure, "provenance": self.provenance,
            "classes": self.classes,
        })

    @classmethod
    def from_dict(cls, d: dict, source: str = "profile") -> Profile:
        """A validated profile; any malformed field raises `InputError` naming `source` and the field."""

        def bad(field: str, constraint: str, got) -> InputError:
            text = repr(got)
            if len(text) > 80:
                text = text[:77] + "..."
            return InputError(f"{source}: field {field!r} must be {constraint}, got {text}")

        if not isinstance(d, dict):
            raise InputError(f"{source}: a profile must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(FIELDS))
        if unknown:
            raise InputError(f"{source}: unknown field(s) {unknown}; known: {list(FIELDS)}")
        if d.get("format") != FORMAT:
            raise bad("format", repr(FORMAT), d.get("format"))
        for key in ("path", "params"):
            if key not in d:
                raise InputError(f"{source}: missing field {key!r}")
        if d["path"] not in PATHS:
            raise bad("path", f"one of {', '.join(PATHS)}", d["path"])
        if not isinstance(d["params"], dict):
            raise bad("params", "an object of parameters", d["params"])
        for k, v in d["params"].items():
            if k in PARAM_NAMES and _number(v) is None:
                raise bad(f"params.{k}", "a number or 'inf'", v)
        try:
            params = PathParams.from_dict(d["params"])
        except InputError as exc:
            raise InputError(f"{source}: field 'params': {exc}") from None

        def mapping(key: str) -> dict:
            v = d.get(key, {})
            if v is None:
                return {}
            if not isinstance(v, dict):
                raise bad(key, "an object", v)
            return v

        def param_key(field: str, k) -> None:
            if k not in PARAM_NAMES:
                raise InputError(f"{source}: field {field!r} names unknown parameter {k!r}; known: {list(PARAM_NAMES)}")

        mapping("units")
        intervals = {}
        for k, v in mapping("intervals").items():
            param_key("intervals", k)
            lo, hi = (_number(v[0]), _number(v[1])) if isinstance(v, list) and len(v) == 2 else (None, None)
            if lo is None or hi is None or not lo <= hi:
                raise bad(f"intervals.{k}", "[lo, hi], two numbers with lo <= hi", v)
            intervals[k] = (lo, hi)
        method = d.get("interval_method", "")
        if not isinstance(method, str):
            raise bad("interval_method", "a string", method)
        level = d.get("interval_level")
        if level is not None and (_number(level, False) is None or not 0 < level < 1):
            raise bad("interval_level", "a probability between 0 and 1, or null", level)
        rounds = d.get("bootstrap_rounds")
        if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0):
            raise bad("bootstrap_rounds", "an integer >= 0, or null", rounds)
        widened = d.get("intervals_widened", [])
        if not isinstance(widened, list):
            raise bad("intervals_widened", "a list of parameter names", widened)
        for k in widened:
            param_key("intervals_widened", k)
        fitted = d.get("fitted", [])
        if not isinstance(fitted, list):
            raise bad("fitted", "a list of parameter names", fitted)
        for k in fitted:
            param_key("fitted", k)
        identified = mapping("identified")
        for k, v in identified.items():
            param_key("identified", k)
            if not isinstance(v, bool):
                raise bad(f"identified.{k}", "true or false", v)
        rel_se = mapping("rel_se")
        for k, v in rel_se.items():
            param_key("rel_se", k)
            if v is not None and _number(v) is None:
                raise bad(f"rel_se.{k}", "a number, 'inf' or null", v)
        quality = mapping("fit_quality")
        for key in ("residuals", "cross_checks", "loco", "heldout"):
            q = quality.get(key)
            if q is not None and not isinstance(q, dict):
                raise bad(f"fit_quality.{key}", "an object", q)
        for key in ("loco", "heldout"):
            for stat in ("median_rel_error", "p90_rel_error"):
                q = quality.get(key) or {}
                if stat in q and q[stat] is not None and _number(q[stat], False) is None:
                    raise bad(f"fit_quality.{key}.{stat}", "a number", q[stat])
        structure = mapping("structure")
        provenance = mapping("provenance")
        counts = provenance.get("sm_counts")
        if counts is not None and not (isinstance(counts, list) and all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts)):
            raise bad("provenance.sm_counts", "a list of integers >= 1", counts)
        if "fitted_with" in provenance and not isinstance(provenance["fitted_with"], dict):
            raise bad("provenance.fitted_with", "an object", provenance["fitted_with"])
        classes = d.get("classes", DEFAULT_CLASSES)
        if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
            raise bad("classes", "an integer >= 1", classes)
        return cls(path=d["path"], params=params, intervals=intervals, fitted=list(fitted),
                   identified=dict(identified), rel_se={k: _number(v) if v is not None else None
                                                        for k, v in rel_se.items()},
                   fit_quality=dict(quality), structure=dict(structure), provenance=dict(provenance),
                   classes=classes, interval_method=method, interval_level=level, bootstrap_rounds=rounds,
                   intervals_widened=list(widened))

    @classmethod
    def load(cls, path) -> Profile:
        """Read (`xstage.results.io.read_json`: a folder, FIFO, compressed or non-UTF-8 file, invalid JSON
        and NaN are refused) and validate (`from_dict`) a profile JSON file; errors name the file and the
        field."""
        d = read_json(path, "profile")
        return cls.from_dict(d, source=f"profile {str(Path(path))!r}")

    def save(self, path) -> None:
        """Write through a temporary file and a rename: a failure leaves an existing file untouched."""
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
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
