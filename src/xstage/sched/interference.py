"""Deprecated: the interference term's calibration moved to `xstage.calibrate.interference`. Importing
this module warns; its names resolve there."""

import importlib
import warnings

warnings.warn("xstage.sched.interference moved to xstage.calibrate.interference; import it from there",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    # Resolved by name at first use: the new home is on a higher floor, which this floor does not import.
    return getattr(importlib.import_module("xstage.calibrate.interference"), name)
