"""xstage's fused MoE layer inside transformers MoE models: an experts backend, and expert parallelism.

- `register()` adds `"xstage"` to transformers' experts registry: every experts module of a model set
  to `experts_implementation="xstage"` then runs `fused_moe` on its block's routing and weights, on one
  device (EP = 1); `prepare`, `memory` and `release` check, report and free what it holds
  (`xstage.integrations.transformers.backend`).
- `expert_parallel(model, group)` shards those experts over a torch.distributed group; each rank runs
  the model on its own tokens, and the fused kernel sends each token's rows to the ranks owning its
  experts and back (`xstage.integrations.transformers.parallel`).

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

from xstage.integrations.transformers.backend import (
    DEFAULT_MAX_TOKENS,
    EXTRA,
    NAME,
    TESTED,
    Memory,
    Settings,
    Shard,
    decisions,
    experts_forward,
    memory,
    prepare,
    register,
    release,
    require_transformers,
)
from xstage.integrations.transformers.parallel import expert_parallel

__all__ = ["DEFAULT_MAX_TOKENS", "EXTRA", "NAME", "TESTED", "Memory", "Settings", "Shard", "decisions",
           "expert_parallel", "experts_forward", "memory", "prepare", "register", "release", "require_transformers"]
