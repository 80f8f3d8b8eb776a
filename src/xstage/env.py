"""What machine and software a measurement came from: attached to every profile and result row.

Source provenance has two fields. `git_commit` names the commit: `XSTAGE_GIT_COMMIT` where set (a
copy of the tree on a device machine), else from git (with `-dirty` when tracked files differ from
HEAD or the package directory holds untracked files), else `unknown`. `src_hash` is a hash of the
package's own files computed at run time: two rows with the same commit but different hashes ran
different code (a stale `XSTAGE_GIT_COMMIT`, or edits).
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import os
import platform
import subprocess
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
# The files whose contents decide what a run computes: code, embedded profiles and reference data.
SOURCE_SUFFIXES = (".py", ".json", ".csv")
UNKNOWN_COMMITS = ("", "unknown", "none")


def _git(*args: str, cwd: Path) -> str | None:
    """stdout of a git command in `cwd`, or None where git or the repository's metadata is absent."""
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _git_commit(package_dir: str | os.PathLike | None = None) -> str:
    """The source tree's commit (`COMMIT-dirty` where it differs from HEAD); `unknown` without git.

    `XSTAGE_GIT_COMMIT`, where set, names the commit: a copy of the tree on a device machine may carry
    git metadata older than the tree itself, whose HEAD would name the wrong commit. It is marked
    dirty only where git knows that same commit and sees changes."""
    here = Path(package_dir) if package_dir is not None else _PACKAGE_DIR
    named = os.environ.get("XSTAGE_GIT_COMMIT", "").strip()
    head = _git("rev-parse", "--short=12", "HEAD", cwd=here)
    if head is None or not head.strip():
        return named or "unknown"
    if named and not head.strip().startswith(named) and not named.startswith(head.strip()):
        return named
    # Tracked changes anywhere in the repository, and new files inside the package (a module not yet
    # added still runs); untracked output folders elsewhere do not make the code differ.
    tracked = _git("status", "--porcelain", "--untracked-files=no", cwd=here)
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", ".", cwd=here)
    dirty = tracked is None or untracked is None or bool(tracked.strip() or untracked.strip())
    return head.strip() + ("-dirty" if dirty else "")


def source_hash(package_dir: str | os.PathLike | None = None) -> str:
    """First 12 hex digits of sha256 over the sorted relative paths and contents of the `*.py`,
    `*.json` and `*.csv` files under the package directory (`package_dir` replaces it, for tests).

    Independent of git, file times and the location of the tree, so a device copy of a commit
    hashes like the checkout it came from."""
    root = Path(package_dir) if package_dir is not None else _PACKAGE_DIR
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.suffix in SOURCE_SUFFIXES and p.is_file() and "__pycache__" not in p.parts)
    h = hashlib.sha256()
    for rel in files:
        data = (root / rel).read_bytes()
        # path, length, contents: no two different trees give the same byte stream
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()[:12]


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "none"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "none"


@functools.lru_cache(maxsize=1)
def environment() -> dict[str, str]:
    """Provenance columns: gpu, sm_count, driver, cuda, torch, triton, python, host, git_commit,
    src_hash, date."""
    info: dict[str, str] = {
        "gpu": "none",
        "sm_count": "0",
        "driver": "none",
        "cuda": "none",
        "torch": "none",
        "triton": "none",
        "python": platform.python_version(),
        "host": platform.node(),
        "git_commit": _git_commit(),
        "src_hash": source_hash(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = str(torch.version.cuda or "none")
        if torch.cuda.is_available():
            prop = torch.cuda.get_device_properties(0)
            info["gpu"] = prop.name
            info["sm_count"] = str(prop.multi_processor_count)
            info["driver"] = _driver_version()
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def peer_access_matrix() -> list[list[bool]]:
    """`torch.cuda.can_device_access_peer(i, j)` for every pair (diagonal True)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def interpreter_active() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
