"""Benchmark basics shared by every grid: resumable long-format CSV results, slicing, timing, plots.

- `ResultWriter`: appends rows (with environment columns) to a CSV, skips keys already written.
- `select` / `parse_only`: the `--only key=v1,v2` filter that runs a slice of a grid.
- `time_device`: warm-up + median of repeated device-event timings.
- `plots`: line and bar charts drawn from result rows; `markdown_table` for summaries.
"""

from xstage.bench.grid import parse_only, select
from xstage.bench.report import markdown_table
from xstage.bench.results import ENV_COLUMNS, ResultWriter, read_rows
from xstage.bench.timing import Timing, time_device

__all__ = [
    "ENV_COLUMNS",
    "ResultWriter",
    "Timing",
    "markdown_table",
    "parse_only",
    "read_rows",
    "select",
    "time_device",
]
