"""`xstage.attention`: Triton FlashAttention forward and Ulysses attention with its exchanges.

- `flash_attention(q, k, v, *, softmax_scale, kv_lens, out, config)`: non-causal, `[B, S, H, D]`.
- `ulysses_attention(q, k, v, group=None, *, softmax_scale, exchange="auto", comm, seq_lens)` and
  `UlyssesAttention` (`nn.Module`, yunchang's layout and call signature); `exchange` spellings in
  `xstage.attention.exchange` (`Exchange`, `parse_exchange`).
- `torch.ops.xstage.ulysses_attention(q, k, v, group_name, softmax_scale, exchange)`: the custom op
  (fake implementation; `torch.compile` and CUDA graphs); `register_comm(name, ctx)` names a context.
- `attention_reference`, `ulysses_reference`: plain-torch ground truth.
"""

from xstage.backend import select

select()  # before this package's kernels are defined: Triton's interpreter where no GPU exists

from xstage.attention.flash import FlashConfig, default_config, flash_attention  # noqa: E402
from xstage.attention.ops import register_comm, ulysses_attention_op  # noqa: E402
from xstage.attention.reference import attention_reference, ulysses_reference  # noqa: E402
from xstage.attention.ulysses import UlyssesAttention, ulysses_attention  # noqa: E402
from xstage.spec.exchange import Exchange, parse_exchange  # noqa: E402

__all__ = [
    "Exchange", "FlashConfig", "UlyssesAttention", "attention_reference", "default_config", "flash_attention",
    "parse_exchange", "register_comm", "ulysses_attention", "ulysses_attention_op", "ulysses_reference",
]
