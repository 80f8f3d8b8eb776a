"""Slicing a grid or a results file: `--only KEY=V1,V2` (repeatable; all filters must match).

The one parser of `--only` for every command: `parse_spec` checks one spelling (the command line's
`type=` is `xstage.cli.args.only_spec`), `parse_only` turns the spellings into filters, `select`
applies them.
A spelling is `KEY=V1[,V2...]`: one `=`, a KEY of letters, digits and `_`, and values without `=`,
spaces or empty items. A filter on a field the configurations lack, or one that leaves nothing
selected, is refused as well: a typo never runs an empty slice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from xstage.bounds import check_sequence
from xstage.errors import InputError

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_VALUE = re.compile(r"[^=,\s]+")
SPELLING = "KEY=V1[,V2...], e.g. tokens=4096,8192"


def _in_order(value: str) -> tuple:
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """`"P=2,4"` -> `("P", ["2", "4"])`; `InputError` naming `--only` and the spelling otherwise."""
    key, sep, values = str(spec).partition("=")
    key = key.strip()
    items = [v.strip() for v in values.split(",")]
    if not sep or not _KEY.fullmatch(key):
        raise InputError(f"--only {spec!r}: expected {SPELLING}")
    bad = [v for v in items if not _VALUE.fullmatch(v)]
    if bad:
        what = "an empty value" if "" in bad else f"the value {bad[0]!r}"
        raise InputError(f"--only {spec!r}: {what} (values hold no '=', ',' or spaces); expected {SPELLING}")
    return key, items


def parse_only(specs: Sequence[str] | None) -> dict[str, set[str]]:
    """Parse `["P=2,4", "tokens=4096"]` into `{"P": {"2", "4"}, "tokens": {"4096"}}`; a key given
    twice keeps the values of both."""
    filters: dict[str, set[str]] = {}
    for spec in check_sequence(specs if specs is not None else (), "--only", str, "KEY=V1,V2 spellings"):
        key, values = parse_spec(spec)
        filters.setdefault(key, set()).update(values)
    return filters


def select(configs: Iterable[Mapping[str, object]], only: Sequence[str] | Mapping[str, set[str]] | None):
    """The configurations whose fields match every `--only` filter (values compared as strings).
    Refuses a field no configuration has, and filters that select none of them."""
    filters = only if isinstance(only, Mapping) else parse_only(only)
    configs = check_sequence(configs, "configs", Mapping, "configurations (mappings of field to value)")
    if not filters or not configs:
        return configs
    fields = sorted({k for c in configs for k in c})
    unknown = [k for k in filters if k not in fields]
    if unknown:
        raise InputError(f"--only: unknown field(s) {unknown}; fields are {fields}")
    chosen = [c for c in configs if all(str(c.get(k, "")) in vals for k, vals in filters.items())]
    if not chosen:
        spelled = " ".join(f"{k}={','.join(sorted(v))}" for k, v in filters.items())
        seen = {k: sorted({str(c.get(k, "")) for c in configs}, key=_in_order) for k in filters}
        hint = "; ".join(f"{k} is one of {', '.join(v[:12])}{', ...' if len(v) > 12 else ''}" for k, v in seen.items())
        raise InputError(f"--only {spelled}: selects none of the {len(configs)} ({hint})")
    return chosen
