"""Progress of long work: a bar with an ETA on a terminal, plain periodic lines when output is
redirected, nothing when quiet (`--json`).

Example:
    >>> from xstage.results.progress import Progress
    >>> with Progress(3, "fit", quiet=True) as bar:
    ...     for _ in range(3):
    ...         bar.advance()
    >>> bar.done
    3
"""

from __future__ import annotations

import sys
import time

from xstage.results.output import is_terminal


class Progress:
    """`total` steps of work named `label`, reported on `stream` (standard error by default)."""

    def __init__(self, total: int, label: str, *, quiet: bool = False, stream=None, every_s: float = 10.0):
        self.total, self.label, self.quiet = max(0, int(total)), label, quiet
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.done = 0
        self._t0 = self._last = time.monotonic()
        self._bar = None

    def __enter__(self) -> Progress:
        if not self.quiet and is_terminal(self.stream):
            from rich.console import Console  # rich loads only where a terminal shows the bar
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                     console=Console(file=self.stream), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total)
        return self

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s or self.done >= self.total:
            self._last = now
            elapsed = now - self._t0
            eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
            print(f"{self.label}: {self.done}/{self.total} after {elapsed:.0f} s"
                  + (f", about {eta:.0f} s left" if self.done < self.total and eta == eta else ""),
                  file=self.stream, flush=True)

    def callback(self, done: int, total: int) -> None:
        """For code that reports `(done, total)`: moves the bar to `done`."""
        if total != self.total:
            self.total = total
        self.advance(done - self.done)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def say(message: str, *, quiet: bool = False, stream=None) -> None:
    """One line of news about long work (an up-front estimate, a resumed run), unless quiet."""
    if not quiet:
        print(message, file=stream if stream is not None else sys.stderr, flush=True)
