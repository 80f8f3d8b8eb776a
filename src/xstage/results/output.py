"""What a command writes and prints: its output files, text for people, standard JSON.

Output files (`Outputs`): a command declares every file it may write before any work, `Outputs.file`
for one file (`xstage fit -o PROFILE.json`) and `Outputs.folder` for the files of a folder (`-o DIR`).
A declared file must be new, or one that the same command wrote in an earlier run and that nobody has
changed since; `--force` (`add_force_option`) lets a command replace any other file too, but never one
of its inputs: a file the command reads is never one it writes (paths compared after resolving links),
even with `--force`. A refusal is one `InputError` line naming the argument and the existing file, so a
long fit or simulation never ends in an error about where it writes.

Which files a command wrote is recorded beside them, in the folder's manifest `.xstage-outputs.json`:
per file name, the command and the SHA-256 of what it wrote; a results CSV that every run appends to
(`moe.csv`, a probe's `raw/first.csv`) is recorded as appended, without a hash. While a run writes,
the manifest also lists the files it may be writing, so that the files of a run that was killed
before it could record them are still that command's to replace. The writers themselves replace a
file only once it is complete (`xstage.results.io.atomic_open`).

    outs = Outputs("xstage demo", force=args.force, inputs=[("--data", args.data)])
    out = outs.folder(args.out, "-o", files=["report.md", "*.png"])
    ...                # every other check
    with outs:         # creates the folder; on leaving, also after a failure, records what was written
        ...            # the work, writing into `out`

`emit`: text for people, or standard JSON for scripts (`--json`): NaN becomes `null`, infinities
become the strings `"inf"` / `"-inf"`, numpy scalars and paths become plain values.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from xstage.errors import InputError
from xstage.results.io import atomic_open

MANIFEST = ".xstage-outputs.json"
MANIFEST_FORMAT = "xstage-outputs/1"


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


def with_provenance(rows: list[dict], env: dict) -> list[dict]:
    """Every row with the commit and date of the model that predicted it (results quote these rows); `env`
    taken before the predictions, so a commit made while they run is not stamped on them."""
    return [{**r, "git_commit": env["git_commit"], "src_hash": env["src_hash"], "date": env["date"]} for r in rows]


def write_text(path, text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename: never a half-written file."""
    path = Path(path)
    with atomic_open(path) as f:
        f.write(text)
    return path


def file_digest(path) -> str:
    """SHA-256 of a file's bytes, in hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_writable_folder(folder: Path, arg: str, target: Path) -> None:
    if not folder.exists():
        raise InputError(f"{arg} {target}: folder {folder} does not exist")
    if not folder.is_dir():
        raise InputError(f"{arg} {target}: {folder} is not a folder")
    # A permission check rather than a test file: a refused command must leave even the folder's
    # modification time as it was (access() also answers EROFS for a read-only mount).
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{arg} {target}: cannot write in {folder} (permission denied or read-only)")


def _check_folder(p: Path, arg: str) -> None:
    """`p` is a writable folder, or one that can be created (its nearest existing ancestor is one)."""
    if p.exists():
        if not p.is_dir():
            raise InputError(f"{arg} {p}: exists and is not a folder")
        _check_writable_folder(p, arg, p)
        return
    ancestor = p.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"{arg} {p}: {ancestor} is not a folder")
    _check_writable_folder(ancestor, arg, p)


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)  # hard links
    except OSError:
        return False


@dataclass
class _Claim:
    """One declared output: a file name, or a glob pattern of names, in one folder."""

    arg: str
    given: str
    folder: Path
    name: str
    append: bool
    what: str  # "file" or "folder": what the user can choose instead
    start: dict[str, tuple[str | int, bool]] = field(default_factory=dict)  # name -> (digest or size, own)

    @property
    def pattern(self) -> bool:
        return any(c in self.name for c in "*?[")

    def matches(self) -> list[Path]:
        if not self.pattern:
            p = self.folder / self.name
            return [p] if p.exists() or p.is_symlink() else []
        return sorted(p for p in self.folder.glob(self.name) if p.name != MANIFEST) if self.folder.is_dir() else []

    def state(self, path: Path) -> str | int:
        return path.stat().st_size if self.append else file_digest(path)


class Outputs:
    """The files one run of `command` may write, checked when declared (before any work) and recorded
    in each folder's manifest when the run ends (see the module docstring).

    `inputs`: `(argument, path)` pairs of the files the command reads (`None` paths are skipped); no
    declared output may be one of them. `force`: replace files this command did not write."""

    def __init__(self, command: str, *, force: bool = False, inputs: Iterable[tuple[str, object]] = ()):
        self.command = command
        self.force = bool(force)
        self.inputs = [(arg, Path(p)) for arg, p in inputs if p is not None and str(p) != ""]
        self._claims: list[_Claim] = []
        self._manifests: dict[Path, dict] = {}
        self._created: list[Path] = []
        self._begun = False

    # ---- declaring (checks now, before any work) ---------------------------------------------------

    def file(self, path, arg: str, *, append: bool = False) -> Path:
        """Declare the file `path` (`arg` names the option that gave it): not a folder, in an existing
        writable folder, new or this command's own (or `force`), not an input. Returns it as a Path."""
        p = Path(path)
        if p.is_dir():
            raise InputError(f"{arg} {p}: is a folder; give a file name")
        folder = p.parent if str(p.parent) else Path(".")
        _check_writable_folder(folder, arg, p)
        self._claim(_Claim(arg, str(path), folder, p.name, append, "file"))
        return p

    def folder(self, path, arg: str, *, files: Sequence[str] = (), append: Sequence[str] = ()) -> Path:
        """Declare the folder `path` (created when the run begins if missing) and the files the command
        may write in it: `files` replaced whole, each a name or a glob pattern (`speedup-*.png`: every
        file it matches), and `append`, results files that every run appends to. A name may lie in a
        subfolder (`plots/*.png`). Returns the folder as a Path."""
        root = Path(path)
        _check_folder(root, arg)
        for names, is_append in ((files, False), (append, True)):
            for rel in names:
                sub = Path(rel)
                if (root / sub.parent).exists() and not (root / sub.parent).is_dir():
                    raise InputError(f"{arg} {root}: {root / sub.parent} is not a folder")
                self._claim(_Claim(arg, str(path), root / sub.parent, sub.name, is_append, "folder"))
        return root

    def _claim(self, c: _Claim) -> None:
        self._check_inputs(c)
        for f in c.matches():
            if f.is_dir() or not f.is_file():
                raise InputError(f"{c.arg} {c.given}: {f} exists and is not a file")
            own = self._own(c, f)
            if own is not None and not self.force:
                action = "write to" if c.append else "replace"
                raise InputError(f"{c.arg} {c.given}: {f} exists and {own}; choose another {c.what} or give "
                                 f"--force to {action} it")
            c.start[f.name] = (c.state(f), own is None)
        self._claims.append(c)

    def _check_inputs(self, c: _Claim) -> None:
        for iarg, ipath in self.inputs:
            if c.pattern:
                targets = [c.folder / ipath.resolve().name] if (
                    ipath.resolve().parent == c.folder.resolve() and fnmatch.fnmatch(ipath.resolve().name, c.name)
                ) else [f for f in c.matches() if _same_file(ipath, f)]
            else:
                targets = [c.folder / c.name] if _same_file(ipath, c.folder / c.name) else []
            if _same_file(ipath, c.folder / MANIFEST):
                targets.append(c.folder / MANIFEST)
            if targets:
                raise InputError(f"{c.arg} {c.given}: the output {targets[0]} is the input {iarg} {ipath}; write "
                                 "the output elsewhere (an input is never written, even with --force)")

    def _own(self, c: _Claim, f: Path) -> str | None:
        """None when `f` is this command's to write again, else why it is not."""
        m = self._manifest(c.folder, c)
        if any(fnmatch.fnmatch(f.name, pat) for pat in m["unfinished"].get(self.command, [])):
            return None  # a run of this command was writing it when it stopped
        entry = m["files"].get(f.name)
        if not isinstance(entry, dict) or not entry.get("by"):
            return f"was not written by `{self.command}`"
        if entry["by"] != self.command:
            return f"was written by `{entry['by']}`, not by `{self.command}`"
        if entry.get("append") or entry.get("sha256") == file_digest(f):
            return None
        return f"was changed since `{self.command}` wrote it"

    # ---- the manifest ------------------------------------------------------------------------------

    def _manifest(self, folder: Path, c: _Claim | None = None) -> dict:
        key = folder.resolve()
        if key not in self._manifests:
            self._manifests[key] = self._read(folder, c)
        return self._manifests[key]

    def _read(self, folder: Path, c: _Claim | None = None) -> dict:
        empty = {"format": MANIFEST_FORMAT, "files": {}, "unfinished": {}}
        path = folder / MANIFEST
        if not path.exists():
            return empty
        try:
            m = json.loads(path.read_text())
            ok = (isinstance(m, dict) and m.get("format") == MANIFEST_FORMAT and isinstance(m.get("files"), dict)
                  and isinstance(m.get("unfinished", {}), dict))
        except (OSError, UnicodeDecodeError, ValueError):
            ok = False
        if not ok:
            if self.force:
                return empty
            where = f"{c.arg} {c.given}: " if c else ""
            raise InputError(f"{where}{path} is not a record of xstage's outputs ({MANIFEST_FORMAT}); remove it "
                             "or give --force")
        m.setdefault("unfinished", {})
        return m

    def _write(self, folder: Path, m: dict) -> None:
        path = folder / MANIFEST
        if not m["files"] and not m["unfinished"]:
            if path.exists():
                path.unlink()
            return
        m = {k: v for k, v in m.items() if k != "unfinished" or v}
        with atomic_open(path) as f:
            f.write(json.dumps(m, indent=1, sort_keys=True) + "\n")

    def _folders(self) -> dict[Path, list[_Claim]]:
        out: dict[Path, list[_Claim]] = {}
        for c in self._claims:
            out.setdefault(c.folder, []).append(c)
        return out

    # ---- the run -----------------------------------------------------------------------------------

    def begin(self) -> None:
        """Create the folders and note in their manifests which files this run may write."""
        for folder, claims in self._folders().items():
            missing = []
            p = folder
            while not p.exists():
                missing.append(p)
                p = p.parent
            folder.mkdir(parents=True, exist_ok=True)
            self._created += missing
            m = self._read(folder)
            m["unfinished"][self.command] = sorted(set(m["unfinished"].get(self.command, []))
                                                   | {c.name for c in claims})
            self._write(folder, m)
        self._begun = True

    def recheck(self, path) -> None:
        """Refuse to write the declared file `path` when another program created or changed it while
        this command ran."""
        p = Path(path)
        for c in self._claims:
            if not c.pattern and c.folder / c.name == p:
                now = c.state(p) if p.exists() else None
                before = c.start.get(p.name, (None, True))[0]
                if now != before:
                    raise InputError(f"{c.arg} {c.given}: {p} was created or changed by another program while "
                                     "this command ran; nothing written")

    def finish(self) -> None:
        """Record which files this run wrote (each with its hash) and that it has ended."""
        if not self._begun:
            return
        for folder, claims in self._folders().items():
            if not folder.is_dir():
                continue
            m = self._read(folder)
            files = m["files"]
            leftover = m["unfinished"].pop(self.command, [])
            seen = set()
            for c in claims:
                names = {f.name for f in c.matches()} | ({c.name} if not c.pattern else set(c.start))
                for name in names:
                    seen.add(name)
                    f = folder / name
                    mine = isinstance(files.get(name), dict) and files[name].get("by") == self.command
                    if not f.is_file():
                        if mine:
                            del files[name]
                        continue
                    before = c.start.get(name)
                    now = c.state(f)
                    if before is None or before[0] != now or before[1]:  # created, changed, or already own
                        files[name] = self._entry(c.append, f)
            # Files that a killed run of this command may have written and this run did not claim.
            for pat in leftover:
                for f in folder.glob(pat):
                    if f.is_file() and f.name != MANIFEST and f.name not in seen and f.name not in files:
                        files[f.name] = self._entry(False, f)
            self._write(folder, m)
        for p in sorted(set(self._created), key=lambda q: len(q.parts), reverse=True):  # created, left empty
            try:
                p.rmdir()
            except OSError:
                pass
        self._begun = False

    def _entry(self, append: bool, f: Path) -> dict:
        return {"by": self.command, "append": True} if append else {"by": self.command, "sha256": file_digest(f)}

    def __enter__(self) -> Outputs:
        self.begin()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
            return
        try:  # the run failed: still record what it wrote, without hiding why it failed
            self.finish()
        except OSError:
            pass


def is_terminal(stream) -> bool:
    """Whether `stream` is an interactive terminal (progress bars) rather than a file or pipe."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


__all__ = ["MANIFEST", "Outputs", "emit", "file_digest", "is_terminal", "jsonable", "to_json",
           "write_text"]
