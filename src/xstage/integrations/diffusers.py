"""xstage's Ulysses attention inside a diffusers transformer under context parallelism (Flux, Wan, ...).

Problem: diffusers shards a DiT's sequence over P ranks with its context-parallel hooks
(`transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P))`, driven by the model's
`_cp_plan`) and runs each attention with its own Ulysses layer (`TemplatedUlyssesAttention`: an
all-to-all and a wait before attention, another after, nothing overlapped). `enable(transformer)` makes
that attention xstage's `UlyssesAttention` (both all-to-alls are xstage's; `exchange="auto"`, the
planner's pick, by default) and leaves everything else to diffusers: the hooks still split the inputs
and gather the output, and the model's processors still do the projections, norms, RoPE and output
projection.

Example (P processes, after `torch.distributed.init_process_group`):
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P))
    xstage.integrations.diffusers.enable(transformer)              # exchange="auto"
    with torch.inference_mode():
        out = transformer(**inputs)

Where it plugs in, and why there: every processor of a model with a `_cp_plan` calls
`dispatch_attention_fn(q, k, v, ..., backend=self._attention_backend, parallel_config=self._parallel_config)`,
which looks the backend up in diffusers' backend registry and hands it `[B, S_local, H, D]` tensors and
the parallel config. A backend registered there serves every such model with no per-model code, and
relies only on that call. The other extension point, a processor set with `set_attn_processor`, would
repeat each architecture's processor (projections, QK norms, RoPE, the joint text/image split, the
output projection) and have to follow every change diffusers makes to them. diffusers has no public
way to add a backend: the backend names are a closed enum, `AttentionBackendName`. So `enable` builds
one object of that enum's class that is NOT added to the enum's tables (its names, `set_attention_backend`
and every other model stay as they were), registers it with the registry's own decorator
(`_AttentionBackendRegistry.register`), and sets it on this transformer's processors only. These are
private parts of diffusers, so the version is checked: 0.42.x, the version the tests run (`SUPPORTED`);
any other refuses in one line. `disable(transformer)` undoes it all.

Refused, each in one line naming it (never a silent fallback to another algorithm):
- no context parallelism on the transformer, `ring_degree > 1`, a Ulysses mesh whose group size is not
  `ulysses_degree`;
- per call: an attention mask, causal attention, dropout, GQA, `return_lse`, autograd (xstage's
  kernels have no backward: run under `torch.no_grad()` / `torch.inference_mode()`), key and value
  sequences that differ from the query's (cross-attention that diffusers itself runs locally still
  runs locally, on the backend the processor had before), and CUDA graph capture with
  `ulysses_anything=True` (the ranks' token counts then differ, and no host collective can gather them).
  These depend only on the model and its call, which every rank runs alike, so every rank refuses the
  same call before any collective. What xstage's Ulysses layer refuses of its inputs (dtype, head dim)
  reaches every rank as one agreed line (`xstage.attention.inputs`).
Any head count (not divisible by P) and, with `ContextParallelConfig(ulysses_anything=True)`, any
sequence length work: xstage's layer splits heads and tokens unevenly itself.
Under `torch.compile` (`fullgraph=True` included) the call is the custom op
`torch.ops.xstage.ulysses_attention`. The op takes neither a calibration nor the ranks' token counts:
with `calibration=` or `ulysses_anything=True` the compiled model leaves its graph for each attention,
which then runs eagerly as above (`fullgraph=True` refuses that; set `XSTAGE_CALIBRATION` instead of
`calibration=`, which the op reads).
"""

from __future__ import annotations

import itertools
import re
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from xstage.attention import UlyssesAttention, ulysses_attention_op
from xstage.attention.ulysses import check_runnable
from xstage.errors import InputError, XstageError

SUPPORTED = (0, 42)  # diffusers major.minor whose private backend registry this module was written and tested on
_EXTRA = "pip install 'xstage[diffusers]'"
_names = itertools.count(1)
_ENABLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transformer -> _Enabled
_MISSING = object()


def _diffusers():
    """diffusers' attention dispatch module, once the installed version is known to be supported."""
    try:
        import diffusers
        from diffusers.models import attention_dispatch
    except ImportError as e:
        raise XstageError(f"diffusers: not installed ({e}); {_EXTRA}") from None
    version = getattr(diffusers, "__version__", "")
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m[1]), int(m[2])) != SUPPORTED or re.search(r"dev|rc|a\d|b\d", version):
        raise XstageError(f"diffusers {version}: xstage's integration supports diffusers "
                          f"{SUPPORTED[0]}.{SUPPORTED[1]}.x (it registers a backend through diffusers' private "
                          f"attention registry); {_EXTRA}")
    return attention_dispatch


@dataclass
class _Enabled:
    """What `enable` changed on one transformer, and what its backend needs at each call."""

    config: object  # the transformer's diffusers ParallelConfig (a processor handing another one is refused)
    group: object
    attn: UlyssesAttention
    exchange: str
    calibration: object
    anything: bool  # ulysses_anything: the ranks' token counts may differ
    members: dict = field(default_factory=dict)  # backend the processor had before -> the member set instead
    previous: list = field(default_factory=list)  # (processor, its own _attention_backend or _MISSING)
    release: object = None  # weakref.finalize: drops the registry entries (disable, or the model's collection)


def enable(transformer, *, exchange="auto", calibration=None) -> None:
    """Run `transformer`'s context-parallel attention with xstage's Ulysses attention.

    Call it after `transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P))`, on
    every rank. `exchange`: how the attention output reaches its rows' owners (`serial`, `overlap`,
    `stores`, `auto`), or `heads:CORE:C`, both exchanges pipelined by head chunks; see
    `xstage.attention.exchange`. `calibration`: a user's calibration folder (or
    `xstage.sched.calibration.Calibration`) that `auto` decides with. Inference only.
    `disable(transformer)` restores the backends the processors had.
    """
    ad = _diffusers()
    from diffusers.models.modeling_utils import ModelMixin

    if not isinstance(transformer, ModelMixin):
        raise InputError(f"transformer: expected a diffusers model (ModelMixin), got {type(transformer).__name__}")
    if _state(transformer) is not None:
        raise InputError(f"transformer: xstage's Ulysses attention is already enabled on this "
                         f"{type(transformer).__name__}; call disable(transformer) first")
    config = getattr(transformer, "_parallel_config", None)
    cp = getattr(config, "context_parallel_config", None)
    if cp is None:
        raise InputError(f"transformer: {type(transformer).__name__} has no context parallelism; call "
                         "transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P)) first")
    if cp.ring_degree > 1:
        raise InputError(f"ContextParallelConfig.ring_degree={cp.ring_degree}: xstage replaces the whole Ulysses "
                         "layer and runs no ring attention; use ContextParallelConfig(ulysses_degree=P) alone")
    group = cp._ulysses_mesh.get_group()
    if dist.get_world_size(group) != cp.ulysses_degree:
        raise InputError(f"ContextParallelConfig.ulysses_degree={cp.ulysses_degree}: the Ulysses mesh's group has "
                         f"{dist.get_world_size(group)} ranks; they must be equal")
    processors = _processors(transformer, config)
    if not processors:
        raise InputError(f"transformer: none of {type(transformer).__name__}'s attention processors runs diffusers' "
                         "context-parallel attention (a processor with _attention_backend and the parallel config "
                         "that enable_parallelism set); its attention cannot be replaced")
    attn = UlyssesAttention(group, exchange=exchange, calibration=calibration)  # refuses a bad spelling or folder
    check_runnable(attn.exchange, transformer.device)  # an exchange that parses but cannot run: now, not mid-model
    state = _Enabled(config, group, attn, str(attn.exchange), calibration, bool(cp.ulysses_anything))
    for p in processors:
        prev = p.__dict__.get("_attention_backend", _MISSING)
        state.previous.append((p, prev))
        before = p._attention_backend
        key = None if before is None else ad.AttentionBackendName(before)
        if key not in state.members:
            state.members[key] = _register(ad, state, key)
        p._attention_backend = state.members[key]
    # the registry holds no reference to the transformer: its entries go when it does, if not disabled before
    state.release = weakref.finalize(transformer, _unregister, ad._AttentionBackendRegistry,
                                     list(state.members.values()))
    _ENABLED[transformer] = state


def disable(transformer) -> None:
    """Undo `enable`: the processors get their backends back and the registry loses xstage's entries."""
    state = _state(transformer)
    if state is None:
        raise InputError(f"transformer: xstage's Ulysses attention is not enabled on this {type(transformer).__name__}")
    del _ENABLED[transformer]
    for p, prev in state.previous:
        if prev is _MISSING:
            del p._attention_backend  # the processor's class default shows through again
        else:
            p._attention_backend = prev
    state.release()


def is_enabled(transformer) -> bool:
    """Whether `enable` is in effect on `transformer`."""
    return _state(transformer) is not None


def _state(transformer) -> _Enabled | None:
    try:
        return _ENABLED.get(transformer)
    except TypeError:  # not weakly referenceable: not a model, so never enabled
        return None


def _unregister(registry, members) -> None:
    for member in members:
        for table in (registry._backends, registry._constraints, registry._supported_arg_names):
            table.pop(member, None)
        registry._supports_context_parallel.discard(member.value)


def _processors(transformer, config) -> list:
    """The distinct processors that hand `config` to diffusers' attention dispatch."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    seen, out = set(), []
    for module in transformer.modules():
        # the attention classes whose processors enable_parallelism hands the parallel config to
        if not isinstance(module, (Attention, MochiAttention, AttentionModuleMixin)):
            continue
        p = getattr(module, "processor", None)
        if (p is None or id(p) in seen or not hasattr(p, "_attention_backend")
                or getattr(p, "_parallel_config", None) is not config):
            continue
        seen.add(id(p))
        out.append(p)
    return out


def _register(ad, state: _Enabled, before):
    """A backend for processors whose backend was `before` (None: diffusers' active one): a member of
    diffusers' backend enum class kept out of the enum's tables, registered with the registry's decorator."""
    name = f"xstage_ulysses_{next(_names)}"
    member = str.__new__(ad.AttentionBackendName, name)
    member._name_, member._value_ = name.upper(), name

    # The parameters are the names `dispatch_attention_fn` passes (it keeps only those a backend declares).
    def xstage_ulysses(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, return_lse=False, _parallel_config=None):
        if _parallel_config is None:
            # attention the model runs on local tokens (Wan's cross-attention): as diffusers would, unchanged
            return ad.dispatch_attention_fn(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                            attention_kwargs={"return_lse": True} if return_lse else None,
                                            backend=before, parallel_config=None)
        return _ulysses(state, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                        _parallel_config)

    ad._AttentionBackendRegistry.register(member, constraints=[], supports_context_parallel=True)(xstage_ulysses)
    return member


def _ulysses(state: _Enabled, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, config):
    if config is not state.config:
        raise InputError("parallel_config: the processor hands another parallel config than the one xstage was "
                         "enabled with; call enable(transformer) again after enable_parallelism")
    for name, bad, why in (
        ("attn_mask", attn_mask is not None, "xstage's Ulysses attention attends over every token (no mask)"),
        ("enable_gqa", bool(enable_gqa), "key and value need as many heads as the query"),
        ("return_lse", bool(return_lse), "xstage's Ulysses attention returns the output only"),
    ):
        if bad:
            raise InputError(f"{name}: not supported: {why}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise InputError("autograd: xstage's Ulysses attention has no backward (inference only); run the "
                         "transformer under torch.no_grad() or torch.inference_mode()")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise InputError(f"key, value: {k.shape[1]} and {v.shape[1]} local tokens against the query's {q.shape[1]}; "
                         "xstage's Ulysses attention needs self-attention over one sharded sequence")
    if torch.compiler.is_compiling():
        if state.calibration is None and not state.anything:
            name = getattr(state.group, "group_name", None)
            return ulysses_attention_op(q, k, v, name, scale, state.exchange)
        return _eager_attention(state, q, k, v, dropout_p, is_causal, scale)
    return _attention(state, q, k, v, dropout_p, is_causal, scale)


def _attention(state: _Enabled, q, k, v, dropout_p, is_causal, scale):
    seq_lens = None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        if state.anything:
            raise InputError("ContextParallelConfig.ulysses_anything=True: under CUDA graph capture the ranks' "
                             "token counts may differ and cannot be gathered; capture with equal shards "
                             "(ulysses_anything=False)")
        seq_lens = [q.shape[1]] * dist.get_world_size(state.group)  # equal shards: diffusers' equipartition
    return state.attn(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal, seq_lens=seq_lens)


# The custom op takes neither a calibration nor the ranks' token counts (which `ulysses_anything` makes
# differ, and which a CUDA graph of the compiled model could not gather): with either, the compiled
# model leaves its graph for this call (`fullgraph=True` then refuses, naming this function).
@torch.compiler.disable(reason="xstage's custom op takes no calibration= and no uneven token counts "
                                "(ulysses_anything=True); set XSTAGE_CALIBRATION instead, or compile without fullgraph")
def _eager_attention(state: _Enabled, q, k, v, dropout_p, is_causal, scale):
    return _attention(state, q, k, v, dropout_p, is_causal, scale)


__all__ = ["SUPPORTED", "disable", "enable", "is_enabled"]
