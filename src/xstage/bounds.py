"""Numbers and argument types from users: one validator per kind, for the API and the command line alike.

- `check_int(value, arg, lo, hi, what)`: an integer in `lo..hi`. Python and numpy integers pass; a
  float passes only when it is exactly an integer (`2e9` for `2_000_000_000`); bools, strings, NaN
  and fractions are refused.
- `check_real(value, arg, lo, hi, what, unit)`: a finite real number in `lo..hi` (`inf` only where
  `allow_inf` says so, for windows without a bound).
- `check_instance(value, arg, types, what)` / `check_sequence(value, arg, item_types, what)`: an
  argument of the API that must be an object of a type, or a list of them (strings, configurations).
- `number_from_text(text)`: the number a command-line word spells; the command line's `type=`
  functions built on these validators are `xstage.cli.args` (`cli_int`, `cli_real`, `cli_type`).

Every refusal is one line that names the argument, the value and the bound, with what the number
means: `timeout_ns=nan: must be an integer in 1..3600000000000 (progress watchdog of device waits, in
ns)`, or from the command line `argument --ctas: 99999999: must be an integer in 1..16384 (persistent
CTAs the planner simulates)`.
`INT64_MAX` is the ceiling of every integer bound: the kernels, numpy and torch keep counts in int64.

Bounds shared by several floors live here too (`MAX_SMS`, `MAX_RANKS`); a bound that only one module
needs stays in that module, next to the reason for its value.

Example:
    >>> from xstage.bounds import check_int, check_real
    >>> check_int(2e9, "timeout_ns", 1, 10**12, "progress watchdog in ns")
    2000000000
    >>> check_real(50e9, "rate", 1e9, 1e13, "pacing rate", "B/s")
    50000000000.0
"""

from __future__ import annotations

import math
import numbers

from xstage.errors import InputError

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
# SMs of one GPU (an H200 has 132, a B200 148): bounds SM counts and the CTAs planned on them.
MAX_SMS = 4096
# Worker processes and bootstrap rounds of the command line's fits and simulations.
MAX_WORKERS = 256
MAX_BOOTSTRAP = 10_000
# Ranks of one group. NVLink domains reach 72 GPUs (NVL72) and expert-parallel groups a few hundred;
# a loopback rank holds a copy of every buffer of the context, and error words name a peer in 16 bits.
MAX_RANKS = 1024
# Bits of a rank in a device error word (`xstage.comm.stages`): a group holds at most 2^16 - 1 ranks.
PEER_BITS = 16


def label(arg: str, value) -> str:
    """`--ctas 7` for a flag, `timeout_ns=nan` for a keyword, `7` without a name (argparse adds it)."""
    if not arg:
        return f"{value}"
    return f"{arg} {value}" if arg.startswith("-") else f"{arg}={value!r}"


def _bound(lo, hi, unit: str = "") -> str:
    def fmt(v):
        return f"{v:g}" if isinstance(v, float) else f"{v}"

    return f"{fmt(lo)}..{fmt(hi)}" + (f" {unit}" if unit else "")


def check_int(value, arg: str, lo: int, hi: int, what: str) -> int:
    """`value` as an int in `lo..hi` (see the module docstring); else `InputError` naming `arg`."""
    if not (-INT64_MAX - 1 <= lo <= hi <= INT64_MAX):
        raise ValueError(f"check_int bounds {lo}..{hi}: must lie within int64")
    n = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        n = int(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
            and float(value).is_integer():
        n = int(value)
    if n is None or not lo <= n <= hi:
        raise InputError(f"{label(arg, value)}: must be an integer in {_bound(lo, hi)} ({what})")
    return n


def check_real(value, arg: str, lo: float, hi: float, what: str, unit: str = "", allow_inf: bool = False) -> float:
    """`value` as a float in `lo..hi` (finite, or `inf` where `allow_inf`); else `InputError` naming `arg`."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    v = float(value) if ok else math.nan
    if not ((lo <= v <= hi) or (allow_inf and v == math.inf)):
        also = " or inf" if allow_inf else ""
        raise InputError(f"{label(arg, value)}: must be a finite number in {_bound(lo, hi, unit)}{also} ({what})")
    return v


def check_instance(value, arg: str, types, what: str):
    """`value` if it is an instance of `types` (a type or a tuple of them); else `InputError` naming
    `arg`, what it must be and the type it is (not the value: an object's repr can run to pages)."""
    if not isinstance(value, types):
        raise InputError(f"{arg}: must be {what}, got {type(value).__name__}")
    return value


def check_sequence(value, arg: str, item_types, what: str) -> list:
    """`value` as a list if it is a sequence (a list, tuple or other iterable, not a string, mapping or
    tensor) of `item_types`; else `InputError` naming `arg` and the item that is not."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__") or hasattr(value, "dtype"):
        raise InputError(f"{arg}: must be a list of {what}, got {type(value).__name__}")
    items = list(value)
    for i, v in enumerate(items):
        if not isinstance(v, item_types) or isinstance(v, bool) and bool not in _tuple(item_types):
            raise InputError(f"{arg}[{i}]={v!r}: must be {what}")
    return items


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def number_from_text(text: str, arg: str = "") -> int | float:
    """The number a command-line word spells: `4096` -> 4096, `1e9` / `2.5` / `inf` -> float."""
    word = str(text).strip()
    try:
        return int(word)
    except ValueError:
        pass
    try:
        return float(word)
    except ValueError:
        raise InputError(f"{label(arg, repr(str(text)))}: not a number") from None


