"""The Ulysses exchange planner: cost fit, predictions of every mechanism, `auto`, validation."""

import dataclasses
import math

import pytest

from xstage.attention.exchange import resolve_auto
from xstage.calibrate.exchange import fit_default_exchange_costs, fit_exchange_costs
from xstage.errors import InputError
from xstage.sched.exchange import (
    BLOCK_M,
    ExchangeCosts,
    check_predictable,
    default_exchange_costs,
    plan_exchange,
    predict,
    validate_exchange,
    wave_done,
)
from xstage.spec.exchange import Exchange, parse_exchange
from xstage.spec.ulysses import UlyssesPlan, split_sizes

# Test inputs, not measurements: ns, ns per unit of rounds x work, bytes per second.
TRUE = ExchangeCosts(attention={("triton", 64): (20e3, 2e-4), ("cudnn", 64): (10e3, 1.5e-4)},
                     copy={"triton": (5e3, 25e9), "cudnn": (8e3, 20e9)},
                     stores={(False, 64, True): (0.05, 2e3), (True, 64, True): (0.10, 0.0)}, drain=50e9, grid=16)


def _rows(costs: ExchangeCosts, overlaps=(), lengths=(2048, 4096, 16384)) -> list[dict]:
    """A calibration grid whose times follow `costs` exactly (with rows of the `overlaps` exchanges)."""
    rows = []
    for tokens in lengths:
        for P in (2, 4):
            H, D = 8, 64
            plan = UlyssesPlan(P, 0, 1, split_sizes(tokens, P), H, D)
            h = plan.heads_of(0)
            remote = (tokens - plan.seq_lens[0]) * h * D * 2
            base = {"heads": H, "dim": D, "tokens": tokens, "P": P, "grid": costs.grid, "remote_bytes": remote}
            for core in ("triton", "cudnn"):
                alone = costs.attention_ns(core, tokens, h, tokens, D)
                rows.append({**base, "variant": f"attention:{core}", "time_ns": alone})
                serial = "serial" if core == "triton" else "serial:cudnn"
                rows.append({**base, "variant": serial, "time_ns": alone + costs.copy_ns(core, remote)})
            for name in ("stores:paced", "stores:burst", *overlaps):
                rows.append({**base, "variant": name, "time_ns": predict(name, H, D, tokens, P, costs).time_ns})
    return rows


def test_the_fit_recovers_the_coefficients_of_an_exact_grid():
    got = fit_exchange_costs(_rows(TRUE), drain=TRUE.drain)
    for key, (a, b) in TRUE.attention.items():
        assert got.attention[key] == pytest.approx((a, b), rel=1e-6)
    for core, (x0, rate) in TRUE.copy.items():
        assert got.copy[core][0] == pytest.approx(x0, rel=1e-4) and got.copy[core][1] == pytest.approx(rate, rel=1e-6)
    with pytest.raises(InputError, match="no timed rows"):
        fit_exchange_costs([], drain=1e9)


@pytest.mark.parametrize("change, match", [
    (lambda r: r.pop("remote_bytes"), r"^cal, row 2: no column remote_bytes$"),
    (lambda r: r.update(remote_bytes="abc"), r"^cal, row 2, column remote_bytes: 'abc' is not an integer$"),
    (lambda r: r.update(remote_bytes="nan"), r"^cal, row 2, column remote_bytes: 'nan' is not an integer$"),
    (lambda r: r.update(time_ns="inf"), r"^cal, row 2, column time_ns: inf: must be a finite time in ns$"),
    (lambda r: r.update(heads="x"), r"^cal, row 2, column heads: 'x' is not an integer$"),
])
def test_the_fit_names_a_value_it_cannot_read(change, match):
    """Found by tests/test_fuzz_files.py: `remote_bytes`, which the copy fit reads and no check covered,
    renamed in a calibration CSV ended `plan ulysses --calibration` in a KeyError."""
    rows = _rows(TRUE)
    assert rows[1]["variant"] == "serial"  # a serial row: the copy fit reads its remote_bytes
    change(rows[1])
    with pytest.raises(InputError, match=match):
        fit_exchange_costs(rows, drain=TRUE.drain, source="cal")


def test_the_overlap_sends_are_fitted_on_the_overlap_rows():
    # sends beside running attention: their own latency and rate (B/ns), not the serial copy's; a
    # cost per block, and tiles 10% slower while a send is in flight
    true = dataclasses.replace(TRUE, copy={"triton": (5e3, 25.0), "cudnn": (8e3, 50.0)},
                               overlap={"cudnn": (6e3, 40.0, 8e3, 0.1)})
    rows = _rows(true, overlaps=("overlap:cudnn", "overlap:cudnn:3", "overlap:cudnn:4", "overlap:cudnn:4:waves"))
    got = fit_exchange_costs(rows, drain=true.drain)
    assert got.overlap["cudnn"] == pytest.approx((6e3, 40.0, 8e3, 0.1))
    for key, (s, c) in true.stores.items():  # the key loop's slowdown and the cost per round
        assert got.stores[key] == pytest.approx((s, c), abs=1e-9)
    assert "triton" not in got.overlap  # no overlap:triton rows: the serial copy's costs stand in
    assert got.quality["overlap:cudnn"] == pytest.approx(0.0, abs=1e-9)
    # without the fit the serial copy's costs predict other times where a send shows
    plain = dataclasses.replace(got, overlap={})
    assert any(predict(r["variant"], 8, 64, r["tokens"], r["P"], got).time_ns
               != pytest.approx(predict(r["variant"], 8, 64, r["tokens"], r["P"], plain).time_ns)
               for r in rows if r["variant"].startswith("overlap"))


def test_predictions_follow_the_model():
    H, D, T, P = 8, 64, 16384, 4
    plan = UlyssesPlan(P, 0, 1, split_sizes(T, P), H, D)
    h = plan.heads_of(0)
    remote = (T - plan.seq_lens[0]) * h * D * 2
    serial = predict("serial:cudnn", H, D, T, P, TRUE)
    alone = TRUE.attention_ns("cudnn", T, h, T, D)
    assert serial.attention_ns == alone and serial.time_ns == pytest.approx(alone + TRUE.copy_ns("cudnn", remote))
    # overlap: 2 heads x 128 = 256 tiles of 128 rows on 16 slots, a tile as long as a round of
    # attention alone; two blocks: the remote one (192 tiles) is served first, then the own one; its 3 sends
    # (one per destination; without an overlap fit the serial copy's costs stand in) start after it
    a, b = TRUE.attention[("cudnn", D)]
    tile = b * 4 * BLOCK_M * T * D
    ov = predict("overlap:cudnn", H, D, T, P, TRUE)
    assert wave_done([192, 64], 16, tile) == pytest.approx([12 * tile, 16 * tile])
    t_copy = a + 12 * tile + 3 * TRUE.copy_ns("cudnn", remote / 3)
    assert ov.time_ns == pytest.approx(max(a + 16 * tile, t_copy))
    # three blocks: two remote halves side by side (the first served first), the own block once the
    # first is done; each copy waits for its block and for the copy before it
    ov3 = predict("overlap:cudnn:3", H, D, T, P, TRUE)
    done = [a + t for t in wave_done([96, 96, 64], 16, tile)]
    assert done == pytest.approx([a + 6 * tile, a + 12 * tile, a + 16 * tile])
    t_copy = 0.0
    for t_done, dests in zip(done[:2], ([4096, 2048], [2048, 4096])):
        for n in dests:
            t_copy = max(t_done, t_copy) + TRUE.copy_ns("cudnn", n * h * D * 2)
    assert ov3.time_ns == pytest.approx(max(done[-1], t_copy))
    # stores: the slower key loop, and never faster than the link carries the remote bytes
    st = predict("stores:paced", H, D, T, P, TRUE)
    assert st.time_ns >= TRUE.attention_ns("triton", T, h, T, D) * 1.05 and st.time_ns >= remote / TRUE.drain * 1e9
    ranked = plan_exchange(H, D, T, P, TRUE)
    assert [p.time_ns for p in ranked] == sorted(p.time_ns for p in ranked)
    for bad in ("tma", "auto"):
        with pytest.raises(InputError, match="predicts serial, overlap and stores only"):
            check_predictable(bad)
    assert BLOCK_M == 128


def test_auto_is_the_policy_pick_for_the_call_with_the_costs_given():
    plan = UlyssesPlan(4, 1, 1, split_sizes(8192, 4), 24, 128)
    got = resolve_auto(plan, "bf16", "host")
    assert isinstance(got, Exchange) and got.mechanism in ("serial", "overlap", "stores")
    assert got == parse_exchange(plan_exchange(24, 128, 8192, 4, default_exchange_costs())[0].exchange)
    mine = resolve_auto(UlyssesPlan(2, 0, 1, split_sizes(4096, 2), 8, 64), "bf16", "hbm", costs=TRUE)
    assert mine == parse_exchange(plan_exchange(8, 64, 4096, 2, TRUE)[0].exchange)


def test_validation_scores_the_overhead_against_the_same_core():
    rows = _rows(TRUE)
    out, summary = validate_exchange(rows, TRUE)
    assert {s["exchange"] for s in summary} == {"serial", "serial:cudnn", "stores:paced", "stores:burst"}
    assert all(s["median_abs_overhead_error"] == pytest.approx(0, abs=1e-9) for s in summary)
    # 1% of attention more overhead than predicted, on every serial row
    for r in rows:
        if r["variant"] == "serial:cudnn":
            alone = next(x for x in rows if x["variant"] == "attention:cudnn" and x["tokens"] == r["tokens"]
                         and x["P"] == r["P"])["time_ns"]
            r["time_ns"] += 0.01 * alone
    _, summary = validate_exchange(rows, TRUE, ["serial:cudnn"])
    assert summary[0]["median_abs_overhead_error"] == pytest.approx(0.01, rel=1e-6)
    assert not math.isnan(summary[0]["p90_abs_overhead_error"])


def test_tiles_slow_down_only_while_a_send_is_in_flight():
    H, D, T, P = 8, 64, 16384, 4
    h = UlyssesPlan(P, 0, 1, split_sizes(T, P), H, D).heads_of(0)
    a, b = TRUE.attention[("cudnn", D)]
    tile = b * 4 * BLOCK_M * T * D
    y0, rate, z, k = 1e3, 1e3, 5e3, 0.2  # sends far shorter than the own block's 4 rounds of tiles
    costs = dataclasses.replace(TRUE, overlap={"cudnn": (y0, rate, z, k)})
    # two blocks: the remote one (12 rounds) first, its 3 sends (4096 rows each) beside the own
    # block's compute, which they stretch by k times their length; nothing else slows
    sends = 3 * (y0 + 4096 * h * D * 2 / rate)
    assert sends < 4 * tile
    got = predict("overlap:cudnn", H, D, T, P, costs).time_ns
    assert got == pytest.approx(a + 16 * tile + z + k * sends)
    # a send that outlasts the compute slows only the compute it overlaps; then the link decides
    slow = dataclasses.replace(TRUE, overlap={"cudnn": (y0, 1.0, z, k)})
    start = a + 12 * tile + z
    d = y0 + 4096 * h * D * 2 / 1.0
    assert d > 4 * tile
    assert predict("overlap:cudnn", H, D, T, P, slow).time_ns == pytest.approx(start + 3 * d)
    assert predict("overlap:cudnn", H, D, T, P, dataclasses.replace(slow, overlap={"cudnn": (y0, 1.0, z, 0.0)})
                   ).time_ns == pytest.approx(start + 3 * d)


def test_lengths_not_divisible_by_16_take_their_own_stores_fit():
    # Triton compiles the fused kernel apart for those lengths: the fit keeps the two apart and a
    # prediction takes the one of its length's kind, whatever the other says
    unaligned = dataclasses.replace(TRUE, stores={**TRUE.stores, (False, 64, False): (0.20, 0.0)})
    for tokens, s in ((16384, 0.05), (16376, 0.20)):
        h = UlyssesPlan(4, 0, 1, split_sizes(tokens, 4), 8, 64).heads_of(0)
        alone = TRUE.attention_ns("triton", tokens, h, tokens, 64)
        got = predict("stores:paced", 8, 64, tokens, 4, unaligned).time_ns
        rounds = math.ceil(h * math.ceil(tokens / BLOCK_M) / TRUE.grid)
        c = unaligned.stores[(False, 64, tokens % 16 == 0)][1]
        assert got >= alone * (1 + s) + rounds * c
        assert got == pytest.approx(alone * (1 + s) + rounds * c, rel=0.05)  # the link's tail is small here
    # without an unaligned fit, the aligned one stands in
    assert predict("stores:paced", 8, 64, 16376, 4, TRUE).time_ns < predict("stores:paced", 8, 64, 16376, 4,
                                                                            unaligned).time_ns
    # the fit recovers each from its own lengths
    got = fit_exchange_costs(_rows(unaligned, lengths=(2048, 4096, 16384, 2040, 4088, 16376)), drain=TRUE.drain)
    assert got.stores[(False, 64, True)] == pytest.approx((0.05, 2e3), abs=1e-9)
    assert got.stores[(False, 64, False)] == pytest.approx((0.20, 0.0), abs=1e-9)
    assert (False, 64, False) not in fit_exchange_costs(_rows(TRUE), drain=TRUE.drain).stores


def test_an_exchange_whose_copy_was_not_calibrated_is_named():
    """Found by tests/test_fuzz_files.py: a calibration cut before its serial:cudnn rows fitted no cuDNN
    copy, and predicting serial:cudnn or overlap:cudnn ended in a KeyError."""
    costs = fit_exchange_costs([r for r in _rows(TRUE) if r["variant"] != "serial:cudnn"], drain=TRUE.drain,
                               source="cal")
    assert "cudnn" not in costs.copy and predict("serial:triton", 8, 64, 4096, 2, costs).time_ns > 0
    for ex in ("serial:cudnn", "overlap:cudnn:3"):
        with pytest.raises(InputError, match=r"^exchange costs \(cal\): no copy costs for core 'cudnn' .*; have "
                                             r"triton$"):
            predict(ex, 8, 64, 4096, 2, costs)


# ---- the shipped fit ---------------------------------------------------------------------------------

def test_the_shipped_exchange_costs_equal_a_fresh_fit_of_the_embedded_calibration():
    # The library loads the JSON instead of fitting at run time: it must be that fit, to the bit.
    import json
    from importlib import resources

    from xstage.sched import exchange as X

    shipped = json.loads((resources.files("xstage.data") / X.COSTS_JSON).read_text())
    fresh = X.costs_to_dict(fit_default_exchange_costs())
    assert shipped == json.loads(json.dumps(fresh))
    loaded = X.default_exchange_costs()
    for args in ((24, 128, 32768, 4), (8, 64, 1000, 2), (40, 128, 131072, 8)):
        ranked = X.plan_exchange(*args, loaded)
        again = X.plan_exchange(*args, fit_default_exchange_costs())
        assert [(p.exchange, p.time_ns) for p in ranked] == [(p.exchange, p.time_ns) for p in again]


def test_exchange_costs_fitted_on_another_calibration_are_refused(monkeypatch):
    from xstage.errors import XstageError
    from xstage.sched import exchange as X

    monkeypatch.setattr(X, "calibration_sha256", lambda: "0" * 64)
    X.default_exchange_costs.cache_clear()
    try:
        with pytest.raises(XstageError, match=r"h200-ulysses-exchange-costs\.json: fitted on another "
                                              r"h200-ulysses-calibration\.csv than the embedded one; write it again "
                                              r"with `xstage plan exchange-costs -o DIR`"):
            X.default_exchange_costs()
    finally:
        X.default_exchange_costs.cache_clear()


def test_plan_exchange_costs_writes_the_shipped_file(tmp_path):
    import json
    from importlib import resources

    from xstage.cli import main
    from xstage.sched import exchange as X

    assert main(["plan", "exchange-costs", "-o", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / X.COSTS_JSON).read_text())
    assert written == json.loads((resources.files("xstage.data") / X.COSTS_JSON).read_text())
