"""The `xstage` command. Each capability registers its subcommands from its own `commands.py`.

A module in COMMAND_MODULES exposes `register(subparsers)`; each subcommand's handler takes the
parsed arguments and returns an exit code. User errors (`XstageError`) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from xstage import __version__
from xstage.errors import XstageError

COMMAND_MODULES = [
    "xstage.env_commands",
    "xstage.probe.commands",
    "xstage.bench.commands",
    "xstage.model.commands",
    "xstage.sched.commands",
    "xstage.demo",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xstage",
        description="Measure, model and schedule the X-Stage of remote stores in fused GPU kernels.",
    )
    parser.add_argument("--version", action="version", version=f"xstage {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def emit(payload, as_json: bool, text: str) -> None:
    """Print `text` for people or `payload` as JSON for scripts."""
    print(json.dumps(payload, indent=2, default=str) if as_json else text)


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
