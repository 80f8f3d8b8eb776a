"""Deprecated: store pacing is spelled in `xstage.spec.pacing` and resolved in `xstage.sched.pacing`.

`pacing="auto"` is the planner's decision, `xstage.sched.policy.choose_pacing`; the planner no longer
registers itself here (`register_pacing_chooser` is gone). Importing this module warns once and
re-exports the names it had; `xstage.moe.resolve_pacing` stays public without a warning.
"""

import warnings

from xstage.sched.pacing import default_pacing_of, resolve_pacing  # noqa: F401
from xstage.spec.pacing import AUTO, DEFAULT, PACED_PATHS, PACING_CANDIDATES, check_pacing  # noqa: F401

warnings.warn("xstage.moe.pacing moved: spellings to xstage.spec.pacing, resolve_pacing to xstage.sched.pacing, "
              "'auto' to xstage.sched.policy.choose_pacing", DeprecationWarning, stacklevel=2)
