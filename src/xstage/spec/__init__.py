"""`xstage.spec`: what the planner, the CLI and the kernels must agree on, as data. Nothing here runs
a kernel or imports torch or Triton.

- `moe`: `MoeShape`, `SHAPES`, `BlockConfig` and its spec, the layer's limits, the row pool's size;
- `schedule`: the fused MoE kernel's task orders as tables (`make_schedule`, `CANDIDATES`);
- `pacing`: `StorePacing` and its spellings (`parse_pacing`, `spec_of`, `check_pacing`);
- `variant`: `Variant`, a schedule plus a pacing, `SCHEDULE[@PACING]`;
- `exchange`: `Exchange`, the Ulysses output exchanges and their spellings (`parse_exchange`);
- `ulysses`: `UlyssesPlan`, the head and token split of a Ulysses layer, and `overlap_blocks`;
- `paths`: the store paths (`hbm`, `host`, `peer`).
- `activation`: the experts' gated activation, `"silu"` or `ClampedSwiGLU` (GPT-OSS), and `check_activation`.
"""
