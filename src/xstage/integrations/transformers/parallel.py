"""Expert parallelism for a transformers MoE model: `expert_parallel(model, group)`.

Problem: a MoE model too large for one device, or served on several, keeps its attention and dense
layers on every rank (data-parallel: each rank runs the model on its own tokens) while each rank holds
only its share of every MoE block's experts. Each token's rows must then reach the ranks that own its
top-k experts and come back weighted. `fused_moe` on a torch.distributed group does exactly that
inside its kernel (dispatch in its first stage, combine from its last), so here every experts module
set to `"xstage"` runs `fused_moe` on the group with this rank's experts. This is not transformers' own
expert parallelism (`distributed_config`, a `tp_plan`), whose ranks all see every token and whose
outputs are all-reduced; a model sharded that way (DTensor weights) is refused.

Algorithm:
1. Check every experts module (what the kernel can honour, as at EP = 1; the expert count a multiple
   of the group size; the top-k in the model's config) before any is changed.
2. Per module, keep only this rank's experts: `gate_up_proj` and `down_proj` (with their biases, and
   an FP8 checkpoint's scales) become new parameters holding experts [r * E / R, (r + 1) * E / R) (the
   full ones are freed once nothing else holds them), `num_experts` stays E, so the router's ids stay
   global and the kernel maps them to ranks.
   `state_dict`, `save_pretrained` and `load_state_dict` of a sharded module are refused in one line
   (a shard under the full model's names would load as garbage or not at all).
3. Make the group's MoE buffers, one per shape shared by the blocks, each for `max_tokens` tokens per
   rank: a collective, in the same order on every rank.
4. Per experts call: exactly one `fused_moe` call on the group (`backend._run_sharded`). Every rank
   must therefore call every MoE block equally often, whatever its tokens (zero tokens included): run
   the same number of forwards (`generate(..., synced_gpus=True)` keeps finished ranks stepping). A
   call of more than `max_tokens` tokens on any rank is refused there and stops that call on every
   rank (the peers raise "rank R refused its tokens"), rather than chunking: ranks could agree on a
   chunk count only through a host collective per call.
"""

from __future__ import annotations

import torch

from xstage.bounds import check_instance
from xstage.errors import InputError, XstageError
from xstage.integrations.transformers.backend import (
    _SHARDS,
    _STATES,
    DEFAULT_MAX_TOKENS,
    Shard,
    _buffer,
    _build_weights,
    _check_module,
    _on_device,
    _State,
    make_settings,
    require_transformers,
    served_modules,
)
from xstage.integrations.transformers.weights import param_names
from xstage.moe import BlockConfig


def _group(group):
    """The torch.distributed group (None: the default one), or one `InputError` line."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InputError("group: torch.distributed is not initialized (call torch.distributed.init_process_group "
                         "first; torchrun starts one process per rank)")
    group = dist.group.WORLD if group is None else group
    check_instance(group, "group", dist.ProcessGroup, "a torch.distributed ProcessGroup or None")
    rank = dist.get_rank(group)
    if rank < 0:
        raise InputError("group: this process is not a member of the group")
    return group, rank, dist.get_world_size(group)


def _check_shardable(module, name: str, ranks: int) -> int:
    """This module's top-k, once everything `expert_parallel` needs of it holds."""
    for p in ("gate_up_proj", "down_proj"):
        if type(getattr(module, p, None)).__name__ == "DTensor":
            raise InputError(f"{name}: {p} is a DTensor: the model is sharded by transformers' own tensor or expert "
                             "parallelism (tp_plan, distributed_config); load it without that to use expert_parallel")
    if module in _SHARDS:
        raise InputError(f"{name}: already sharded ({_SHARDS[module].describe()}); call expert_parallel once")
    _check_module(module, name)
    e = module.gate_up_proj.shape[0]
    if e % ranks:
        raise InputError(f"{name}: num_experts={e} is not a multiple of the group's {ranks} ranks (expert_parallel "
                         "gives each rank E / R whole experts)")
    k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= e:
        raise InputError(f"{name}: config.num_experts_per_tok={k!r}: expected the router's top-k, an integer in "
                         f"[1, {e}] (the group's buffer is sized by it)")
    return k


def _refuse_state_dict(shard: Shard):
    """State-dict hooks that refuse, naming the module and what to do (a hook per direction)."""
    what = (f"{shard.name}: {shard.describe()}: its state_dict would be one rank's shard under the full model's "
            "names; save or load the model before expert_parallel")

    def saving(*_):
        raise XstageError(what)

    return saving


def expert_parallel(model, group=None, *, config: BlockConfig | None = None, schedule: str | None = None,
                    max_tokens: int = DEFAULT_MAX_TOKENS, check="async") -> list[str]:
    """Shard every experts module of `model` that runs `"xstage"` over `group` (None: the default
    torch.distributed group) and run it there; returns their names. Call it on every rank, with the
    same model (same weights: the same checkpoint or seed), after `register()` and
    `set_experts_implementation("xstage")`; then each rank calls the model on its own tokens.

    Rank r keeps experts [r * E / R, (r + 1) * E / R) of each module; `memory(model).experts` is this
    rank's share. `config` and `schedule` are the kernel's (as for `prepare`); `max_tokens` is the most
    tokens one rank may pass to one MoE block per call, the size of every rank's buffer; `check` is
    `fused_moe`'s (`"async"`: errors the device records surface at a later call; `True`: at once, with
    host synchronisations). A module that cannot be sharded is refused in one `InputError` line naming
    it, before any module changes and before any collective."""
    require_transformers()
    check_instance(model, "model", torch.nn.Module, "a transformers model")
    settings = make_settings(config, schedule, max_tokens, check)
    group, rank, ranks = _group(group)
    found = served_modules(model)
    topks = [_check_shardable(m, name, ranks) for name, m in found]  # every module, before any changes
    for (name, m), k in zip(found, topks):
        e = m.gate_up_proj.shape[0]
        shard = Shard(name, group, rank, ranks, e, k, settings)
        mine = slice(shard.first, shard.first + shard.local)
        with torch.no_grad():
            for p in param_names(m):  # weights, FP8 scales and biases: each holds the experts along dim 0
                full = getattr(m, p)
                # A copy, not a view: a view would keep the whole tensor's storage alive.
                setattr(m, p, torch.nn.Parameter(full.detach()[mine].clone(), requires_grad=full.requires_grad))
                del full
        _SHARDS[m] = shard
        refuse = _refuse_state_dict(shard)
        m.register_state_dict_pre_hook(refuse)
        m.register_load_state_dict_pre_hook(refuse)
        st = _State(m, name, settings, shard)
        _STATES[m] = st  # a state of an earlier prepare goes, and its copy with it
        with _on_device(m.gate_up_proj.device):
            _build_weights(m, st)
            _buffer(st, m, 0, k)  # a collective: every rank makes the same buffers in the same order
    return [name for name, _ in found]
