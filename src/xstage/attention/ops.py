"""`torch.ops.xstage.ulysses_attention`: the Ulysses layer as a torch custom op.

Serving stacks trace models with `torch.compile` and replay them from CUDA graphs. The op takes the
group by name (`group_name: str`, as torch's symmetric-memory ops do): a registered `xstage.comm`
context (`register_comm`, e.g. a loopback group) or a process group's `group_name`. Its fake
implementation gives the output's shape (that of q), so the op traces without running. Under CUDA
graph capture the fused path needs no host synchronisation: the per-tile counters reset themselves,
and the timeout check is left to a later `CommContext.check()`.

Example:
    >>> import torch
    >>> from xstage.comm import create_context
    >>> register_comm("loopback-2", create_context(path="hbm", loopback_world=2))
    >>> x = torch.randn(1, 32, 2, 16, dtype=torch.float16)
    >>> torch.ops.xstage.ulysses_attention(x, x, x, "loopback-2").shape
    torch.Size([1, 32, 2, 16])
"""

from __future__ import annotations

import torch

from xstage.attention.ulysses import ulysses_attention
from xstage.errors import InputError

_COMMS: dict[str, object] = {}


def register_comm(name: str, ctx) -> str:
    """Make context `ctx` reachable from the op as `group_name=name`; returns `name`."""
    if not isinstance(name, str) or not name:
        raise InputError(f"name {name!r}: must be a non-empty string")
    _COMMS[name] = ctx
    return name


@torch.library.custom_op("xstage::ulysses_attention", mutates_args=())
def ulysses_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                         softmax_scale: float | None = None, exchange: str = "auto") -> torch.Tensor:
    # a bad exchange spelling is refused by ulysses_attention, on a group as one agreed line on every rank
    comm = _COMMS.get(group_name)
    if comm is not None:
        return ulysses_attention(q, k, v, comm=comm, softmax_scale=softmax_scale, exchange=exchange)
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(group_name)
    except Exception as e:  # unknown names surface as one clear line
        raise InputError(f"group_name {group_name!r}: neither a registered context nor a process group") from e
    return ulysses_attention(q, k, v, group, softmax_scale=softmax_scale, exchange=exchange)


@ulysses_attention_op.register_fake
def _(q, k, v, group_name, softmax_scale=None, exchange="auto"):
    return torch.empty_like(q)
