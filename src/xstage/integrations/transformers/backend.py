"""The experts backend: `experts_implementation="xstage"` runs each experts module on `fused_moe`.

Problem: a transformers 5 MoE block computes its router output (`top_k_index`, `top_k_weights`) and
hands it, with the tokens, to its experts module, whose forward is looked up by name in transformers'
experts registry (`ExpertsInterface`). `register()` adds the name `"xstage"` there: every experts
module of a model set to it then runs `fused_moe` with the block's own routing and weights, on a group
of one (EP = 1), or, once `expert_parallel` has sharded it (`xstage.integrations.transformers.parallel`),
on that torch.distributed group. The router, the shared experts (DeepSeek-V3) and everything else stay
transformers' own.

Algorithm, per experts module:
1. Once (at `prepare`, `expert_parallel` or the module's first call): check what the kernel can honour
   and refuse the rest by name (one `InputError` line, before any kernel runs;
   `xstage.integrations.transformers.weights` says what runs: float experts in transformers' layouts,
   with biases and GPT-OSS's clamped SwiGLU, and fine-grained FP8 checkpoints).
2. Once per weight version: what the kernel reads (`weights.kernel_weights`): the parameters in place
   where their layout is the kernel's, else one copy in it. A copy is cached; it is rebuilt when a
   parameter's identity, storage, version counter (in-place writes such as `load_state_dict`), dtype,
   device or shape changes (`.to()`, `.half()`). At EP = 1 the parameters are never touched, so
   `state_dict` and `save_pretrained` write the original layout.
3. Per call at EP = 1, the planner's choice of kernel (`xstage.sched.policy.choose_experts`, cached per
   token count): transformers' own `grouped_mm` chain where it was measured faster on this GPU, shape
   and dtype (eager, or under CUDA-graph capture), else the fused layer; `decisions(model)` lists them
   and `kernel="fused"` (`prepare`) turns the choice off. FP8 experts and sharded ones always run fused.
4. Per fused call: pad the tokens' hidden size if needed, run `fused_moe` on a buffer shared by the model's
   blocks of one shape, cut the padding off. At EP = 1 a call runs in chunks of at most `max_tokens`
   tokens; on a group every rank makes exactly one kernel call per experts call (the group's barrier),
   and a call of more than `max_tokens` tokens is refused on every rank.

Memory: no weight is held twice unless hidden or intermediate needs padding, the layout is transposed
or interleaved (GPT-OSS: always), or a parameter is not contiguous; FP8 checkpoints are read in place.
`memory(model)` reports the expert weights this rank holds, the copies' and the buffers' bytes; a log
line at INFO on the logger `xstage.integrations.transformers` names each copy as it is made.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import weakref
from dataclasses import dataclass

import torch

from xstage.bounds import check_instance, check_int
from xstage.dtypes import dtype_name
from xstage.errors import InputError, XstageError
from xstage.integrations.transformers import weights as kw
from xstage.integrations.transformers.weights import refuse as _refuse
from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer, fused_moe
from xstage.moe.checks import check_mode
from xstage.sched.experts import ExpertsCalls
from xstage.sched.policy import Decision, choose_experts
from xstage.spec.moe import MAX_TOKENS_PER_RANK
from xstage.spec.schedule import check_schedule

NAME = "xstage"
EXTRA = "xstage[transformers]"
# The transformers releases this module was tested against: pyproject's `transformers` extra, kept equal.
TESTED = ((5, 17), (5, 18))  # [low, high)
DEFAULT_MAX_TOKENS = 4096  # tokens per fused_moe call: EP = 1 chunks longer calls, a group refuses them
KERNELS = ("auto", "fused")  # Settings.kernel: the planner's choice per call, or the fused layer always
_CHOICES_KEPT = 4096  # decisions cached per module (token counts x capture), then the cache starts afresh
_MIN_TOKENS = 16  # the smallest buffer: decode steps of a few tokens share it

LOG = logging.getLogger("xstage.integrations.transformers")


def require_transformers():
    """The `transformers` package, or one `XstageError` line naming the extra when it is missing or
    outside the tested range."""
    try:
        tf = importlib.import_module("transformers")
    except ImportError:
        raise XstageError(f"xstage.integrations.transformers needs transformers: pip install '{EXTRA}'") from None
    m = re.match(r"(\d+)\.(\d+)", getattr(tf, "__version__", ""))
    version = (int(m.group(1)), int(m.group(2))) if m else None
    if version is None or not TESTED[0] <= version < TESTED[1]:
        lo, hi = (".".join(map(str, v)) for v in TESTED)
        raise XstageError(f"transformers {getattr(tf, '__version__', '?')}: xstage.integrations.transformers is tested "
                          f"with >={lo},<{hi}; pip install '{EXTRA}'")
    return tf


def register() -> None:
    """Register `"xstage"` in transformers' experts registry and in its fine-grained FP8 experts registry
    (idempotent)."""
    require_transformers()
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)
    FP8ExpertsInterface.register(NAME, _fp8_experts_forward)


@dataclass(frozen=True)
class Settings:
    """How a module's experts run: the kernel's tiles (`config`, None: `BlockConfig()`), the order
    (`schedule`, None: `fused_moe`'s default), the most tokens of one kernel call (`max_tokens`), when
    the kernel's recorded errors are raised (`check`, as `fused_moe` takes it), which kernel runs a call
    (`kernel`: "auto", the planner's choice between the fused layer and transformers' `grouped_mm`;
    "fused": the fused layer always) and the measurements that choice stands on (`calls`, None: the
    embedded ones, `xstage.sched.experts`)."""

    config: BlockConfig | None = None
    schedule: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    check: bool | str = "async"
    kernel: str = "auto"
    calls: ExpertsCalls | None = None


@dataclass(frozen=True)
class Memory:
    """Bytes xstage holds for a model: the weight and bias copies in the kernel's layout (`weights`; a
    GPT-OSS module always has one, its parameters being transposed and interleaved), the MoE
    buffers (`buffers`, shared by blocks of one shape), how many experts modules it serves, and the
    bytes of those modules' expert parameters (`gate_up_proj`, `down_proj`, biases) on this rank (`experts`:
    all of them at EP = 1, this rank's 1/R under `expert_parallel`)."""

    weights: int
    buffers: int
    modules: int
    experts: int = 0


@dataclass(frozen=True)
class Shard:
    """An experts module that `expert_parallel` sharded: its name, the group, this rank's place in it,
    the block's whole expert count (the router's ids stay global), its top-k and its settings."""

    name: str
    group: object  # a torch.distributed ProcessGroup
    rank: int
    ranks: int
    experts: int
    topk: int
    settings: Settings

    @property
    def local(self) -> int:
        """Experts this rank holds: [first, first + local)."""
        return self.experts // self.ranks

    @property
    def first(self) -> int:
        return self.rank * self.local

    def describe(self) -> str:
        return (f"holds experts [{self.first}, {self.first + self.local}) of {self.experts} (expert_parallel, "
                f"rank {self.rank} of {self.ranks})")


class _State:
    """What one experts module keeps: its name, settings and tiles, the cached weights and their key."""

    def __init__(self, module, name: str, settings: Settings, shard: Shard | None = None):
        self.name, self.settings, self.shard = name, settings, shard
        self.cfg = settings.config or kw.default_config(module)
        self.key = None  # the weights' signatures when w1t was built
        self.refs = None  # weak references to the parameters w1t was built from
        self.names: tuple[str, ...] = ()  # their names, and the sizes (`weights.dims`) at that build
        self.dims: tuple[int, int, int, int, int] | None = None
        # What the kernel reads: detached aliases of the parameters, or padded copies. One object per weight
        # version, so the launcher's TMA descriptors (kept while the tensor lives) are built once.
        self.w1t = self.w2 = self.b1 = self.b2 = None  # the biases: None for modules without them
        self.held = 0  # bytes of those that are copies, not aliases
        self.buf: MoEBuffer | None = None
        self.choices: dict[tuple[int, bool], Decision] = {}  # (tokens, under capture) -> the kernel's choice

    def extra_bytes(self) -> int:
        return self.held


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # experts module -> _State
# Experts module -> its Shard, for as long as the module lives: its parameters hold only this rank's
# experts, so the sharding outlives `release` (which drops the state and buffers, rebuilt from it).
_SHARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# One buffer per shape, dtype, device and tiles: blocks of a model run one after another on one stream,
# and a buffer resets its counters after every call, so they share it. Held by the states using it.
_BUFFERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _check_module(module, name: str) -> None:
    """Refuse, in one line naming the module, everything about it the fused kernel cannot honour: its
    weights and activation (`weights.check_layout`), and experts it holds only part of."""
    require_transformers()
    kw.check_layout(module, name)
    e = kw.sizes(module)[0]
    shard = _SHARDS.get(module)
    if shard is None and getattr(module, "num_experts", e) != e:
        raise _refuse(name, f"gate_up_proj: {e} experts held of num_experts={module.num_experts} (sharded by "
                            "transformers' expert parallelism; xstage runs every expert of the block here)")
    if shard is not None and (e, getattr(module, "num_experts", shard.experts)) != (shard.local, shard.experts):
        raise _refuse(name, f"gate_up_proj: {e} experts held, but this module {shard.describe()}: its parameters "
                            f"must stay this rank's {shard.local} experts")


def _state(module) -> _State:
    st = _STATES.get(module)
    if st is None:
        shard = _SHARDS.get(module)
        st = (_State(module, shard.name, shard.settings, shard) if shard
              else _State(module, type(module).__name__, Settings()))
        _check_module(module, st.name)
        _STATES[module] = st
    return st


def _fresh(module, st: _State) -> bool:
    if st.refs is None:
        return False
    ps = tuple(getattr(module, n) for n in st.names)  # the names of the build: a renamed set fails the refs
    return all(r() is p for r, p in zip(st.refs, ps)) and st.key == tuple(kw.signature(p) for p in ps)


def _build_weights(module, st: _State) -> None:
    """The kernel's weights (and biases) for the module's current parameters (`weights.kernel_weights`)."""
    _check_module(module, st.name)  # dtype, device or shape may have changed with the weights
    st.w1t = st.w2 = st.b1 = st.b2 = st.key = st.refs = None  # the stale copy goes before the new one is made
    st.held = 0
    got = kw.kernel_weights(module, st.cfg)
    st.w1t, st.w2, st.b1, st.b2, st.held = got.w1t, got.w2, got.b1, got.b2, got.held
    st.names = kw.param_names(module)
    st.dims = kw.dims(module, st.cfg)
    ps = kw.params(module)
    st.refs = tuple(weakref.ref(p) for p in ps)
    st.key = tuple(kw.signature(p) for p in ps)
    if st.extra_bytes():
        LOG.info("%s: %.1f MiB of weights held beside the parameters (%s)", st.name, st.extra_bytes() / 2**20,
                 ", ".join(got.copied))


def _buffer(st: _State, module, tokens: int, topk: int) -> MoEBuffer:
    """The module's buffer for a call of `tokens` tokens: at EP = 1 one that grows (by powers of two) up
    to `max_tokens`; on a group one of exactly `max_tokens` tokens per rank, made at `expert_parallel`
    (or at the first call after a dtype or device change, on every rank alike: making one is a
    collective of the group)."""
    e, _, _, hp, ip = kw.dims(module, st.cfg)
    dtype, device = module.gate_up_proj.dtype, module.gate_up_proj.device
    shard = st.shard
    if shard is not None:
        e, want, group = shard.experts, st.settings.max_tokens, shard.group
    else:
        want, group = min(st.settings.max_tokens, max(_MIN_TOKENS, 1 << max(0, tokens - 1).bit_length())), None
    # The stages that fit the module's dtype now (a `.to(float32)` after the first call changes them)
    cfg = st.settings.config or kw.default_config(module)
    key = (e, topk, hp, ip, dtype, device, cfg, id(group), want if shard else None)
    for buf in (st.buf, _BUFFERS.get(key)):
        if buf is not None and (buf.E, buf.K, buf.H, buf.I, buf.dtype, buf.device, buf.cfg) == key[:7] \
                and (buf.T_max == want if shard else buf.loopback and buf.T_max >= want) \
                and (shard is None or buf.group is group and not buf.ctx.closed):
            st.buf = buf
            return buf
    st.buf = None  # a smaller buffer of this module goes before the larger one is made
    try:
        buf = MoEBuffer(want, e, topk, hp, ip, group if shard else LoopbackGroup(1), device=device, dtype=dtype,
                        config=cfg)
    except InputError as exc:
        raise _refuse(st.name, str(exc)) from None
    _BUFFERS[key] = st.buf = buf
    return buf


def _check_call(module, st: _State, x, idx, w) -> None:
    if torch.is_grad_enabled():
        grads = [n for n, t in (("hidden_states", x), ("top_k_weights", w),
                                *zip(kw.param_names(module), kw.params(module)))
                 if t.requires_grad]
        if grads:
            raise _refuse(st.name, f"{grads[0]} requires grad: the xstage experts run forward only (no backward); "
                                   "call the model under torch.no_grad() or torch.inference_mode()")
    p, h = module.gate_up_proj, kw.sizes(module)[1]
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h:
        raise _refuse(st.name, f"hidden_states: expected [tokens, {h}], got {getattr(x, 'shape', x)}")
    want = kw.token_dtype(module)
    if x.dtype != want or x.device != p.device:
        whose = "FP8 experts take" if kw.is_fp8(module) else "the experts' weights"
        raise _refuse(st.name, f"hidden_states: {x.dtype} on {x.device}, {whose} {want} on {p.device}: they must "
                               "match (no silent cast)")
    if idx.dim() != 2 or tuple(w.shape) != tuple(idx.shape) or idx.shape[0] != x.shape[0]:
        raise _refuse(st.name, f"top_k_index, top_k_weights: expected [{x.shape[0]}, K] each, got "
                               f"{tuple(idx.shape)} and {tuple(w.shape)}")
    if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise _refuse(st.name, f"top_k_weights: dtype {w.dtype}; expected fp32, fp16 or bf16")


def _epilogue(module, st: _State) -> dict:
    """`fused_moe`'s biases and activation for the module, read at each call: `alpha` and `limit` are
    plain attributes, which no weight signature follows."""
    activation, why = kw.activation(module)
    if why:
        raise _refuse(st.name, f"the fused kernel cannot honour {why}")
    return dict(b1=st.b1, b2=st.b2, activation=activation)


def _run(module, hidden_states, top_k_index, top_k_weights):
    st = _state(module)
    if st.shard is not None:
        return _run_sharded(module, st, hidden_states, top_k_index, top_k_weights)
    _check_call(module, st, hidden_states, top_k_index, top_k_weights)
    if not _fresh(module, st):
        _build_weights(module, st)
    _, h, _, hp, _ = st.dims
    tokens, topk = top_k_index.shape
    if tokens == 0:
        return torch.zeros_like(hidden_states)
    if _choice(module, st, hidden_states, tokens, topk) == "grouped_mm":
        return _grouped_mm(module, hidden_states, top_k_index, top_k_weights)
    buf = _buffer(st, module, tokens, topk)
    x = hidden_states.contiguous()
    if hp != h:
        x = torch.nn.functional.pad(x, (0, hp - h))  # zero columns meet the weights' zero columns
    idx = top_k_index.contiguous()
    # The kernel reads float32 or the output's dtype (and widens it, exactly): no cast launch for those.
    w = (top_k_weights if top_k_weights.dtype in (torch.float32, buf.out_dtype)
         else top_k_weights.to(torch.float32)).contiguous()
    w1, w2 = st.w1t, st.w2
    kwargs = {} if st.settings.schedule is None else {"schedule": st.settings.schedule}
    kwargs.update(_epilogue(module, st))
    outs = []
    for s in range(0, tokens, buf.T_max):
        sl = slice(s, min(tokens, s + buf.T_max))
        outs.append(fused_moe(x[sl], idx[sl], w[sl], w1, w2, buf, w1_layout="concatenated", **kwargs))
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return y[:, :h].contiguous() if hp != h else y


def _choice(module, st: _State, x, tokens: int, topk: int) -> str:
    """The kernel of this call (module docstring, step 3)."""
    if st.settings.kernel == "fused" or st.names[2:3] == kw.SCALES[:1]:  # FP8 experts: scales follow the weights
        return "fused"
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    d = st.choices.get((tokens, capturing))
    if d is None:
        if len(st.choices) >= _CHOICES_KEPT:
            st.choices.clear()
        e, h, i = st.dims[:3]
        gpu = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
        d = st.choices[(tokens, capturing)] = choose_experts(
            f"H{h}-I{i}-E{e}-K{topk}", tokens, dtype=dtype_name(module.gate_up_proj.dtype), gpu=gpu,
            graph=capturing, calls=st.settings.calls)
    return d.choice


def _grouped_mm(module, hidden_states, top_k_index, top_k_weights):
    """transformers' own `grouped_mm` experts forward on the module's parameters, as the planner chose."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS.get_interface("grouped_mm", None)(module, hidden_states, top_k_index, top_k_weights)


def decisions(model) -> dict[str, dict[tuple[int, bool], Decision]]:
    """The kernel choices made so far for each experts module of `model` that runs `"xstage"`, by name:
    `{(tokens, under CUDA-graph capture): Decision}` (`Decision.choice`: "fused" or "grouped_mm")."""
    return {name: dict(_STATES[m].choices) for name, m in model.named_modules() if m in _STATES}


# The argument a rank refuses on behalf of the group (`CommContext.refuse`'s names), by the first word
# of the refusal.
_GROUP_ARGS = {"hidden_states": "x", "top_k_index": "topk_idx", "top_k_weights": "topk_weights",
               "gate_up_proj": "w1t", "down_proj": "w2", "max_tokens": "tokens"}


def _run_sharded(module, st: _State, hidden_states, top_k_index, top_k_weights):
    """One experts call on a group: exactly one `fused_moe` call, which dispatches each token's rows to
    the ranks owning its experts and combines them back. A refusal of this rank's call (its own tokens,
    routing, gradients) stops the call on every rank rather than leaving the peers at the barrier."""
    shard = st.shard
    if not _fresh(module, st):
        _build_weights(module, st)  # a change of the weights is every rank's: a refusal here is every rank's
    _, h, _, hp, _ = kw.dims(module, st.cfg)
    buf = _buffer(st, module, 0, shard.topk)
    try:
        _check_call(module, st, hidden_states, top_k_index, top_k_weights)
        if top_k_index.shape[1] != shard.topk:
            raise _refuse(st.name, f"top_k_index: top-{top_k_index.shape[1]}, the group's buffer takes "
                                   f"top-{shard.topk} (config.num_experts_per_tok)")
        if hidden_states.shape[0] > buf.T_max:
            raise _refuse(st.name, f"max_tokens: {hidden_states.shape[0]} tokens in one call on rank {shard.rank}, "
                                   f"over expert_parallel's max_tokens={buf.T_max} (every rank's buffer holds that "
                                   "many; pass a larger max_tokens, or feed fewer tokens per forward)")
        epilogue = _epilogue(module, st)
    except InputError as exc:
        arg = str(exc)[len(st.name) + 2:].split(" ", 1)[0].rstrip(":,")
        buf.ctx.refuse(_GROUP_ARGS.get(arg, "x"))  # the peers' call stops at its barrier, naming this rank
        raise
    x = hidden_states.contiguous()
    if hp != h:
        x = torch.nn.functional.pad(x, (0, hp - h))  # zero columns meet the weights' zero columns
    kwargs = {} if st.settings.schedule is None else {"schedule": st.settings.schedule}
    kwargs.update(epilogue)
    y = fused_moe(x, top_k_index.contiguous(), top_k_weights.to(torch.float32).contiguous(), st.w1t, st.w2, buf,
                  w1_layout="concatenated", check=st.settings.check, **kwargs)
    return y[:, :h].contiguous() if hp != h else y


def _on_device(device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _eager_under_compile(fn):
    """Under torch.compile the experts call runs eagerly, a graph break on each side: it plans on the
    host and launches Triton kernels with Python state (the buffer, the cached weights)."""
    reason = "xstage's fused MoE call runs eagerly between compiled graphs"
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # torch releases before `reason=`
        return torch.compiler.disable(fn)


@_eager_under_compile
def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts forward (`ExpertsInterface`) on xstage's fused layer: `hidden_states [T, H]`,
    the block's routing `top_k_index`, `top_k_weights [T, K]` -> `[T, H]` in the weights' dtype."""
    with _on_device(self.gate_up_proj.device):  # the kernels launch on the current CUDA device
        return _run(self, hidden_states, top_k_index, top_k_weights)


@_eager_under_compile
def _fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The same, for transformers' fine-grained FP8 experts (`FP8ExpertsInterface`): BF16 tokens in and
    out, the checkpoint's e4m3 weights and 128x128 scales read in place by the FP8 fused layer."""
    with _on_device(self.gate_up_proj.device):
        return _run(self, hidden_states, top_k_index, top_k_weights)


def _experts_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """The experts modules of `model` set to `experts_implementation="xstage"`: those of transformers'
    experts registry, and experts that bypass it (quantized ones keep no config: they take the setting
    of the nearest module above them that has one), which `_check_module` refuses."""
    impls = {name: m.config._experts_implementation for name, m in model.named_modules()
             if hasattr(getattr(m, "config", None), "_experts_implementation")}

    def impl(name: str):
        while name not in impls and name:
            name = name.rpartition(".")[0]
        return impls.get(name)

    return [(name, m) for name, m in model.named_modules() if impl(name) == NAME and (
        hasattr(m, "is_transposed") or (type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj")))]


def make_settings(config, schedule, max_tokens, check="async", kernel="auto", calls=None) -> Settings:
    """`Settings` from a caller's arguments, each checked (one `InputError` line naming it)."""
    if config is not None:
        check_instance(config, "config", BlockConfig, "a BlockConfig or None")
    if schedule is not None:
        check_schedule(schedule)
    if not (isinstance(kernel, str) and kernel in KERNELS):
        raise InputError(f"kernel={kernel!r:.40}: must be one of {', '.join(map(repr, KERNELS))}")
    if calls is not None:
        check_instance(calls, "calls", ExpertsCalls, "an ExpertsCalls (xstage.sched.experts) or None")
    return Settings(config, schedule, check_int(max_tokens, "max_tokens", 1, MAX_TOKENS_PER_RANK,
                                                "tokens of one kernel call"), check_mode(check), kernel, calls)


def served_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """`_experts_modules`, or one `InputError` line when the model has none."""
    found = _experts_modules(model)
    if not found:
        raise InputError("model: no experts module runs experts_implementation='xstage' (register(), then "
                         "model.set_experts_implementation('xstage'))")
    return found


def prepare(model, *, config: BlockConfig | None = None, schedule: str | None = None,
            max_tokens: int = DEFAULT_MAX_TOKENS, kernel: str = "auto", calls: ExpertsCalls | None = None) -> list[str]:
    """Check every experts module of `model` that runs `"xstage"`, and build its weights now; returns
    their names. Without it the same happens at each module's first call, and errors name the class
    rather than the module. `config` (a `BlockConfig`), `schedule`, `max_tokens`, `kernel` and `calls`
    are `Settings`."""
    require_transformers()
    check_instance(model, "model", torch.nn.Module, "a transformers model")
    settings = make_settings(config, schedule, max_tokens, kernel=kernel, calls=calls)
    found = served_modules(model)
    states = []
    for name, m in found:  # every module is checked before any is changed
        if m in _SHARDS:
            raise _refuse(name, f"{_SHARDS[m].describe()}: its settings are expert_parallel's (call prepare "
                                "before expert_parallel, or not at all)")
        _check_module(m, name)
        states.append((m, _State(m, name, settings)))
    for m, st in states:
        _STATES[m] = st  # a state from an earlier call or prepare goes first, and its copy with it
        with _on_device(m.gate_up_proj.device):
            _build_weights(m, st)
    return [name for name, _ in found]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind `t`: all of it stays allocated while a view of part of it lives."""
    return t.untyped_storage().nbytes()


def memory(model) -> Memory:
    """Bytes xstage holds for `model`'s experts: weight copies and buffers (each buffer counted once),
    and the expert parameters of the modules it serves, as this rank holds them."""
    served = [m for m in model.modules() if m in _STATES]
    states = [_STATES[m] for m in served]
    bufs = {id(st.buf): st.buf for st in states if st.buf is not None}
    experts = sum(_nbytes(p) for m in served for p in kw.params(m))
    return Memory(sum(st.extra_bytes() for st in states), sum(b.total_bytes() for b in bufs.values()), len(states),
                  experts)


def release(model) -> None:
    """Drop the weight copies, buffers and settings xstage holds for `model` (rebuilt at the next call).
    A module sharded by `expert_parallel` stays sharded, with its settings; its group's buffers are freed
    once no module uses them, so every rank of the group must call `release` alike (the next call makes
    them again, a collective)."""
    dropped = [st for st in (_STATES.pop(m, None) for m in model.modules()) if st is not None]
    kept = {id(st.buf) for st in list(_STATES.values())}
    for buf in {id(st.buf): st.buf for st in dropped if st.shard is not None and st.buf is not None}.values():
        if id(buf) not in kept:
            buf.ctx.close()  # its shared memory goes now, not when the last reference happens to go
