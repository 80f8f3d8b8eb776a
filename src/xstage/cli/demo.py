"""`xstage demo`: the parser of the main job (the job itself: `xstage.demo.run_demo`)."""

from __future__ import annotations

from xstage.cli.args import add_force_option, path_arg
from xstage.demo import DEMO_FILES, run_demo


def register(sub) -> None:
    p = sub.add_parser("demo", help="the default profile: parameters, held-out error, predictions, a plan, plots")
    p.add_argument("-o", "--out", default="xstage-demo", type=path_arg, metavar="DIR",
                   help=f"output folder, created if missing; "
                   f"writes {', '.join(DEMO_FILES)} in it, replacing only files that xstage demo wrote "
                   "(default: ./xstage-demo)")
    add_force_option(p)
    p.add_argument("--json", action="store_true", help="print one standard JSON document on standard output and "
                   "no progress (default: off, text for people)")
    p.set_defaults(handler=run_demo)
