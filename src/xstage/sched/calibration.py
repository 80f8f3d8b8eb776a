"""Which measurements a decision stands on: the embedded H200 calibration, or a user's own.

A user who measured their own node (`xstage probe` and `xstage fit` for a store path's profile,
`xstage plan calibrate` for the MoE kernel's tiles, `xstage plan exchange-costs` for the Ulysses
exchanges) puts what those commands wrote in one folder:
- any number of `*profile.json` files (a `Profile`; each is keyed by the store path it names);
- `moe-task-costs.json` (BF16 tiles) and `moe-fp8-task-costs.json` (FP8 tiles);
- `h200-ulysses-exchange-costs.json` or `ulysses-exchange-costs.json` (the exchange costs).
What the folder lacks comes from the embedded calibration. A folder reaches every decision in one of
two ways: `calibration=` of `MoEBuffer`, `ulysses_attention` / `UlyssesAttention` and the policy
functions (`xstage.sched.policy`), or the setting `XSTAGE_CALIBRATION=DIR` for code that cannot pass
one (a custom op, a model's own layers). Each `Decision` names the files it used, and says it was not
validated (the library's validation covers its own calibration only).

Example:
    >>> from xstage.sched.calibration import calibration_of
    >>> calibration_of(None) is None  # without XSTAGE_CALIBRATION: the embedded calibration
    True
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from xstage.errors import InputError
from xstage.model import Profile
from xstage.sched.costs import TaskCosts
from xstage.sched.exchange import ExchangeCosts, costs_from_dict

ENV = "XSTAGE_CALIBRATION"
MOE_FILES = {"bf16": "moe-task-costs.json", "fp8": "moe-fp8-task-costs.json"}
EXCHANGE_FILES = ("h200-ulysses-exchange-costs.json", "ulysses-exchange-costs.json")


@dataclass(frozen=True)
class Calibration:
    """A user's measurements (see the module docstring); `files` maps what each part came from."""

    folder: str
    profiles: dict[str, Profile] = field(default_factory=dict)  # store path -> profile
    moe: dict[str, TaskCosts] = field(default_factory=dict)  # "bf16" / "fp8" -> tile costs
    exchange: ExchangeCosts | None = None
    files: dict[str, str] = field(default_factory=dict)  # part -> file name

    @classmethod
    def load(cls, folder) -> Calibration:
        """Read a calibration folder; a folder holding none of the files, or a file that does not read
        as its kind, is refused in one line naming it."""
        root = Path(folder)
        if not root.is_dir():
            raise InputError(f"calibration={str(folder)!r}: not a folder (it holds a user's *profile.json, "
                             f"{', '.join(MOE_FILES.values())} and exchange costs)")
        profiles, moe, files, exchange = {}, {}, {}, None
        for f in sorted(root.glob("*profile.json")):
            prof = Profile.from_dict(_json(f), str(f))
            if prof.path in profiles:
                raise InputError(f"{f}: a second profile of path {prof.path!r} (the first is {files[prof.path]})")
            profiles[prof.path], files[prof.path] = prof, f.name
        for dtype, name in MOE_FILES.items():
            if (root / name).is_file():
                moe[dtype], files[f"moe {dtype}"] = TaskCosts.from_dict(_json(root / name), str(root / name)), name
        for name in EXCHANGE_FILES:
            if (root / name).is_file() and exchange is None:
                try:
                    exchange = costs_from_dict(_json(root / name))
                except (KeyError, TypeError, ValueError) as exc:
                    raise InputError(f"{root / name}: not exchange costs ({type(exc).__name__}: {exc})") from None
                files["exchange"] = name
        if not files:
            raise InputError(f"calibration={str(folder)!r}: holds no *profile.json, {', '.join(MOE_FILES.values())} "
                             f"or {' / '.join(EXCHANGE_FILES)}")
        return cls(str(root), profiles, moe, exchange, files)

    def source(self, part: str) -> str:
        """`folder/file` of one part (a path, `moe bf16`, `moe fp8`, `exchange`)."""
        return f"{self.folder}/{self.files[part]}"


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not readable JSON ({type(exc).__name__})") from None


@functools.cache
def _loaded(folder: str) -> Calibration:
    return Calibration.load(folder)


def calibration_of(calibration) -> Calibration | None:
    """What a decision uses: `calibration` (a `Calibration`, or a folder), else the folder of the setting
    `XSTAGE_CALIBRATION`, else None: the embedded calibration. A folder is read once per process."""
    if isinstance(calibration, Calibration):
        return calibration
    if calibration is not None:
        if not isinstance(calibration, (str, os.PathLike)):
            raise InputError(f"calibration: expected a folder or a Calibration, got {type(calibration).__name__}")
        return _loaded(os.fspath(calibration))
    folder = os.environ.get(ENV, "").strip()
    return _loaded(folder) if folder else None


__all__ = ["ENV", "Calibration", "calibration_of"]
