"""Deprecated: moved to `xstage.cli.bench`. Importing this module warns; its names resolve there."""

import importlib
import warnings

warnings.warn("xstage.bench.commands moved to xstage.cli.bench; import it from there", DeprecationWarning,
              stacklevel=2)


def __getattr__(name: str):
    # Resolved by name at first use: the new home is on a higher floor, which this floor does not import.
    return getattr(importlib.import_module("xstage.cli.bench"), name)
