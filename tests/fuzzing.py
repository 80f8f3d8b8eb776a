"""What the property-based tests of malformed input (`tests/test_fuzz_*.py`) share: a watchdog that
fails a hang, a snapshot of a folder (names, types, sizes, modification times, contents), the command
line run in-process with its outcome, and the checks of the properties.

The CLI property for a malformed input: exit status 2, exactly one line on standard error
(`xstage ...: error: ...`), nothing on standard output, no traceback, nothing written or changed in
the folder, and no run past `WATCHDOG_S`. Where an input may be harmless, the command may also exit 0:
then no input changed and every number its JSON reports where the unmutated input gave a number is
still a finite number (never NaN or an infinity passed on).
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import io
import json
import math
import os
import signal
import stat
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

from hypothesis import settings

from xstage.cli import main

# One example's time limit: a refusal takes milliseconds, and a harmless input's whole command (small
# files, plots included) well under a second once warm. Past this, the example is a hang.
WATCHDOG_S = 8.0


def examples(n: int) -> settings:
    """Settings for `n` examples under the `ci` profile (the loaded profile's `max_examples` / 100
    times `n`: ten times as many under `dev`)."""
    return settings(max_examples=max(1, n * settings.default.max_examples // 100))


class Hang(BaseException):
    """Raised by the watchdog; a BaseException, so that no `except Exception` of the code swallows it."""


@contextlib.contextmanager
def watchdog(what: str, seconds: float = WATCHDOG_S):
    """Fail with `Hang` when the block runs past `seconds`; should the block be stuck where Python
    cannot raise (a blocking call in C), the process dumps its stacks and exits after a longer wait,
    so a hang fails the run instead of stalling it."""

    def alarm(signum, frame):
        raise Hang(f"{what}: still running after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(10 * seconds, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        faulthandler.cancel_dump_traceback_later()


def snapshot(root) -> dict:
    """Every entry under `root`: its type, size, modification time and, for a regular file, the hash
    of its bytes (FIFOs and other special files are never opened)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            digest = None
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return out


@dataclass
class Outcome:
    argv: list[str]
    code: int | None
    out: str
    err: str
    raised: str = ""  # the traceback of an exception that escaped `main`
    warned: tuple[str, ...] = ()  # numpy's warnings of NaN or infinities computed

    def __str__(self) -> str:
        return (f"xstage {' '.join(self.argv)}\n  exit {self.code}\n  stderr {self.err[-1500:]!r}\n"
                f"  stdout {self.out[-300:]!r}" + (f"\n  raised {self.raised[-2500:]}" if self.raised else "")
                + (f"\n  warnings {self.warned}" if self.warned else ""))


_NUMERIC_WARNINGS = ("invalid value", "divide by zero", "overflow")


def run_cli(argv: list[str], cwd=None) -> Outcome:
    """`xstage argv` in this process, under the watchdog, its output captured; in folder `cwd` when
    given (relative paths, and an empty one, land there)."""
    out, err = io.StringIO(), io.StringIO()
    code, raised = None, ""
    here = os.getcwd()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if cwd is not None:
                os.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), watchdog(f"xstage {argv}"):
                code = main(argv)
        except Exception:  # noqa: BLE001 - an escaping exception is what these tests look for
            raised = traceback.format_exc()
        finally:
            os.chdir(here)
    warned = tuple(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                   and any(s in str(w.message) for s in _NUMERIC_WARNINGS))
    return Outcome([str(a) for a in argv], code, out.getvalue(), err.getvalue(), raised, warned)


def one_line_refusal(o: Outcome) -> str | None:
    """Why `o` is not a one-line refusal (exit 2, one `xstage ...: error: ...` line on standard error,
    nothing on standard output, no traceback); None when it is."""
    lines = [line for line in o.err.splitlines() if line.strip()]
    if o.raised or o.code != 2:
        return "not exit 2"
    if len(lines) != 1:
        return f"{len(lines)} lines on standard error"
    if "Traceback" in o.err or not lines[0].startswith("xstage") or ": error: " not in lines[0]:
        return "not an `xstage ...: error: ...` line"
    if o.out.strip():
        return "output on standard output"
    return None


def check_refused(o: Outcome, before: dict, after: dict) -> None:
    why = one_line_refusal(o)
    assert why is None, f"{why}:\n{o}"
    assert after == before, f"a refused command changed its folder:\n{o}\n{_diff(before, after)}"


def check_done_or_refused(o: Outcome, before: dict, after: dict, inputs: list[str], baseline: dict | None,
                          undetermined=()) -> None:
    """Exit 2 as `check_refused`, or exit 0 with every input unchanged and a sane JSON output."""
    if o.code == 2 and not o.raised:
        check_refused(o, before, after)
        return
    assert o.code == 0 and not o.raised, f"neither done nor refused:\n{o}"
    assert "Traceback" not in o.err, str(o)
    for name in inputs:
        assert after.get(name) == before.get(name), f"input {name} changed:\n{o}"
    for name in before:  # files that were there are unchanged or rewritten, never gone
        assert name in after, f"{name} vanished:\n{o}"
    assert not o.warned, f"NaN or infinities computed from the input:\n{o}"
    if baseline is not None:
        bad = not_finite_where_finite(baseline, json.loads(o.out), skip=frozenset(undetermined))
        assert not bad, f"numbers turned NaN or infinite at {bad[:5]}:\n{o}"


def not_finite_where_finite(base, got, where: str = "", skip=frozenset()) -> list[str]:
    """The places where `base` (JSON) holds a finite number and `got` holds something else that is
    no finite number: null (NaN in `jsonable`), "inf", "nan"... (not under the keys `skip`)."""
    bad: list[str] = []
    if isinstance(base, dict) and isinstance(got, dict):
        for k in base.keys() & got.keys() - skip:
            bad += not_finite_where_finite(base[k], got[k], f"{where}.{k}", skip)
    elif isinstance(base, list) and isinstance(got, list):
        for i, (b, g) in enumerate(zip(base, got)):
            bad += not_finite_where_finite(b, g, f"{where}[{i}]", skip)
    elif isinstance(base, (int, float)) and not isinstance(base, bool) and math.isfinite(base):
        finite = isinstance(got, (int, float)) and not isinstance(got, bool) and math.isfinite(got)
        if not finite and not isinstance(got, (dict, list, bool)) and not (isinstance(got, str) and _is_text(got)):
            bad.append(f"{where}={got!r}")
    return bad


def _is_text(s: str) -> bool:
    """A string that is no spelling of a number (a name that took a number's place is not garbage)."""
    try:
        float(s)
    except ValueError:
        return True
    return False


def _diff(before: dict, after: dict) -> str:
    keys = sorted(before.keys() | after.keys())
    return "\n".join(f"  {k}: {before.get(k)} -> {after.get(k)}" for k in keys if before.get(k) != after.get(k))
