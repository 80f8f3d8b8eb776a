"""Markdown tables for benchmark summaries."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def _cell(value: object, floatfmt: str) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else format(value, floatfmt)
    return str(value)


def markdown_table(rows: Sequence[Mapping[str, object]], columns: Sequence[str], floatfmt: str = ".3g") -> str:
    """A GitHub-flavoured markdown table of `columns` over `rows` (missing cells print as '-')."""
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_cell(r.get(c, "-"), floatfmt) for c in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])
