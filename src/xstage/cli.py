"""The `xstage` command. Each capability registers its subcommands from its own `commands.py`.

Every command module exposes `register(subparsers)`; each subcommand's handler takes the parsed
arguments and returns an exit code. User errors (`XstageError`) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from xstage import demo, env_commands
from xstage.bench import commands as bench_commands
from xstage.bench import moe as bench_moe
from xstage.bench import ulysses as bench_ulysses
from xstage.errors import XstageError
from xstage.model import commands as model_commands
from xstage.probe import commands as probe_commands
from xstage.sched import commands as sched_commands
from xstage.version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xstage",
        description="Measure, model and schedule the X-Stage of remote stores in fused GPU kernels.",
    )
    parser.add_argument("--version", action="version", version=f"xstage {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    env_commands.register(sub)
    probe_commands.register(sub)
    bench_commands.register(sub, (bench_ulysses, bench_moe))
    model_commands.register(sub)
    sched_commands.register(sub)
    demo.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 1
    try:
        return int(args.handler(args) or 0)
    except XstageError as exc:
        print(f"xstage {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"xstage {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
