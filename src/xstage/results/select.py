"""Slicing a benchmark grid: `--only key=v1,v2` (repeatable; all filters must match)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from xstage.errors import InputError


def parse_only(specs: Sequence[str] | None) -> dict[str, set[str]]:
    """Parse `["P=2,4", "tokens=4096"]` into `{"P": {"2", "4"}, "tokens": {"4096"}}`."""
    filters: dict[str, set[str]] = {}
    for spec in specs or ():
        key, sep, values = spec.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise InputError(f"--only {spec!r}: expected KEY=VALUE[,VALUE...]")
        filters.setdefault(key, set()).update(v.strip() for v in values.split(",") if v.strip())
    return filters


def select(configs: Iterable[Mapping[str, object]], only: Sequence[str] | Mapping[str, set[str]] | None):
    """The configurations whose fields match every `--only` filter (values compared as strings)."""
    filters = only if isinstance(only, Mapping) else parse_only(only)
    configs = list(configs)
    if filters and configs:
        unknown = [k for k in filters if k not in configs[0]]
        if unknown:
            raise InputError(f"--only: unknown field(s) {unknown}; fields are {sorted(configs[0])}")
    return [c for c in configs if all(str(c[k]) in vals for k, vals in filters.items())]
