"""The whole-layer Ulysses model (`xstage.sched.layer`): its parts against the fitted data by hand, its
reduction to today's exchange model, its lower bound, and its ranking."""

import importlib
import json
import math
import re
from importlib import resources
from pathlib import Path

import pytest

from xstage.errors import InputError
from xstage.sched.costmodel import LAYER_TERMS
from xstage.sched.exchange import CANDIDATES, default_exchange_costs, predict
from xstage.sched.layer import (
    LayerConfig,
    finish,
    layer_bound,
    layer_bytes,
    layer_schemes,
    path_costs,
    pipeline_ns,
    plan_layer,
    predict_layer,
)
from xstage.sched.policy import choose_layer

ROOT = Path(__file__).resolve().parents[2]
# the 54 configurations of the main grid (`xstage bench ulysses`), the DiT ones of the layer issue, and
# shapes whose heads or tokens do not split evenly
GRID = [(h, d, t, p) for t in (4608, 8192, 16384, 32760, 75600, 118800) for h, d in ((24, 128), (40, 128), (30, 64))
        for p in (2, 4, 8)]
ODD = [(30, 64, 4099, 4), (7, 128, 1001, 3), (5, 64, 130, 5), (24, 128, 4608, 1)]
SHAPES = [*GRID, (24, 128, 32760, 4), (40, 128, 75600, 8), *ODD]


def _data() -> dict:
    return json.loads((resources.files("xstage.data") / "h200-ulysses-exchange-costs.json").read_text())


@pytest.mark.parametrize("core", ["triton", "cudnn"])
@pytest.mark.parametrize("shape", [(24, 128, 4608, 4), (30, 64, 32760, 8), (40, 128, 75600, 8)],
                         ids=lambda s: "H{}-D{}-S{}-P{}".format(*s))
def test_serial_is_the_sum_of_its_parts_from_the_data_file(shape, core):
    H, D, S, P = shape
    d = _data()
    att = {(c, dim): (a, b) for c, dim, a, b in d["attention"]}
    copy = {c: (x0, rate) for c, x0, rate in d["copy"]}
    h = -(-H // P)  # rank 0's heads: the first H % P ranks take one more
    s0 = -(-S // P)
    a, b = att[(core, D)]
    attention = a + b * math.ceil(h * math.ceil(S / 128) / d["grid"]) * 4 * 128 * S * D
    pre = copy["triton"][0] + 3 * h * (S - s0) * D * 2 / copy["triton"][1]  # rank 0 receives the most
    post = copy[core][0] + h * (S - s0) * D * 2 / copy[core][1]
    name = "serial" if core == "triton" else "serial:cudnn"
    assert predict_layer(name, LayerConfig(H, D, S, P)).time_ns == pytest.approx(pre + attention + post, rel=1e-12)


@pytest.mark.parametrize("shape", [*GRID[::5], *ODD], ids=lambda s: "H{}-D{}-S{}-P{}".format(*s))
def test_todays_schemes_are_the_exchange_model_after_the_pre_exchange(shape):
    """The parts that were measured (attention and the post exchange) are predicted as today's model
    predicts them: its accuracy on the measured grid is the layer model's there."""
    cfg = LayerConfig(*shape)
    costs = default_exchange_costs()
    b = layer_bytes(cfg)[0]
    for ex in CANDIDATES:
        p = predict_layer(ex, cfg)
        extra = max(0, b.post_received - b.post_sent) / costs.copy["triton" if ex.startswith("stores") else
                                                                   ("cudnn" if "cudnn" in ex else "triton")][1]
        assert p.time_ns - p.pre_ns - extra == pytest.approx(predict(ex, *shape, costs).time_ns, rel=1e-12), ex


@pytest.mark.parametrize("shape", SHAPES[::3], ids=lambda s: "H{}-D{}-S{}-P{}".format(*s))
@pytest.mark.parametrize("path", ["host", "peer"])
def test_one_chunk_is_serial(shape, path):
    cfg = LayerConfig(*shape, path=path)
    assert predict_layer("heads:triton:1", cfg).time_ns == pytest.approx(predict_layer("serial", cfg).time_ns)
    assert predict_layer("heads:cudnn:1", cfg).time_ns == pytest.approx(predict_layer("serial:cudnn", cfg).time_ns)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-D{}-S{}-P{}".format(*s))
@pytest.mark.parametrize("path", ["host", "peer"])
@pytest.mark.parametrize("batch", [1, 2])
def test_no_scheme_beats_the_bound(shape, path, batch):
    cfg = LayerConfig(*shape, batch=batch, path=path)
    bound = layer_bound(cfg)
    h = cfg.plan.heads_of(0)
    schemes = layer_schemes(cfg, chunks=range(1, h + 1))  # every head chunking, not only the defaults
    for p in plan_layer(cfg, schemes):
        assert p.time_ns >= bound.time_ns * (1 - 1e-12), p.scheme
        assert p.time_ns >= bound.any_order_ns
    assert bound.time_ns == max(bound.first_arrival_ns + bound.attention_ns, bound.link_ns)


def test_the_bound_is_reached_by_its_own_assumptions():
    """With free fixed costs, no slowdown and copies at the fastest rate, the finest pipeline of a
    compute-bound layer comes within one chunk's transfers of the bound: the bound is not loose by
    construction."""
    cfg = LayerConfig(24, 128, 118800, 2)  # 12 heads, compute-bound
    costs = default_exchange_costs()
    rate = max(r for _, r in costs.copy.values())
    ideal = costs.__class__(costs.attention, {c: (0.0, rate) for c in costs.copy}, costs.stores, rate * 1e9,
                            costs.grid, "ideal", {}, {c: (0.0, rate, 0.0, 0.0) for c in costs.overlap})
    bound = layer_bound(cfg, ideal)
    best = predict_layer("heads:cudnn:12", cfg, ideal).time_ns
    assert bound.time_ns <= best
    one = layer_bytes(cfg, 12)
    # the first chunk's Q (one third of its bytes beyond K and V) and the last chunk's O, at most
    slack = (one[0].pre / 3 + one[-1].post) / rate
    tiles_per_head = math.ceil(118800 / 128)  # 12 one-head chunks add wave rounds against one launch
    rounds = 12 * math.ceil(tiles_per_head / 132) - math.ceil(12 * tiles_per_head / 132)
    a, b = costs.attention[("cudnn", 128)]
    assert best - bound.time_ns <= slack + rounds * b * 4 * 128 * 118800 * 128 + 1e-6


@pytest.mark.parametrize("shape", SHAPES[::4], ids=lambda s: "H{}-D{}-S{}-P{}".format(*s))
def test_more_bytes_never_predict_less_time(shape):
    cfg1, cfg2 = LayerConfig(*shape), LayerConfig(*shape, batch=2)
    slow = default_exchange_costs()
    slow = slow.__class__(slow.attention, {c: (x0, r / 2) for c, (x0, r) in slow.copy.items()}, slow.stores,
                          slow.drain / 2, slow.grid, "half rate", {},
                          {c: (y0, r / 2, z, k) for c, (y0, r, z, k) in slow.overlap.items()})
    for s in layer_schemes(cfg1):
        p = predict_layer(s, cfg1).time_ns
        assert predict_layer(s, cfg2).time_ns >= p, s  # twice the bytes and the tiles
        assert predict_layer(s, cfg1, slow).time_ns >= p, s  # every byte takes twice as long


def test_the_pipeline_by_hand():
    # two chunks: Q,K,V 0..10, 10..20; compute 10..30 slowed 2x while chunk 1's Q,K,V lands (10..20),
    # so chunk 0 ends at 25 (10 ns of work in 10..20 at half speed = 5, then 15 at full); chunk 0's O
    # 25..33 slows chunk 1 (work 10 from 25: 8 ns at half speed = 4, then 6 more): ends at 39, O 39..44
    assert finish(10.0, 20.0, [(0.0, 10.0), (10.0, 20.0)], 1.0) == 35.0  # 5 ns of work in 10..20, 15 after
    assert pipeline_ns([10.0, 10.0], [10.0, 10.0], [8.0, 5.0], 1.0) == 44.0
    # without the slowdown: chunk 0 10..20, its O 20..28, chunk 1 20..30, its O 30..35
    assert pipeline_ns([10.0, 10.0], [10.0, 10.0], [8.0, 5.0], 0.0) == 35.0
    assert pipeline_ns([3.0], [5.0], [2.0], 0.7) == 10.0  # one chunk: nothing runs beside anything


def test_bytes_of_an_uneven_split():
    cfg = LayerConfig(30, 64, 4099, 4)  # heads 8, 8, 7, 7; tokens 1025, 1025, 1025, 1024
    b = layer_bytes(cfg)[0]
    row = 64 * 2
    assert (b.pre_sent, b.pre_received) == (3 * 1025 * 22 * row, 3 * 8 * 3074 * row)
    assert (b.post_sent, b.post_received) == (8 * 3074 * row, 1025 * 22 * row)
    chunks = layer_bytes(cfg, 3)  # rank 0: 3, 3, 2 heads; peers 3,3,2 / 3,2,2 / 3,2,2
    assert [c.post_sent for c in chunks] == [h * 3074 * row for h in (3, 3, 2)]
    assert [c.pre_sent for c in chunks] == [3 * 1025 * n * row for n in (9, 7, 6)]


def test_peer_rates_scale_with_the_profiles_drains():
    host, peer = default_exchange_costs(), path_costs("peer")
    f = peer.drain / host.drain
    assert f > 1  # NVLink drains faster than PCIe
    assert peer.copy["triton"] == (host.copy["triton"][0], host.copy["triton"][1] * f)
    assert predict_layer("serial", LayerConfig(24, 128, 32760, 4, path="peer")).time_ns < \
        predict_layer("serial", LayerConfig(24, 128, 32760, 4)).time_ns


def test_choose_layer_ranks_and_says_it_is_a_prediction():
    d = choose_layer(24, 128, 32760, 4, path="host", dtype="bf16")
    assert d.kind == "layer" and not d.validated
    assert d.choice == d.predicted_ns[0][0]
    times = [t for _, t in d.predicted_ns]
    assert times == sorted(times)
    assert "lower bound" in d.note
    assert {n for n, _ in d.predicted_ns} == set(layer_schemes(LayerConfig(24, 128, 32760, 4)))


@pytest.mark.parametrize("bad,match", [
    (dict(path="hbm"), "path"), (dict(dtype="fp32"), "dtype"), (dict(batch=0), "batch"),
])
def test_refusals(bad, match):
    with pytest.raises(InputError, match=match):
        LayerConfig(24, 128, 4608, 4, **bad)


def test_a_chunk_count_past_the_heads_is_refused():
    with pytest.raises(InputError, match="fewer than 4 chunks"):
        predict_layer("heads:cudnn:4", LayerConfig(24, 128, 4608, 8))  # 3 heads
    with pytest.raises(InputError, match="heads:CORE:C"):
        predict_layer("heads:flash:2", LayerConfig(24, 128, 4608, 4))


def test_the_cost_model_page_lists_the_layer_terms():
    page = (ROOT / "docs" / "cost-model.md").read_text()
    body = page.split("## A whole Ulysses layer\n", 1)[1].split("\n## ", 1)[0]
    assert [m.group(1) for m in re.finditer(r"^\| ([^|]+?) \| ", body, re.M)][1:] == [t.name for t in LAYER_TERMS]
    for term in LAYER_TERMS:
        module, _, attr = term.applied_in.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), term.applied_in
        for name in term.data:
            assert (ROOT / "src" / "xstage" / "data" / name).is_file(), name
        for folder in term.results:
            assert (ROOT / "benchmarks" / "results" / folder).is_dir(), folder
        assert term.experiment.startswith("xstage ")


@pytest.mark.parametrize("shape", [(24, 128, 4608, 2), (40, 128, 8192, 4)], ids=lambda s: "H{}-D{}-S{}-P{}".format(*s))
def test_a_link_bound_layer_reaches_the_link_term(shape):
    """With free fixed costs, no slowdown and every copy at the fastest rate, a link-bound layer's best
    pipeline keeps the link busy from start to end: it meets the bound's link term exactly."""
    costs = default_exchange_costs()
    rate = max(r for _, r in costs.copy.values())
    ideal = costs.__class__(costs.attention, {c: (0.0, rate) for c in costs.copy}, costs.stores, rate * 1e9,
                            costs.grid, "ideal", {}, {c: (0.0, rate, 0.0, 0.0) for c in costs.overlap})
    cfg = LayerConfig(*shape)
    bound = layer_bound(cfg, ideal)
    assert bound.link_ns > bound.first_arrival_ns + bound.attention_ns
    best = min(predict_layer(f"heads:cudnn:{c}", cfg, ideal).time_ns for c in range(1, cfg.plan.heads_of(0) + 1))
    assert best == pytest.approx(bound.time_ns, rel=1e-9)
