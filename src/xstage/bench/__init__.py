"""Benchmark grids and their reports: the fused MoE kernel and Ulysses attention against their
baselines, on one GPU (loopback groups) or on real groups under torchrun (`moe_dist`, `ulysses_dist`).

The grids write long-format CSV through `xstage.results`; `xstage bench <grid>` runs them.
"""
