"""The `xstage` command. Each capability registers its subcommands from its own `commands.py`.

Every command module exposes `register(subparsers)`; each subcommand's handler takes the parsed
arguments and returns an exit code. User errors (`XstageError`) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from xstage.cli import bench as bench_commands
from xstage.cli import demo as demo_command
from xstage.cli import env as env_commands
from xstage.cli import model as model_commands
from xstage.cli import plan as sched_commands
from xstage.cli import probe as probe_commands
from xstage.cli.bench import experts as bench_experts
from xstage.cli.bench import moe as bench_moe
from xstage.cli.bench import moe_calls as bench_moe_calls
from xstage.cli.bench import ulysses as bench_ulysses
from xstage.errors import XstageError, one_line
from xstage.version import __version__


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the command, the argument and the constraint (exit status 2);
    `-h` shows the full usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="xstage",
        description="Measure, model and schedule the X-Stage of remote stores in fused GPU kernels.",
    )
    parser.add_argument("--version", action="version", version=f"xstage {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    env_commands.register(sub)
    probe_commands.register(sub)
    bench_commands.register(sub, (bench_ulysses, bench_moe, bench_moe_calls, bench_experts))
    model_commands.register(sub)
    sched_commands.register(sub)
    demo_command.register(sub)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _missing_subcommand(parser: argparse.ArgumentParser, words: list[str]) -> int:
    """`xstage`, `xstage plan`, `xstage bench` without what to run: a usage error naming the choices."""
    for w in words:
        parser = _subcommands(parser).choices[w]
    sub = _subcommands(parser)
    try:
        parser.error(f"give a {sub.metavar}, one of {', '.join(sub.choices)}")
    except SystemExit as exc:
        return int(exc.code)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status: 0 done, 2 a user error (one line on standard error),
    1 an internal error (with its traceback), 130 interrupted."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (2), --help and --version (0): a status, also for callers in Python
        return int(exc.code or 0)
    words = [str(w) for w in (getattr(args, d, None) for d in ("command", "grid", "kernel")) if w]
    if not getattr(args, "handler", None):
        return _missing_subcommand(parser, words)
    name = " ".join(["xstage", *words])  # e.g. "xstage plan moe"
    try:
        return int(args.handler(args) or 0)
    except XstageError as exc:
        print(f"{name}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
