"""What a command writes and prints: checked output locations, text for people, standard JSON.

- `check_output_file` / `check_output_dir`: a command checks where it will write *before* any work, so
  a long fit or simulation never ends in a traceback about its output path, and nothing is overwritten.
- `emit`: text for people, or standard JSON for scripts (`--json`): NaN becomes `null`, infinities
  become the strings `"inf"` / `"-inf"`, numpy scalars and paths become plain values.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from xstage.errors import InputError
from xstage.results.io import atomic_open


def jsonable(x):
    """`x` with every value a standard JSON parser accepts."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [jsonable(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        if math.isnan(x):
            return None
        return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 0) == 0:
        return jsonable(x.item())
    if hasattr(x, "tolist"):
        return jsonable(x.tolist())
    return str(x)


def to_json(payload, indent: int | None = 2) -> str:
    """Standard JSON text of `payload` (see `jsonable`)."""
    return json.dumps(jsonable(payload), indent=indent, allow_nan=False)


def emit(payload, as_json: bool, text: str) -> None:
    """Print `text` for people or `payload` as standard JSON for scripts."""
    print(to_json(payload) if as_json else text)


def write_text(path, text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename: never a half-written file."""
    path = Path(path)
    with atomic_open(path) as f:
        f.write(text)
    return path


def _check_writable_folder(folder: Path, arg: str, target: Path) -> None:
    if not folder.exists():
        raise InputError(f"{arg} {target}: folder {folder} does not exist")
    if not folder.is_dir():
        raise InputError(f"{arg} {target}: {folder} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InputError(f"{arg} {target}: cannot write in {folder} ({exc.strerror or exc})") from None


def check_output_file(path, arg: str = "-o", overwrite: bool = False) -> Path:
    """`path` as a file this command may create: not a folder, not an existing file (unless
    `overwrite`), in an existing writable folder. Raises `InputError` naming `arg` otherwise."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{arg} {p}: is a folder; give a file name")
    if p.exists() and not overwrite:
        raise InputError(f"{arg} {p}: already exists; choose another path (nothing is overwritten)")
    _check_writable_folder(p.parent if str(p.parent) else Path("."), arg, p)
    return p


def check_output_dir(path, arg: str = "-o") -> Path:
    """`path` as a folder this command may write into: an existing writable folder, or one it can create
    (its nearest existing ancestor is a writable folder). Raises `InputError` naming `arg` otherwise."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise InputError(f"{arg} {p}: exists and is not a folder")
        _check_writable_folder(p, arg, p)
        return p
    ancestor = p.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"{arg} {p}: {ancestor} is not a folder")
    _check_writable_folder(ancestor, arg, p)
    return p


def is_terminal(stream) -> bool:
    """Whether `stream` is an interactive terminal (progress bars) rather than a file or pipe."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


__all__ = ["check_output_dir", "check_output_file", "emit", "is_terminal", "jsonable", "to_json", "write_text"]
