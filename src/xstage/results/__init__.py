"""The ground floor of results: I/O, slicing, timing and statistics, tables, plots and output.

- `ResultWriter` / `read_rows`: resumable long-format CSV with provenance columns on every row.
- `select` / `parse_only`: the `--only key=v1,v2` filter that runs a slice of a grid.
- `Timing`, `timing_summary`, `geomean`: the statistics every report uses (median, p10, p90).
- `time_device`, `events`: warm-up + median of repeated device-event timings (host clock on CPU).
- `markdown_table`, `plot_lines`, `plot_bars`: summaries drawn from result rows.
- `emit`: text for people or standard JSON for scripts.
"""

from xstage.results.io import ENV_COLUMNS, ResultWriter, read_rows
from xstage.results.output import emit
from xstage.results.select import parse_only, select
from xstage.results.stats import Timing, geomean, timing_summary
from xstage.results.tables import markdown_table
from xstage.results.timing import events, synchronize, time_device

__all__ = [
    "ENV_COLUMNS", "ResultWriter", "Timing", "emit", "events", "geomean", "markdown_table", "parse_only",
    "read_rows", "select", "synchronize", "time_device", "timing_summary",
]
