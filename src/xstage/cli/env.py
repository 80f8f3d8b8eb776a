"""`xstage env`: versions, GPU, SM count, peer access and the symmetric-memory backend."""

from __future__ import annotations

import torch

from xstage.env import environment, has_gpu, peer_access_matrix
from xstage.results.output import emit


def _symm_mem_backend() -> str:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return "unavailable"
    get = getattr(symm_mem, "get_backend", None)
    if get is None:
        return "CUDA (default)"
    try:
        return str(get("cuda") if has_gpu() else "n/a (no GPU)")
    except Exception as exc:  # the backend query itself can fail on odd builds; report, don't crash
        return f"unknown ({type(exc).__name__})"


def run_env(args) -> int:

    info: dict = dict(environment())
    info["sm_count"] = int(info["sm_count"])  # a number in JSON, like `gpus` (result rows keep strings)
    info["symm_mem_backend"] = _symm_mem_backend()
    info["gpus"] = 0
    peers: list[list[bool]] = []
    if has_gpu():
        info["gpus"] = torch.cuda.device_count()
        peers = peer_access_matrix()
    info["peer_access"] = peers
    lines = [f"{k:>16}: {v}" for k, v in info.items() if k != "peer_access"]
    if peers:
        lines.append("     peer access: " + " ".join("".join("x" if a else "." for a in row) for row in peers))
    emit(info, args.json, "\n".join(lines))
    return 0


def register(sub) -> None:
    p = sub.add_parser("env", help="show versions, GPU, SM count, peer access, symmetric-memory backend")
    p.add_argument("--json", action="store_true", help="print standard JSON instead of text")
    p.set_defaults(handler=run_env)
