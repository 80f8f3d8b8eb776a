"""Deprecated: the schedule tables moved to `xstage.spec.schedule` (data every floor agrees on).

Importing this module warns once and re-exports that module's names; `xstage.moe.make_schedule`,
`register_schedule`, `CANDIDATES` and `schedule_names` stay public without a warning.
"""

import warnings

from xstage.spec.schedule import *  # noqa: F403
from xstage.spec.schedule import (  # noqa: F401  (names tests and callers used)
    _CHOOSERS,
    _REGISTRY,
    CANDIDATES,
    DISPATCH,
    KIND_NAMES,
    LINEAR1,
    LINEAR2,
    PLANNED,
    TASK_COLS,
    PoolTooSmallError,
    Schedule,
    builtin_order,
    check_schedule,
    chooser,
    hoist_dispatch,
    make_schedule,
    per_call,
    register_schedule,
    schedule_names,
)

warnings.warn("xstage.moe.schedule moved to xstage.spec.schedule; import it from there", DeprecationWarning,
              stacklevel=2)
