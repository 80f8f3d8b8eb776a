import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.sched.test_plan_inputs import _fails
from xstage.calibrate.tilemodel import costs_calibrated_on, fit_tile_model
from xstage.calibrate.tiles import tile_model_of
from xstage.errors import InputError
from xstage.sched.costs import KindCost, TaskCosts, load_default_costs
from xstage.sched.moe import MoeConfig, moe_work
from xstage.sched.tilecost import TileModel, tile_work, units_per_expert
from xstage.spec.schedule import KIND_NAMES

ROOT = Path(__file__).resolve().parents[2]
TILES_CSV = ROOT / "benchmarks/results/h200-moe-tiles/moe-tiles.csv"
CALIBRATION = ("H4096-I2048-E256-K6", "H1152-I4608-E8-K2")
# Test inputs, not measurements: constants of the order an H200 shows.
MODEL = TileModel(overhead_ns=2500.0, mma_flops_per_ns=6000.0, hbm_bytes_per_ns=35.0, copy_bytes_per_ns=20.0,
                  loaded_latency_ns=2000.0)
L1 = "128x128x256x64"


def _tiles_csv() -> list[dict]:
    import csv

    with TILES_CSV.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("rpe,block_m,share", [
    pytest.param(24.0, 128, 6 / 256, id="few-rows"), pytest.param(256.0, 128, 2 / 8, id="E8-K2-two-units"),
    pytest.param(384.0, 128, 6 / 256, id="three-units"), pytest.param(3.0, 64, 1 / 64, id="sparse")])
def test_units_per_expert_matches_sampled_routing(rpe, block_m, share):
    rng = np.random.default_rng(0)
    c = rng.binomial(round(rpe / share), share, size=400_000)
    c = c[c > 0]
    want = np.mean(np.ceil(c / block_m))
    assert units_per_expert(rpe, block_m, share) == pytest.approx(want, rel=3e-3)


def test_tile_work_counts_padded_flops_shared_weights_and_valid_dispatch_rows():
    # H4096-I2048-E256-K6 at 24 rows per expert: (almost) one unit per expert reads each weight slab.
    u = units_per_expert(24.0, 128, 6 / 256)
    w1 = tile_work("linear1", "H4096-I2048-E256-K6", L1, 24.0)
    assert w1.flops == 2.0 * 128 * 256 * 4096
    assert w1.hbm_bytes == pytest.approx(256 * 4096 * 2 / u + 128 * 4096 * 2 / 16)
    w2 = tile_work("linear2", "H1152-I4608-E8-K2", "128x128x128x64", 4096.0)
    assert w2.flops == 2.0 * 128 * 128 * 4608
    d = tile_work("dispatch", "H4096-I2048-E256-K6", L1, 24.0)
    assert (d.copy_bytes, d.chunks) == (24 * 4096 * 2, 4096 // 512)  # BD = 512 for H4096
    assert tile_work("dispatch", "H1152-I4608-E8-K2", L1, 1024.0).chunks == 1152 // 128
    # 1-byte operands halve every byte count and keep the FLOPs.
    w1_fp8 = tile_work("linear1", "H4096-I2048-E256-K6", L1, 24.0, elem_bytes=1)
    assert (w1_fp8.flops, w1_fp8.hbm_bytes) == (w1.flops, pytest.approx(w1.hbm_bytes / 2))


def test_roofline_regimes_and_one_byte_operands():
    shape = "H4096-I2048-E256-K6"
    streaming = MODEL.tile_ns("linear1", shape, L1, 24.0)  # one unit per slab: weights from HBM
    w = tile_work("linear1", shape, L1, 24.0)
    assert streaming == pytest.approx(2500.0 + w.hbm_bytes / 35.0)
    shared = MODEL.tile_ns("linear1", shape, L1, 4096.0)  # 32 units share each slab: MMA-bound
    assert shared == pytest.approx(2500.0 + 2.0 * 128 * 256 * 4096 / 6000.0)
    # FP8: half the bytes and twice the MMA rate halve both regimes' variable part.
    assert MODEL.tile_ns("linear1", shape, L1, 24.0, elem_bytes=1) - 2500.0 == pytest.approx((streaming - 2500.0) / 2)
    assert MODEL.tile_ns("linear1", shape, L1, 4096.0, elem_bytes=1) - 2500.0 == pytest.approx((shared - 2500.0) / 2)
    # A dispatch waits longer beside streaming tiles (rho near 1) than beside MMA-bound ones.
    assert MODEL.hbm_utilisation(shape, L1, 24.0) > 0.9 > 0.2 > MODEL.hbm_utilisation(shape, L1, 4096.0)
    d = tile_work("dispatch", shape, L1, 24.0)
    rho = MODEL.hbm_utilisation(shape, L1, 24.0)
    assert MODEL.tile_ns("dispatch", shape, L1, 24.0) == pytest.approx(8 * 2000.0 * rho**2 + d.copy_bytes / 20.0)


def _synthetic_rows(model: TileModel) -> list[dict]:
    rows = []
    for shape, block in (("H4096-I2048-E256-K6", L1), ("H1152-I4608-E8-K2", "128x128x128x64"),
                         ("H2048-I1024-E64-K4", "64x64x128x64")):
        for rpe in (8.0, 32.0, 128.0, 512.0, 2048.0, 8192.0):
            for kind in KIND_NAMES:
                rows.append({"shape": shape, "block": block, "kind": kind, "rows_per_expert": rpe,
                             "median_ns": model.tile_ns(kind, shape, block, rpe)})
    return rows


def test_fit_recovers_known_constants_from_synthetic_roofline_data():
    fitted = fit_tile_model(_synthetic_rows(MODEL))
    for name in TileModel.CONSTANTS:
        assert getattr(fitted, name) == pytest.approx(getattr(MODEL, name), rel=1e-4), name
    assert fitted.fitted_on == ("H1152-I4608-E8-K2", "H2048-I1024-E64-K4", "H4096-I2048-E256-K6")
    assert fitted.quality["linear1"]["max_abs_rel_error"] < 1e-6
    only = fit_tile_model(_synthetic_rows(MODEL), shapes=["H4096-I2048-E256-K6", "H2048-I1024-E64-K4"])
    assert only.fitted_on == ("H2048-I1024-E64-K4", "H4096-I2048-E256-K6")


def test_fitted_on_two_shapes_predicts_the_other_traced_shapes():
    """The committed H200 traces: fitted on the two calibration shapes, scored on the two others
    (`benchmarks/results/tile-roofline/`). Bounds are the achieved scores, rounded up."""
    rows = _tiles_csv()
    model = fit_tile_model(rows, shapes=CALIBRATION)
    errs = {(r["shape"], r["kind"], r["tokens"]): model.tile_ns(r["kind"], r["shape"], r["block"],
                                                                float(r["rows_per_expert"])) / float(r["median_ns"]) - 1
            for r in rows}
    report = [abs(e) for (s, _, _), e in errs.items() if s not in CALIBRATION]
    calib = [abs(e) for (s, _, _), e in errs.items() if s in CALIBRATION]
    assert len(report) == 24 and len(calib) == 24
    assert np.median(report) <= 0.08 and max(report) <= 0.22
    assert np.median(calib) <= 0.04 and max(calib) <= 0.19
    for kind, bound in (("dispatch", 0.14), ("linear1", 0.075), ("linear2", 0.07)):
        assert np.median([abs(e) for (s, k, _), e in errs.items() if k == kind and s not in CALIBRATION]) <= bound


def test_bad_input_names_the_argument():
    shape = "H4096-I2048-E256-K6"
    with pytest.raises(InputError, match="rows_per_expert"):
        MODEL.tile_ns("linear1", shape, L1, -3.0)
    with pytest.raises(InputError, match="rows_per_expert"):
        MODEL.tile_ns("linear1", shape, L1, float("nan"))
    with pytest.raises(InputError, match="elem_bytes"):
        MODEL.tile_ns("linear1", shape, L1, 64.0, elem_bytes=0)
    with pytest.raises(InputError, match="elem_bytes"):
        MODEL.tile_ns("linear1", shape, L1, 64.0, elem_bytes=1.5)
    with pytest.raises(InputError, match="kind='gemm'"):
        MODEL.tile_ns("gemm", shape, L1, 64.0)
    with pytest.raises(InputError, match="block="):
        MODEL.tile_ns("linear1", shape, "128x-128x256x64", 64.0)
    with pytest.raises(InputError, match="shape="):
        MODEL.tile_ns("linear1", "H-4096-I2048-E256-K6", L1, 64.0)
    with pytest.raises(InputError, match="overhead_ns"):
        replace(MODEL, overhead_ns=-1.0)
    with pytest.raises(InputError, match="hbm_bytes_per_ns"):
        replace(MODEL, hbm_bytes_per_ns=0.0)
    with pytest.raises(InputError, match="kind='gemm'"):
        fit_tile_model([{**r, "kind": "gemm"} for r in _synthetic_rows(MODEL)])
    with pytest.raises(InputError, match="needs >= 3 GEMM tiles"):
        fit_tile_model(_synthetic_rows(MODEL)[:3])
    with pytest.raises(InputError, match="shapes="):
        fit_tile_model(_synthetic_rows(MODEL), shapes=["H7168-I3072-E384-K6"])
    with pytest.raises(InputError, match="malformed tile model"):
        TileModel.from_dict({"overhead_ns": 1.0})


def test_task_costs_use_the_table_where_measured_and_the_model_elsewhere():
    table = [{"shape": "H4096-I2048-E256-K6", "block": L1, "kind": "linear1", "rows_per_expert": r, "median_ns": t}
             for r, t in ((16.0, 100.0), (256.0, 200.0))]
    costs = TaskCosts("moe", {"linear1": KindCost(0.0, 10.0)}, table=table, tile_model=MODEL)
    assert costs.tile_ns("linear1", L1, "H4096-I2048-E256-K6", 64.0, 1e6) == pytest.approx(150.0)
    other = "H4096-I1536-E128-K8"
    assert costs.tile_ns("linear1", L1, other, 64.0, 1e6) == MODEL.tile_ns("linear1", other, L1, 64.0)
    # The table holds 2-byte tiles: 1-byte operands take the model even on the measured shape.
    assert costs.tile_ns("linear1", L1, "H4096-I2048-E256-K6", 64.0, 1e6, elem_bytes=1) == \
        MODEL.tile_ns("linear1", "H4096-I2048-E256-K6", L1, 64.0, elem_bytes=1)
    # Without a model (costs from before it), the per-kind fit.
    assert replace(costs, tile_model=None).tile_ns("linear1", L1, other, 64.0, 1e6) == pytest.approx(1e5)
    # The planner's work takes the model for an unmeasured shape.
    cfg = MoeConfig.parse(other, tokens_per_rank=64, ep=8)
    work = moe_work(cfg, "lag:1", replace(costs, fetch_ns=300.0), num_ctas=132)
    rpe = 64 * 8 * 8 / 128
    for t in work.all_tasks()[:40]:
        assert t.compute_ns == pytest.approx(300.0 + MODEL.tile_ns(t.kind, other, L1, rpe))


def test_json_round_trips_and_old_json_loads(tmp_path):
    fitted = fit_tile_model(_synthetic_rows(MODEL))
    costs = TaskCosts("moe", {"linear1": KindCost(10.0, 5.0)}, {"how": "test"}, {}, _synthetic_rows(MODEL)[:2],
                      fetch_ns=100.0, tile_model=fitted)
    costs.save(tmp_path / "c.json")
    back = TaskCosts.load(tmp_path / "c.json")
    assert back == costs and back.tile_model.quality == fitted.quality
    # Task costs written before the tile model: no `tile_model` key.
    old = json.loads((ROOT / "benchmarks/results/h200-moe-tiles/moe-task-costs.json").read_text())
    assert "tile_model" not in old
    legacy = TaskCosts.from_dict(old)
    assert legacy.tile_model is None and "tile_model" not in legacy.to_dict()
    cfg = "H2048-I1024-E64-K4"
    assert legacy.tile_ns("linear1", L1, cfg, 64.0, 1e8) == legacy.cost("linear1", L1).time_ns(1e8)
    with pytest.raises(InputError, match="tile_model"):
        TaskCosts.from_dict({**old, "tile_model": {"overhead_ns": "x"}}, "c.json")


def test_embedded_costs_carry_a_model_fitted_on_the_calibration_shapes_only():
    costs = load_default_costs("moe")
    assert set(costs.tile_model.fitted_on) == set(CALIBRATION)
    assert {r["shape"] for r in costs.table} >= {"H7168-I3072-E384-K6", "H4096-I1536-E128-K8"}  # table kept
    fresh = fit_tile_model(_tiles_csv(), shapes=CALIBRATION)
    for name in TileModel.CONSTANTS:
        assert getattr(costs.tile_model, name) == pytest.approx(getattr(fresh, name), rel=1e-6)
    assert "only" in costs.provenance["tile_model"]


def test_costs_calibrated_on_shapes_keep_only_their_traces():
    full = load_default_costs("moe")
    cal = costs_calibrated_on(full, CALIBRATION)
    assert {r["shape"] for r in cal.table} == set(CALIBRATION) and not cal.kinds
    assert cal.tile_model == fit_tile_model(full.table, shapes=CALIBRATION)
    # fetch_ns: the median gap of the calibration shapes' runs (4 token counts per shape, in trace order).
    gaps = full.provenance["task_gap_ns_per_run"]
    shapes = full.provenance["shapes"]
    want = np.median([g for i, g in enumerate(gaps) if shapes[i // 4] in CALIBRATION])
    assert cal.fetch_ns == pytest.approx(want)
    held_out = "H7168-I3072-E384-K6"
    assert cal.tile_ns("linear1", L1, held_out, 64.0, 1.0) == cal.tile_model.tile_ns("linear1", held_out, L1, 64.0)
    assert TaskCosts.from_dict(cal.to_dict()) == cal
    with pytest.raises(InputError, match="shapes="):
        costs_calibrated_on(full, ["H1024-I512-E8-K2"])


def test_calibration_fits_the_model_when_the_traces_allow(capsys, tmp_path):
    model, why = tile_model_of(_synthetic_rows(MODEL))
    assert model is not None and why.startswith("fitted on")
    model, why = tile_model_of(_synthetic_rows(MODEL)[:3])
    assert model is None and "not fitted" in why
    with pytest.raises(InputError):
        tile_model_of(_synthetic_rows(MODEL)[:3], shapes=["H4096-I2048-E256-K6"])
    _fails(capsys, ["plan", "calibrate", "-o", str(tmp_path / "c"), "--shapes", "H1152-I4608-E8-K2",
                    "--model-shapes", "H4096-I2048-E256-K6"], "--model-shapes", "not traced")
    assert not (tmp_path / "c").exists()
