"""The MoE bench code path (fused schedules, unfused pipeline, CSV, summary) on a tiny CPU problem."""

import pytest
import torch

from xstage.bench.calls import CALL_COLUMNS, ROUTINGS
from xstage.bench.moe import COLUMNS, KEYS, block_per_dtype, grid_configs, run_config
from xstage.bench.moe_summary import summarize
from xstage.env import interpreter_active
from xstage.errors import InputError
from xstage.moe import BlockConfig
from xstage.results.io import ResultWriter, read_rows
from xstage.spec.moe import parse_block

CALLS = ROUTINGS  # each routing called once: the interpreter runs a call in a tenth of a second


def test_grid_has_84_plus_8_configurations():
    cfgs = grid_configs()
    assert len([c for c in cfgs if c["ep"] > 1]) == 84 and len([c for c in cfgs if c["ep"] == 1]) == 8


def test_decode_grid_has_every_shape_and_group_size_at_decode_token_counts():
    cfgs = grid_configs("decode")
    assert len(cfgs) == 64 and {c["tokens"] for c in cfgs} == {1, 8, 64, 256}
    assert {c["ep"] for c in cfgs} == {1, 2, 4, 8} and len({(c["shape"], c["tokens"], c["ep"]) for c in cfgs}) == 64
    with pytest.raises(InputError, match="--grid 'prefill': must be one of main, decode"):
        grid_configs("prefill")


def test_every_call_of_a_run_gets_a_buffer_for_the_run_s_largest_token_count(tmp_path, monkeypatch):
    import functools

    import xstage.bench.moe as bm

    seen = []
    monkeypatch.setattr(bm, "ResultWriter", functools.partial(ResultWriter, env={"gpu": "none", "git_commit": "abc"}))
    monkeypatch.setattr(bm.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bm.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bm, "run_config", lambda c, *a, **kw: seen.append((c["tokens"], kw["call_tokens"])))
    monkeypatch.setattr(bm, "summarize", lambda out: {})
    bm.run_grid(tmp_path, ["shape=H1152-I4608-E8-K2", "ep=2"], grid="decode", log=lambda m: None)
    assert seen == [(1, 256), (8, 256), (64, 256), (256, 256)]
    seen.clear()
    bm.run_grid(tmp_path, ["shape=H1152-I4608-E8-K2", "ep=2", "tokens=8,64"], grid="decode", log=lambda m: None)
    assert seen == [(8, 64), (64, 64)]


def test_run_config_writes_rows_and_summary(tmp_path):
    cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
    writer = ResultWriter(tmp_path / "moe.csv", COLUMNS, KEYS, env={"gpu": "none"})
    for ep in (1, 2):
        row = dict(shape=(64, 32, 4, 2), tokens=12, ep=ep, config=cfg, device="cpu", dtype=torch.float16)
        run_config(row, "host", ("expert_wave", "lag:1"), writer, warmup=0, rep=1, log=lambda m: None, calls=CALLS)
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
    for r in rows:
        if r["variant"] in ("unfused", "chain"):  # baselines are not calls: no call columns
            assert all(r[c] == "" for c in CALL_COLUMNS + ("reduce_host_ns", "loop_ns")), r
            continue
        assert float(r["call_ns"]) > 0 and float(r["reduce_host_ns"]) > 0 and float(r["loop_ns"]) > 0
        assert float(r["host_p10_ns"]) <= float(r["host_ns"]) <= float(r["host_p90_ns"])
        # Triton launches the interpreter ran for one call: the main kernel and the reduce at least.
        assert float(r["launches"]).is_integer() and int(r["launches"]) >= 2
        assert r["graph_ns"] == "" and "graph: CUDA graphs need a GPU" in r["call_note"] and r["syncs"] == ""
    assert "call / kernels back to back (geomean, max)" in (tmp_path / "summary.md").read_text()
    # The headline speedup is of call times now that both rows have them.
    ew, lag = (float(rows[4 + i]["call_ns"]) for i in range(2))
    assert summary["host"]["lag:1"]["basis"] == "call"
    assert summary["host"]["lag:1"]["geomean"] == pytest.approx(ew / lag)
    assert "## Calls against kernels" in (tmp_path / "summary.md").read_text()


def test_pacing_variants_get_their_own_rows_and_section(tmp_path):
    cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
    writer = ResultWriter(tmp_path / "moe.csv", COLUMNS, KEYS, env={"gpu": "none"})
    row = dict(shape=(64, 32, 4, 2), tokens=12, ep=2, config=cfg, device="cpu", dtype=torch.float16)
    run_config(row, "host", ("expert_wave", "lag:1", "expert_wave@off", "lag:1@off", "lag:1@40:512"), writer,
               warmup=0, rep=3, log=lambda m: None, calls=None)  # the kernels only: the calls are tested above
    rows = {r["variant"]: r for r in read_rows(tmp_path / "moe.csv")}
    assert float(rows["expert_wave@off"]["speedup"]) == 1.0  # each pacing against its own expert_wave
    assert rows["lag:1@40:512"]["speedup"] == "" and float(rows["lag:1@40:512"]["max_err"]) < 2e-2
    summarize(tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert "Store pacing" in text and "| lag:1 | 40:512 | 1 |" in text
    assert "Best paced schedule per configuration over unpaced `expert_wave`" in text
    with pytest.raises(InputError, match="pacing"):
        run_config(row, "host", ("lag:1@fast",), None, warmup=0, rep=1, log=lambda m: None, calls=CALLS)


def test_parse_block_reads_variant_flags_and_fits_bn2():
    c = parse_block("128:128:256:64:8:4", 1152)
    assert (c.block_n2, c.block_d, c.num_stages, c.tma, c.dynamic) == (128, 128, 4, True, True)
    c = parse_block("64:128:256:64:4:3:-", 4096)
    assert (c.block_m, c.block_n2, c.block_d, c.tma, c.dynamic) == (64, 256, 512, False, False)
    assert parse_block("64:128:256:64:4:3:t", 4096).dynamic is False
    c = parse_block("64:128:128:128:4:2:d2", 1152, fp8=True)
    assert (c.block_m, c.num_stages, c.dynamic, c.tma, c.ctas_per_sm) == (64, 2, True, False, 2)
    assert parse_block(None, 1152, fp8=True).block_k == 128 and parse_block(None, 1152).block_k == 64
    for bad in ("64:128:256:64:4", "64:128:256:64:4:3:x", "a:128:256:64:4:3", "64:128:256:64:4:3:d0",
                "64:128:256:64:4:3:2d"):
        with pytest.raises(InputError, match="block"):
            parse_block(bad, 4096)


def test_block_option_per_dtype():
    assert block_per_dtype(None, ["bf16", "fp8"]) == {"bf16": None, "fp8": None}
    assert block_per_dtype("64:128:256:64:4:3", ["bf16"]) == {"bf16": "64:128:256:64:4:3"}
    assert block_per_dtype("fp8=64:128:128:128:4:2:d2", ["bf16", "fp8"]) == {
        "bf16": None, "fp8": "64:128:128:128:4:2:d2"}
    with pytest.raises(InputError, match="DTYPE=SPEC with DTYPE one of bf16, fp8"):
        block_per_dtype("fp16=64:128:128:128:4:2", ["bf16", "fp8"])
    with pytest.raises(InputError, match="BM:BN1"):
        block_per_dtype("fp8=64:128", ["bf16", "fp8"])


@pytest.mark.skipif(not interpreter_active(), reason="Triton's CPU interpreter is off")
def test_bf16_rows_are_refused_in_the_interpreter_before_any_work():
    cfg16 = BlockConfig(block_m=16, block_n1=32, block_n2=64, block_k=32, block_d=64, tma=False)
    row = dict(shape=(256, 128, 4, 2), tokens=8, ep=2, config=cfg16, device="cpu", dtype="bf16")
    with pytest.raises(InputError, match="dtype bf16 cannot run in Triton's CPU interpreter"):
        run_config(row, "host", ("expert_wave",), None, warmup=0, rep=1, log=lambda m: None, calls=CALLS)


def test_fp8_rows_carry_dtype_accuracy_and_link_bound_and_get_their_summary(tmp_path):
    # Both dtypes of one configuration in one file, as `--dtype bf16,fp8` writes them. The FP8 rows are
    # measured here; bf16 kernels cannot run in Triton's CPU interpreter, so the BF16 rows stand in for
    # a GPU run of the same configuration: the FP8 rows relabelled, at other times per variant.
    writer = ResultWriter(tmp_path / "moe.csv", COLUMNS, KEYS, env={"gpu": "none"})
    cfg8 = BlockConfig(block_m=16, block_n1=128, block_n2=128, block_k=128, block_d=128, tma=False)
    row = dict(shape=(256, 128, 4, 2), tokens=8, ep=2, config=cfg8, device="cpu", dtype="fp8")
    rows8 = run_config(row, "host", ("expert_wave", "lag:1"), None, warmup=0, rep=1, log=lambda m: None, calls=None)
    slower = {"expert_wave": 1.7, "lag:1": 1.9, "unfused": 1.2}
    writer.write_many({**r, "dtype": "bf16", "time_ns": r["time_ns"] * slower[r["variant"]], "max_err": 0.0,
                       "err_fp8_ref": "", "fro_f32": ""} for r in rows8)
    writer.write_many(rows8)
    rows = read_rows(tmp_path / "moe.csv")
    assert [(r["dtype"], r["variant"]) for r in rows] == [
        ("bf16", "expert_wave"), ("bf16", "lag:1"), ("bf16", "unfused"),
        ("fp8", "expert_wave"), ("fp8", "lag:1"), ("fp8", "unfused")]
    fp8 = [r for r in rows if r["dtype"] == "fp8" and r["variant"] != "unfused"]
    for r in fp8:
        # Against the FP8-emulating reference on the same rows, and the float32 one (the recipe's ~4%).
        assert float(r["err_fp8_ref"]) <= 1e-2 and 0 < float(r["fro_f32"]) <= 6e-2
        # The BF16 pipeline differs by the activations' quantization: more than the FP8 reference does.
        assert float(r["max_err"]) > float(r["err_fp8_ref"])
    assert all(r["err_fp8_ref"] == "" for r in rows if r["dtype"] == "bf16")
    # 2 ranks: half of the rows rank 0 computes come from its peer, on average; their BF16 bytes at the
    # host profile's drain rate (55.4 GB/s) bound what faster compute can save.
    r = fp8[0]
    remote = int(r["remote_rows"])
    assert 0 < remote < int(r["rows"]) * 2
    assert float(r["combine_link_ns"]) == pytest.approx(remote * 256 * 2 / 55.44e9 * 1e9, rel=1e-3)
    summary = summarize(tmp_path)
    assert set(summary) == {"host", "host:fp8"} and summary["host:fp8"]["lag:1"]["configs"] == 1
    text = (tmp_path / "summary.md").read_text()
    assert "## Path `host`, fp8" in text and "## FP8 over BF16, EP > 1" in text and "## FP8 accuracy" in text
    t16 = {r["variant"]: float(r["time_ns"]) for r in rows if r["dtype"] == "bf16"}
    t8 = {r["variant"]: float(r["time_ns"]) for r in rows if r["dtype"] == "fp8"}
    assert f"| lag:1 | kernels | 1 | {t16['lag:1'] / t8['lag:1']:.3f} |" in text


def test_fp8_chain_refuses_without_a_gpu():
    row = dict(shape=(256, 128, 4, 2), tokens=8, ep=1, device="cpu", dtype="fp8",
               config=BlockConfig(block_m=16, block_n1=128, block_n2=128, block_k=128, block_d=128, tma=False))
    with pytest.raises(InputError, match="CUDA GPU with FP8 tensor cores"):
        run_config(row, "host", ("expert_wave",), None, warmup=0, rep=1, log=lambda m: None, calls=None)
