"""xstage's fused MoE layer as a transformers experts backend: `experts_implementation="xstage"`.

Problem: a transformers 5 MoE block computes its router output (`top_k_index`, `top_k_weights`) and
hands it, with the tokens, to its experts module, whose forward is looked up by name in transformers'
experts registry (`ExpertsInterface`). This module adds the name `"xstage"` there: every experts
module of a model set to it then runs `fused_moe` on a group of one (EP = 1) with the block's own
routing and weights. The router, the shared experts (DeepSeek-V3) and everything else stay
transformers' own.

Algorithm, per experts module:
1. Once (at `prepare` or the module's first call): check what the kernel can honour and refuse the
   rest by name (one `InputError` line, before any kernel runs): weights `gate_up_proj [E, 2I, H]`
   (gate rows, then up rows) and `down_proj [E, H, I]` in fp16, bf16 or fp32, a plain SwiGLU (SiLU
   gate), no biases, no transposed or row-interleaved layout, no quantized weights.
2. Once per weight version: the kernel reads `gate_up_proj` in place, in transformers' own `[gate; up]`
   layout (`fused_moe(w1_layout="concatenated")`), and `down_proj` as it is: no copy. Where hidden or
   intermediate is not a multiple of the kernel's tiles, a zero-padded copy of both is made in the same
   layouts (zero rows and columns add nothing, so the result is the unpadded one). A copy is cached; it
   is rebuilt when a weight's identity, storage, version counter (in-place writes such as
   `load_state_dict`), dtype, device or shape changes (`.to()`, `.half()`). The parameters are never
   touched, so `state_dict` and `save_pretrained` write the original layout.
3. Per call: pad the tokens' hidden size if needed, `fused_moe` in chunks of at most `max_tokens`
   tokens on a buffer shared by the model's blocks of one shape, cut the padding off.

Memory: no weight is held twice unless hidden or intermediate needs padding (or a parameter is not
contiguous). `memory(model)` reports the copies' and the buffers' bytes; a log line at INFO on the
logger `xstage.integrations.transformers` names each copy as it is made.

Importing this module registers nothing (a registry of another library is written only when asked):
call `register()` before `from_pretrained(..., experts_implementation="xstage")` or
`model.set_experts_implementation("xstage")`.

Example (CPU: Triton's interpreter, a tiny random model):
    >>> import torch
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from xstage.integrations import transformers as xt
    >>> from xstage.moe import BlockConfig
    >>> xt.register()
    >>> cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
    ...                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    ...                      num_experts=4, num_experts_per_tok=2)
    >>> model = Qwen3MoeForCausalLM(cfg).eval()
    >>> model.set_experts_implementation("xstage")
    >>> xt.prepare(model, config=BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32))
    ['model.layers.0.mlp.experts']
    >>> with torch.no_grad():
    ...     model(torch.tensor([[1, 2, 3]])).logits.shape
    torch.Size([1, 3, 64])
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import re
import weakref
from dataclasses import dataclass

import torch

from xstage.backend import refuse_interpreter_bf16
from xstage.bounds import check_instance, check_int
from xstage.dtypes import DTYPES
from xstage.errors import InputError, XstageError
from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer, fused_moe
from xstage.spec.moe import MAX_TOKENS_PER_RANK
from xstage.spec.schedule import check_schedule

NAME = "xstage"
EXTRA = "xstage[transformers]"
# The transformers releases this module was tested against: pyproject's `transformers` extra, kept equal.
TESTED = ((5, 17), (5, 18))  # [low, high)
DEFAULT_MAX_TOKENS = 4096  # tokens per fused_moe call; longer calls run in chunks (the buffer grows to this)
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
    """Register `"xstage"` in transformers' experts registry (idempotent). The FP8 experts registry gets
    the name too, for a refusal that names the module (FP8 checkpoints do not run here yet)."""
    require_transformers()
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)
    FP8ExpertsInterface.register(NAME, _fp8_experts_forward)


@dataclass(frozen=True)
class Settings:
    """How a module's experts run: the kernel's tiles (`config`, None: `BlockConfig()`), the order
    (`schedule`, None: `fused_moe`'s default) and the most tokens of one kernel call (`max_tokens`)."""

    config: BlockConfig | None = None
    schedule: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS


@dataclass(frozen=True)
class Memory:
    """Bytes xstage holds for a model: the weight copies in the kernel's layout (`weights`), the MoE
    buffers (`buffers`, shared by blocks of one shape), and how many experts modules it serves."""

    weights: int
    buffers: int
    modules: int


class _State:
    """What one experts module keeps: its name, settings and shape, the cached weights and their key."""

    def __init__(self, name: str, settings: Settings):
        self.name, self.settings = name, settings
        self.cfg = settings.config or BlockConfig()
        self.key = None  # the weights' signatures when w1t was built
        self.refs = None  # weak references to the parameters w1t was built from
        # What the kernel reads: detached aliases of the parameters, or padded copies. One object per weight
        # version, so the launcher's TMA descriptors (kept while the tensor lives) are built once.
        self.w1t = self.w2 = None
        self.held = 0  # bytes of those that are copies, not aliases
        self.buf: MoEBuffer | None = None

    def extra_bytes(self) -> int:
        return self.held


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # experts module -> _State
# One buffer per shape, dtype, device and tiles: blocks of a model run one after another on one stream,
# and a buffer resets its counters after every call, so they share it. Held by the states using it.
_BUFFERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _refuse(name: str, what: str) -> InputError:
    return InputError(f"{name}: {what}")


def _round_up(v: int, *blocks: int) -> int:
    step = math.lcm(*blocks)
    return -(-v // step) * step


def _dims(module, cfg: BlockConfig):
    """(E, H, I, H padded, I padded): the padded sizes are the multiples of the tiles `MoEBuffer` asks
    for (hidden: block_k, block_d and 16-byte rows; intermediate: block_n1 and block_k)."""
    e, two_i, h = module.gate_up_proj.shape
    i = two_i // 2
    return e, h, i, _round_up(h, cfg.block_k, cfg.block_d, 8), _round_up(i, cfg.block_n1, cfg.block_k)


def _check_module(module, name: str) -> None:
    """Refuse, in one line naming the module, everything about it the fused kernel cannot honour."""
    require_transformers()
    from transformers.activations import SiLUActivation
    from transformers.integrations import moe as tf_moe

    if not hasattr(module, "is_transposed"):
        raise _refuse(name, f"{type(module).__name__} is not dispatched through transformers' experts registry "
                            "(e.g. MXFP4 or other quantized experts); xstage cannot serve it")
    why = []
    if getattr(module, "is_transposed", False):
        why.append("is_transposed=True (weights stored [E, H, 2I] / [E, I, H]; xstage takes [E, 2I, H] / [E, H, I])")
    if not getattr(module, "is_concatenated", True):
        why.append("is_concatenated=False (gate and up rows interleaved one by one; xstage takes gate rows, then up)")
    if getattr(module, "has_bias", False):
        why.append("has_bias=True (gate_up_proj_bias, down_proj_bias: the kernel adds no bias)")
    if not getattr(module, "has_gate", True):
        why.append("has_gate=False (up_proj only: the kernel computes a gated SwiGLU)")
    if getattr(type(module), "_apply_gate", None) is not tf_moe._default_apply_gate:
        extra = ", ".join(f"{k}={getattr(module, k)}" for k in ("alpha", "limit") if hasattr(module, k))
        why.append(f"_apply_gate: its own gated activation{f' ({extra})' if extra else ''}; the kernel computes "
                   "silu(gate) * up")
    elif not isinstance(getattr(module, "act_fn", None), (torch.nn.SiLU, SiLUActivation)):
        why.append(f"act_fn={type(getattr(module, 'act_fn', None)).__name__}: the kernel's gate activation is SiLU")
    if why:
        raise _refuse(name, "the fused kernel cannot honour " + "; ".join(why))
    for p in ("gate_up_proj", "down_proj"):
        t = getattr(module, p, None)
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = getattr(t, "shape", type(t).__name__)
            raise _refuse(name, f"{p}: expected a 3-d expert weight tensor, got {got}")
        if type(t).__name__ == "DTensor" or t.is_meta:
            raise _refuse(name, f"{p}: a DTensor or meta tensor (transformers' own tensor or expert parallelism, or "
                                "weights not loaded); xstage runs whole experts on one device")
        if t.dtype not in DTYPES.values():
            kind = "quantized weights" if t.dtype.itemsize == 1 else "the kernels take fp16, bf16 or fp32"
            raise _refuse(name, f"{p}: dtype {t.dtype} ({kind}; FP8 and MXFP4 experts do not run here yet)")
    e, two_i, h = module.gate_up_proj.shape
    if two_i % 2 or tuple(module.down_proj.shape) != (e, h, two_i // 2):
        raise _refuse(name, f"down_proj: shape {tuple(module.down_proj.shape)} does not match gate_up_proj "
                            f"{tuple(module.gate_up_proj.shape)} ([E, H, I] for [E, 2I, H])")
    if getattr(module, "num_experts", e) != e:
        raise _refuse(name, f"gate_up_proj: {e} experts held of num_experts={module.num_experts} (sharded by "
                            "transformers' expert parallelism; xstage runs every expert of the block here)")
    if module.gate_up_proj.dtype != module.down_proj.dtype or module.gate_up_proj.device != module.down_proj.device:
        raise _refuse(name, f"down_proj: {module.down_proj.dtype} on {module.down_proj.device}, gate_up_proj "
                            f"{module.gate_up_proj.dtype} on {module.gate_up_proj.device}: they must match")
    try:
        refuse_interpreter_bf16(module.gate_up_proj.dtype, "gate_up_proj dtype")
    except InputError as exc:
        raise _refuse(name, str(exc)) from None


def _state(module) -> _State:
    st = _STATES.get(module)
    if st is None:
        st = _State(type(module).__name__, Settings())
        _check_module(module, st.name)
        _STATES[module] = st
    return st


def _signature(p: torch.Tensor) -> tuple:
    try:
        version = p._version
    except RuntimeError:  # an inference tensor keeps no version counter (and cannot be written outside one)
        version = -1
    return (p.data_ptr(), version, p.dtype, p.device, tuple(p.shape), p.stride())


def _fresh(module, st: _State) -> bool:
    params = (module.gate_up_proj, module.down_proj)
    return (st.refs is not None and all(r() is p for r, p in zip(st.refs, params))
            and st.key == tuple(_signature(p) for p in params))


def _build_weights(module, st: _State) -> None:
    """The kernel's weights for the module's current parameters: the parameters themselves (`w1t`, `w2`
    None), or zero-padded copies in the same layouts where the sizes are off the tiles."""
    _check_module(module, st.name)  # dtype, device or shape may have changed with the weights
    st.w1t = st.w2 = st.key = st.refs = None  # the stale copy goes before the new one is made
    st.held = 0
    l1, l2 = module.gate_up_proj.detach(), module.down_proj.detach()
    e, h, i, hp, ip = _dims(module, st.cfg)
    if (hp, ip) == (h, i):
        st.w1t, st.w2 = l1.contiguous(), l2.contiguous()  # aliases, unless a parameter is not contiguous
        st.held = sum(t.numel() * t.element_size() for t, p in ((st.w1t, l1), (st.w2, l2))
                      if t.data_ptr() != p.data_ptr())
    else:
        # Zero rows and columns: the padded hidden columns meet zero inputs, the padded intermediate
        # rows give silu(0) * 0 = 0 activations, and down_proj's padded rows are cut off the output.
        w1 = torch.zeros(e, 2 * ip, hp, dtype=l1.dtype, device=l1.device)
        w1[:, :i, :h] = l1[:, :i]
        w1[:, ip:ip + i, :h] = l1[:, i:]
        w2 = torch.zeros(e, hp, ip, dtype=l2.dtype, device=l2.device)
        w2[:, :h, :i] = l2
        st.w1t, st.w2 = w1, w2
        st.held = sum(t.numel() * t.element_size() for t in (w1, w2))
    st.refs = (weakref.ref(module.gate_up_proj), weakref.ref(module.down_proj))
    st.key = tuple(_signature(p) for p in (module.gate_up_proj, module.down_proj))
    if st.extra_bytes():
        LOG.info("%s: %.1f MiB of weights held beside the parameters (%s)", st.name, st.extra_bytes() / 2**20,
                 "padded to the kernel's tiles" if (hp, ip) != (h, i) else "contiguous copies")


def _buffer(st: _State, module, tokens: int, topk: int) -> MoEBuffer:
    e, _, _, hp, ip = _dims(module, st.cfg)
    dtype, device = module.gate_up_proj.dtype, module.gate_up_proj.device
    key = (e, topk, hp, ip, dtype, device, st.cfg)
    want = min(st.settings.max_tokens, max(_MIN_TOKENS, 1 << max(0, tokens - 1).bit_length()))
    for buf in (st.buf, _BUFFERS.get(key)):
        if buf is not None and (buf.E, buf.K, buf.H, buf.I, buf.dtype, buf.device, buf.cfg) == key \
                and buf.T_max >= want:
            st.buf = buf
            return buf
    st.buf = None  # a smaller buffer of this module goes before the larger one is made
    try:
        buf = MoEBuffer(want, e, topk, hp, ip, LoopbackGroup(1), device=device, dtype=dtype, config=st.cfg)
    except InputError as exc:
        raise _refuse(st.name, str(exc)) from None
    _BUFFERS[key] = st.buf = buf
    return buf


def _check_call(module, st: _State, x, idx, w) -> None:
    if torch.is_grad_enabled():
        grads = [n for n, t in (("hidden_states", x), ("top_k_weights", w), ("gate_up_proj", module.gate_up_proj),
                                ("down_proj", module.down_proj)) if t.requires_grad]
        if grads:
            raise _refuse(st.name, f"{grads[0]} requires grad: the xstage experts run forward only (no backward); "
                                   "call the model under torch.no_grad() or torch.inference_mode()")
    p = module.gate_up_proj
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != p.shape[2]:
        raise _refuse(st.name, f"hidden_states: expected [tokens, {p.shape[2]}], got {getattr(x, 'shape', x)}")
    if x.dtype != p.dtype or x.device != p.device:
        raise _refuse(st.name, f"hidden_states: {x.dtype} on {x.device}, the experts' weights {p.dtype} on "
                               f"{p.device}: they must match (no silent cast)")
    if idx.dim() != 2 or tuple(w.shape) != tuple(idx.shape) or idx.shape[0] != x.shape[0]:
        raise _refuse(st.name, f"top_k_index, top_k_weights: expected [{x.shape[0]}, K] each, got "
                               f"{tuple(idx.shape)} and {tuple(w.shape)}")
    if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise _refuse(st.name, f"top_k_weights: dtype {w.dtype}; expected fp32, fp16 or bf16")


def _run(module, hidden_states, top_k_index, top_k_weights):
    st = _state(module)
    _check_call(module, st, hidden_states, top_k_index, top_k_weights)
    if not _fresh(module, st):
        _build_weights(module, st)
    _, h, _, hp, _ = _dims(module, st.cfg)
    tokens, topk = top_k_index.shape
    if tokens == 0:
        return torch.zeros_like(hidden_states)
    buf = _buffer(st, module, tokens, topk)
    x = hidden_states.contiguous()
    if hp != h:
        x = torch.nn.functional.pad(x, (0, hp - h))  # zero columns meet the weights' zero columns
    idx = top_k_index.contiguous()
    w = top_k_weights.to(torch.float32).contiguous()  # fp16/bf16 to fp32 is exact
    w1, w2 = st.w1t, st.w2
    kwargs = {} if st.settings.schedule is None else {"schedule": st.settings.schedule}
    outs = []
    for s in range(0, tokens, buf.T_max):
        sl = slice(s, min(tokens, s + buf.T_max))
        outs.append(fused_moe(x[sl], idx[sl], w[sl], w1, w2, buf, w1_layout="concatenated", **kwargs))
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
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


def _fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    raise _refuse(type(self).__name__, "FP8 experts (fine-grained FP8 checkpoints) do not run on xstage's backend "
                                       "yet; load with another experts_implementation")


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


def prepare(model, *, config: BlockConfig | None = None, schedule: str | None = None,
            max_tokens: int = DEFAULT_MAX_TOKENS) -> list[str]:
    """Check every experts module of `model` that runs `"xstage"`, and build its weights now; returns
    their names. Without it the same happens at each module's first call, and errors name the class
    rather than the module. `config` (a `BlockConfig`), `schedule` and `max_tokens` are `Settings`."""
    require_transformers()
    check_instance(model, "model", torch.nn.Module, "a transformers model")
    if config is not None:
        check_instance(config, "config", BlockConfig, "a BlockConfig or None")
    if schedule is not None:
        check_schedule(schedule)
    settings = Settings(config, schedule, check_int(max_tokens, "max_tokens", 1, MAX_TOKENS_PER_RANK,
                                                    "tokens of one kernel call"))
    found = _experts_modules(model)
    if not found:
        raise InputError("model: no experts module runs experts_implementation='xstage' (register(), then "
                         "model.set_experts_implementation('xstage'))")
    states = []
    for name, m in found:  # every module is checked before any is changed
        _check_module(m, name)
        states.append((m, _State(name, settings)))
    for m, st in states:
        _STATES[m] = st  # a state from an earlier call or prepare goes first, and its copy with it
        with _on_device(m.gate_up_proj.device):
            _build_weights(m, st)
    return [name for name, _ in found]


def memory(model) -> Memory:
    """Bytes xstage holds for `model`'s experts: weight copies and buffers (each buffer counted once)."""
    states = [_STATES[m] for m in model.modules() if m in _STATES]
    bufs = {id(st.buf): st.buf for st in states if st.buf is not None}
    return Memory(sum(st.extra_bytes() for st in states), sum(b.total_bytes() for b in bufs.values()), len(states))


def release(model) -> None:
    """Drop the weight copies, buffers and settings xstage holds for `model` (rebuilt at the next call)."""
    for m in model.modules():
        _STATES.pop(m, None)
