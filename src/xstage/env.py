"""What machine and software a measurement came from: attached to every profile and result row."""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import subprocess
from pathlib import Path


def _git_commit() -> str:
    """The source tree's commit; a copied tree without git metadata takes `XSTAGE_GIT_COMMIT`."""
    named = os.environ.get("XSTAGE_GIT_COMMIT")
    if named:
        return named
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True
    )
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


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
    """Provenance columns: gpu, sm_count, driver, cuda, torch, triton, python, git_commit, date."""
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
