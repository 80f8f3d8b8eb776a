"""The experts-kernel choice (`xstage.sched.experts`, `choose_experts`): interpolation of measured call
times, the margin, the fused default without measurements, the shipped data's provenance and the
integration's use of it (transformers' own grouped_mm chain where it was measured faster)."""

import math
from pathlib import Path

import pytest

from xstage.calibrate.experts import MARGIN, fit_experts_calls, source_of
from xstage.errors import InputError
from xstage.sched.experts import FORMAT, ExpertsCalls, default_experts_calls, interpolate
from xstage.sched.policy import choose_experts

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h100-experts-backend" / "experts.csv"


def _calls(rows, margin=0.03):
    doc = dict(format=FORMAT, source="test", margin=margin, rows=[
        dict(gpu="G", dtype="bf16", shape="H64-I32-E8-K2", kernel=k, mode=m, tokens=t, ns=ns)
        for k, m, t, ns in rows])
    return ExpertsCalls.from_dict(doc, "test")


def test_interpolation_is_log_linear_inside_flat_below_and_proportional_above():
    pts = [(8, 100.0), (512, 6400.0)]
    assert interpolate(pts, 1) == 100.0 and interpolate(pts, 8) == 100.0
    # log-linear: at the geometric middle of the tokens, the geometric middle of the times
    assert math.isclose(interpolate(pts, 64), math.sqrt(100.0 * 6400.0), rel_tol=1e-12)
    assert interpolate(pts, 1024) == 12800.0


def test_grouped_mm_only_where_measured_faster_by_more_than_the_margin():
    calls = _calls([("fused", "eager", 64, 100.0), ("grouped_mm", "eager", 64, 98.0),
                    ("fused", "eager", 4096, 1000.0), ("grouped_mm", "eager", 4096, 800.0),
                    ("fused", "graph", 4096, 1000.0), ("grouped_mm", "graph", 4096, 1200.0)])
    near = choose_experts("H64-I32-E8-K2", 64, dtype="bf16", gpu="G", calls=calls)
    assert near.choice == "fused" and near.predicted_ns[0][0] == "grouped_mm"  # 2% faster, under the margin
    far = choose_experts("H64-I32-E8-K2", 4096, dtype="bf16", gpu="G", calls=calls)
    assert (far.kind, far.choice, far.validated) == ("experts", "grouped_mm", True)
    assert dict(far.predicted_ns) == {"fused": 1000.0, "grouped_mm": 800.0}
    assert choose_experts("H64-I32-E8-K2", 4096, dtype="bf16", gpu="G", graph=True, calls=calls).choice == "fused"
    for kw in (dict(gpu="other"), dict(dtype="fp16")):
        args = dict(dict(dtype="bf16", gpu="G", tokens=4096), **kw)
        d = choose_experts("H64-I32-E8-K2", args.pop("tokens"), calls=calls, **args)
        assert d.choice == "fused" and not d.validated and "no " in d.note and d.predicted_ns == ()


def test_bad_experts_calls_files_are_refused_in_one_line():
    good = dict(format=FORMAT, margin=0.03, rows=[dict(gpu="G", dtype="bf16", shape="H64-I32-E8-K2", kernel="fused",
                                                       mode="eager", tokens=8, ns=1.0)])
    ExpertsCalls.from_dict(good, "f")
    for bad, msg in ((dict(good, format="x"), "not an experts-calls file"), (dict(good, margin=1.5), "margin"),
                     (dict(good, rows=[dict(good["rows"][0], kernel="cublas")]), "kernel"),
                     (dict(good, rows=[dict(good["rows"][0], ns=float("nan"))]), "finite"),
                     (dict(good, rows=[dict(good["rows"][0], tokens=0)]), "tokens"),
                     (dict(good, rows=good["rows"] * 2), "twice")):
        with pytest.raises(InputError, match=msg):
            ExpertsCalls.from_dict(bad, "f")


def test_the_shipped_data_is_a_fit_of_the_committed_measurements():
    from xstage.integrations.transformers.bench import read_experts_csv

    doc = fit_experts_calls(read_experts_csv(RESULTS), source_of(RESULTS))
    assert doc["margin"] == MARGIN
    shipped = default_experts_calls()
    fresh = ExpertsCalls.from_dict(doc, "fresh")
    assert shipped.points == fresh.points and shipped.source == fresh.source and shipped.margin == fresh.margin
    # What it says (module docstring of xstage.sched.experts): Mixtral from 4096 tokens, OLMoE eager at 8-64.
    g = "NVIDIA H100 80GB HBM3"
    assert choose_experts("H4096-I14336-E8-K2", 4096, dtype="bf16", gpu=g).choice == "grouped_mm"
    assert choose_experts("H2048-I1024-E64-K8", 64, dtype="bf16", gpu=g).choice == "grouped_mm"
    assert choose_experts("H2048-I1024-E64-K8", 64, dtype="bf16", gpu=g, graph=True).choice == "fused"
    assert choose_experts("H2048-I768-E128-K8", 4096, dtype="bf16", gpu=g).choice == "fused"
