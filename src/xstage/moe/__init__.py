"""MegaMoE in Triton: an expert-parallel MoE layer as one persistent kernel whose task order is a table.

Public pieces: `MoEBuffer` (context), `transform_weights` (weight layout), `reference_moe_virtual`
and `reference_moe_dist` (plain torch ground truth), `make_schedule` (expert_wave, interleaved,
lag:k), `fused_moe` (the fused layer), `torch.ops.xstage.moe_fused` (custom op, after importing
`xstage.moe.op`).
"""

from xstage.moe.buffer import BlockConfig, LoopbackGroup, MoEBuffer
from xstage.moe.fused import fused_moe
from xstage.moe.layout import routing_layout, transform_weights, untransform_l1
from xstage.moe.reference import loopback_inputs, reference_moe_dist, reference_moe_virtual
from xstage.moe.schedule import Schedule, make_schedule, register_schedule

__all__ = [
    "BlockConfig", "LoopbackGroup", "MoEBuffer", "Schedule", "fused_moe", "loopback_inputs", "make_schedule",
    "reference_moe_dist", "reference_moe_virtual", "register_schedule", "routing_layout", "transform_weights",
    "untransform_l1",
]
