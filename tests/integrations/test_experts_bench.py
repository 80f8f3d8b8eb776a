"""`xstage bench experts`' parts that run without a GPU: its routings, the pair of modules over one set
of parameters, and the summary with its fit of the measured calls."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from xstage.integrations.transformers import bench  # noqa: E402
from xstage.sched.experts import load_experts_calls  # noqa: E402

TINY = bench.Arch("tiny", "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeExperts",
                  (("hidden_size", 256), ("moe_intermediate_size", 128), ("num_experts", 16),
                   ("num_experts_per_tok", 2)))


def test_routings_are_distinct_normalised_and_skewed_where_asked():
    uni = bench.routings(400, 64, 8, "uniform", "cpu", seed=0)
    skew = bench.routings(400, 64, 8, "skewed", "cpu", seed=0)
    assert len(uni) == bench.DISTINCT and not torch.equal(uni[0][0], uni[1][0])
    for idx, w in uni + skew:
        assert idx.shape == (400, 8) and w.dtype == torch.bfloat16
        assert all(len(set(r)) == 8 for r in idx.tolist())  # distinct experts per token
        torch.testing.assert_close(w.float().sum(1), torch.ones(400), atol=2e-2, rtol=0)
    hot = lambda idx: float((idx < 64 // bench.HOT_FRACTION).all(1).float().mean())  # noqa: E731
    assert hot(skew[0][0]) > 0.8 and hot(uni[0][0]) < 0.01


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_both_sides_share_one_set_of_parameters(dtype):
    pair = bench.Pair(TINY, dtype, device="cpu")
    assert pair.grouped_mm.config._experts_implementation == "grouped_mm"
    assert pair.xstage.config._experts_implementation == "xstage"
    if dtype == "bf16":
        assert pair.xstage.gate_up_proj is pair.grouped_mm.gate_up_proj
    else:  # the BF16 side holds the dequantized FP8 weights
        from xstage.moe.fp8 import dequantize_weights

        want = dequantize_weights(pair.xstage.gate_up_proj, pair.xstage.gate_up_proj_scale_inv).to(torch.bfloat16)
        assert torch.equal(pair.grouped_mm.gate_up_proj, want)
    assert abs(float(pair.grouped_mm.gate_up_proj.float().std()) * 16 - 1) < 0.05  # unit-scale rows: H**-0.5


def test_summary_gives_ratios_and_fits_the_calls(tmp_path):
    rows = []
    for tokens, xs, gm in ((64, 100.0, 150.0), (4096, 1000.0, 800.0)):
        for side, ns in (("xstage", xs), ("grouped_mm", gm)):
            rows.append(dict(arch="tiny", shape="H256-I128-E16-K2", tokens=tokens, routing="uniform", dtype="bf16",
                             side=side, kernel="fused" if side == "xstage" else "grouped_mm", call_ns=ns * 1e3,
                             graph_ns=ns * 900, launches=3, syncs=0, host_ns=1e4, call_note="", max_err=0.001,
                             gpu="G"))
    summary = bench.summarize(tmp_path, rows)
    assert summary["bf16"]["min"] == pytest.approx(0.8) and summary["bf16"]["geomean_512"] == pytest.approx(0.8)
    assert "**1.50**" in (tmp_path / "summary.md").read_text()
    doc = json.loads((tmp_path / "experts-calls.json").read_text())
    assert {(r["kernel"], r["mode"], r["tokens"]) for r in doc["rows"]} == {
        (k, m, t) for k in ("fused", "grouped_mm") for m in ("eager", "graph") for t in (64, 4096)}
    calls = load_experts_calls(tmp_path / "experts-calls.json")
    assert calls.predict("G", "bf16", "H256-I128-E16-K2", "grouped_mm", "eager", 4096) == pytest.approx(800e3)


def test_command_takes_no_repeat_counts_and_refuses_without_a_gpu(tmp_path):
    # The grid sizes its own runs: --warmup and --rep would be ignored, so they are refused.
    env = {"PYTHONPATH": str(Path(bench.__file__).parents[3]), "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
           "PATH": "/usr/bin:/bin"}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "xstage", "bench", "experts", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    res = cli("-o", "new", "--rep", "3")
    assert res.returncode == 2 and "unrecognized arguments: --rep 3" in res.stderr, res.stderr
    if not torch.cuda.is_available():
        res = cli("-o", "new")
        assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
            "xstage bench experts: error: needs a CUDA GPU (--summarize-only runs anywhere)"), res.stderr
    assert not (tmp_path / "new").exists()
