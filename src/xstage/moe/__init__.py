"""MegaMoE in Triton: an expert-parallel MoE layer as one persistent kernel whose task order is a table.

Public pieces: `MoEBuffer` (context), `transform_weights` (weight layout), `reference_moe_virtual`
and `reference_moe_dist` (plain torch ground truth), `make_schedule` (expert_wave, interleaved,
lag:k) and `register_schedule`, `Variant` (schedule plus store pacing), `resolve_pacing`,
`MoEDecision` (what `model_guided` and `pacing="auto"` run per token bucket: `MoEBuffer.decisions()`,
`force_decision`), `fused_moe` (the fused layer), `MoeShape` / `Problem` (problem definitions),
`torch.ops.xstage.moe_fused` (custom op, after importing `xstage.moe.op`), `ClampedSwiGLU` (GPT-OSS's
activation for `fused_moe(..., activation=)`, beside expert biases `b1`, `b2`). `model_guided` and
`pacing="auto"` are the planner's decisions, asked of `xstage.sched.policy` per token bucket.

FP8 (in progress; the fused kernel is BF16 only): `quantize_activations`, `quantize_weights` and
their inverses, `check_fp8_activations`, `check_fp8_weights` and `reference_moe_fp8`, the
FP8-emulating reference (`xstage.moe.fp8`).
"""

from xstage.backend import select

select()  # before this package's kernels are defined: Triton's interpreter where no GPU exists

from xstage.moe.buffer import LoopbackGroup, MoEBuffer  # noqa: E402
from xstage.moe.decision import MoEDecision  # noqa: E402
from xstage.moe.fp8 import (  # noqa: E402
    check_fp8_activations,
    check_fp8_weights,
    dequantize_activations,
    dequantize_weights,
    quantize_activations,
    quantize_weights,
    reference_moe_fp8,
)
from xstage.moe.fused import fused_moe  # noqa: E402
from xstage.moe.layout import routing_layout, transform_weights, untransform_l1  # noqa: E402
from xstage.moe.problem import Problem  # noqa: E402
from xstage.moe.reference import loopback_inputs, reference_moe_dist, reference_moe_virtual  # noqa: E402
from xstage.sched.pacing import resolve_pacing  # noqa: E402
from xstage.spec.activation import ClampedSwiGLU  # noqa: E402
from xstage.spec.moe import (  # noqa: E402
    SHAPES,
    BlockConfig,  # noqa: E402
    MoeShape,
    parse_block,
)
from xstage.spec.schedule import CANDIDATES, Schedule, make_schedule, register_schedule, schedule_names  # noqa: E402
from xstage.spec.variant import Variant, parse_variants  # noqa: E402

__all__ = [
    "CANDIDATES", "SHAPES", "BlockConfig", "ClampedSwiGLU", "LoopbackGroup", "MoEBuffer", "MoEDecision", "MoeShape",
    "Problem",
    "Schedule", "Variant", "check_fp8_activations", "check_fp8_weights", "dequantize_activations", "dequantize_weights",
    "fused_moe", "loopback_inputs", "make_schedule", "parse_block", "parse_variants", "quantize_activations",
    "quantize_weights", "reference_moe_dist", "reference_moe_fp8", "reference_moe_virtual", "register_schedule",
    "resolve_pacing", "routing_layout", "schedule_names", "transform_weights", "untransform_l1",
]
