"""argparse helpers every parser of the CLI shares: `type=` functions built on the library's one
validator per kind, and the options every writing command has.

- `cli_int(lo, hi, what)` / `cli_real(...)`: the checks of `xstage.bounds.check_int` / `check_real` as
  argparse `type=` functions, reading the command line's text first (`4096`, `1e9`, `2.5`); `cli_type`
  does the same for any validator of that form. argparse names the flag in its one-line refusal.
- `path_arg`: a file or folder argument, refused when empty; `only_spec`: a `--only KEY=V1,V2` filter
  (`xstage.results.select`); `add_force_option`: `--force`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from xstage.bounds import check_int, check_real, number_from_text
from xstage.errors import InputError
from xstage.results.select import parse_spec


def cli_type(check: Callable, *args, **kw) -> Callable[[str], int | float]:
    """An argparse `type=` from a validator `check(value, arg, *args, **kw)`: the word read as a number
    (`number_from_text`), then checked; a refusal becomes argparse's one line, which names the flag."""
    def parse(text: str):
        try:
            value = number_from_text(text)
        except InputError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        try:
            return check(value, "", *args, **kw)
        except InputError as exc:  # named as typed (`1e9`, not the float it reads as)
            raise argparse.ArgumentTypeError(str(exc).replace(f"{value}", str(text).strip(), 1)) from None

    parse.__name__ = check.__name__  # what argparse would print for any other error
    return parse


def cli_int(lo: int, hi: int, what: str) -> Callable[[str], int]:
    """An argparse `type=` reading an integer in `lo..hi` (`check_int`)."""
    return cli_type(check_int, lo, hi, what)


def cli_real(lo: float, hi: float, what: str, unit: str = "", allow_inf: bool = False) -> Callable[[str], float]:
    """An argparse `type=` reading a finite number in `lo..hi` (`check_real`)."""
    return cli_type(check_real, lo, hi, what, unit, allow_inf)




def path_arg(text: str) -> str:
    """argparse `type=` of every option naming a file or folder: the path as given, refused when empty.
    An empty word (an unset shell variable, `--profile "$PROFILE"`) would otherwise mean the current
    folder, or be taken for the option's absence and its default."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError(f"{text!r}: an empty path; give a file or folder")
    return text


def add_json_option(p) -> None:
    """The `--json` option of a command whose standard output is one JSON document."""
    p.add_argument("--json", action="store_true", help="print one standard JSON document on standard output and "
                   "no progress (default: off, text for people)")


def add_force_option(p) -> None:
    """The `--force` option of every command that writes files."""
    p.add_argument("--force", action="store_true", help="also replace output files that this command did not "
                   "write, or that were changed since it wrote them; an input file is never written, even with "
                   "--force (default: refuse them, before any work)")


def only_spec(text: str) -> str:
    """argparse `type=` of `--only`: the spelling unchanged once `parse_spec` accepts it."""
    try:
        parse_spec(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--only ")) from None
    return text
