"""`xstage.attention`: Triton FlashAttention forward and Ulysses attention with the fused exchange.

- `flash_attention(q, k, v, *, softmax_scale, kv_lens, out, config)`: non-causal, `[B, S, H, D]`.
- `ulysses_attention(q, k, v, group=None, *, softmax_scale, mode="fused"|"serial", comm, seq_lens)`
  and `UlyssesAttention` (`nn.Module`, yunchang's layout and call signature).
- `attention_reference`, `ulysses_reference`: plain-torch ground truth.
"""

from xstage.attention.flash import FlashConfig, default_config, flash_attention
from xstage.attention.reference import attention_reference, ulysses_reference
from xstage.attention.ulysses import UlyssesAttention, ulysses_attention

__all__ = [
    "FlashConfig", "UlyssesAttention", "attention_reference", "default_config", "flash_attention",
    "ulysses_attention", "ulysses_reference",
]
