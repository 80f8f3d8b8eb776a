"""The MoE bench code path (fused schedules, unfused pipeline, CSV, summary) on a tiny CPU problem."""

import pytest
import torch

from xstage.bench.moe import COLUMNS, KEYS, grid_configs, run_config
from xstage.bench.moe_summary import summarize
from xstage.errors import InputError
from xstage.moe import BlockConfig
from xstage.moe.problem import parse_block
from xstage.results.io import ResultWriter, read_rows


def test_grid_has_84_plus_8_configurations():
    cfgs = grid_configs()
    assert len([c for c in cfgs if c["ep"] > 1]) == 84 and len([c for c in cfgs if c["ep"] == 1]) == 8


def test_run_config_writes_rows_and_summary(tmp_path):
    cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
    writer = ResultWriter(tmp_path / "moe.csv", COLUMNS, KEYS, env={"gpu": "none"})
    for ep in (1, 2):
        row = dict(shape=(64, 32, 4, 2), tokens=12, ep=ep, config=cfg, device="cpu", dtype=torch.float16)
        run_config(row, "host", ("expert_wave", "lag:1"), writer, warmup=0, rep=1, log=lambda m: None)
    rows = read_rows(tmp_path / "moe.csv")
    variants = [(int(r["ep"]), r["variant"]) for r in rows]
    assert variants == [(1, "expert_wave"), (1, "lag:1"), (1, "unfused"), (1, "chain"),
                        (2, "expert_wave"), (2, "lag:1"), (2, "unfused")]
    for r in rows:
        if r["max_err"]:
            assert float(r["max_err"]) < 2e-2  # fused vs the unfused pipeline on the same routing
    assert float(rows[0]["speedup"]) == 1.0
    for r in rows:
        if r["variant"] not in ("unfused", "chain"):
            assert float(r["time_p10_ns"]) <= float(r["time_ns"]) <= float(r["time_p90_ns"])
    summary = summarize(tmp_path)
    assert summary["host"]["lag:1"]["configs"] == 1 and (tmp_path / "summary.md").exists()


def test_pacing_variants_get_their_own_rows_and_section(tmp_path):
    cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
    writer = ResultWriter(tmp_path / "moe.csv", COLUMNS, KEYS, env={"gpu": "none"})
    row = dict(shape=(64, 32, 4, 2), tokens=12, ep=2, config=cfg, device="cpu", dtype=torch.float16)
    run_config(row, "host", ("expert_wave", "lag:1", "expert_wave@off", "lag:1@off", "lag:1@40:512"), writer,
               warmup=0, rep=3, log=lambda m: None)
    rows = {r["variant"]: r for r in read_rows(tmp_path / "moe.csv")}
    assert float(rows["expert_wave@off"]["speedup"]) == 1.0  # each pacing against its own expert_wave
    assert rows["lag:1@40:512"]["speedup"] == "" and float(rows["lag:1@40:512"]["max_err"]) < 2e-2
    summarize(tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert "Store pacing" in text and "| lag:1 | 40:512 | 1 |" in text
    assert "Best paced schedule per configuration over unpaced `expert_wave`" in text
    with pytest.raises(InputError, match="pacing"):
        run_config(row, "host", ("lag:1@fast",), None, warmup=0, rep=1, log=lambda m: None)


def test_parse_block_reads_variant_flags_and_fits_bn2():
    c = parse_block("128:128:256:64:8:4", 1152)
    assert (c.block_n2, c.block_d, c.num_stages, c.tma, c.dynamic) == (128, 128, 4, True, True)
    c = parse_block("64:128:256:64:4:3:-", 4096)
    assert (c.block_m, c.block_n2, c.block_d, c.tma, c.dynamic) == (64, 256, 512, False, False)
    assert parse_block("64:128:256:64:4:3:t", 4096).dynamic is False
    for bad in ("64:128:256:64:4", "64:128:256:64:4:3:x", "a:128:256:64:4:3"):
        with pytest.raises(InputError, match="block"):
            parse_block(bad, 4096)
