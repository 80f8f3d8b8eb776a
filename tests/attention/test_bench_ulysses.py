"""The host-side parts of `xstage bench ulysses`: grid, tuned-config choice, model prediction, report."""

import pytest

from xstage.attention.flash import FlashConfig
from xstage.bench import ulysses as bu
from xstage.results import ResultWriter, select


def test_grid_covers_the_issue_grid():
    cfgs = bu.grid_configs()
    assert len(cfgs) == 3 * 6 * 3
    assert {(c["heads"], c["dim"]) for c in cfgs} == {(24, 128), (40, 128), (30, 64)}
    assert {c["tokens"] for c in cfgs} == {4608, 8192, 16384, 32760, 75600, 118800}
    assert [c["tokens"] for c in cfgs] == sorted(c["tokens"] for c in cfgs)  # short sequences first
    assert len(select(cfgs, ["P=8", "heads=30"])) == 6


def test_tuned_configs_take_the_fastest_per_dim(tmp_path):
    w = ResultWriter(tmp_path / "core.csv", bu.CORE_COLUMNS, bu.CORE_COLUMNS[:11])
    base = {"tokens": 1, "heads": 1, "layout": "bshd", "ctas_per_sm": 1, "tma": 1}
    w.write({**base, "dim": 128, "impl": "cudnn_sdpa", "tflops": 900.0})
    w.write({**base, "dim": 128, "impl": "triton", "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3,
             "tflops": 500.0})
    w.write({**base, "dim": 128, "impl": "triton", "block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3,
             "tflops": 560.0})
    w.write({**base, "dim": 64, "impl": "triton", "block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2,
             "tflops": 300.0, "tma": 0})
    got = bu.tuned_configs(tmp_path / "core.csv")
    assert got[128] == FlashConfig(128, 128, 8, 3, 1, True)
    assert got[64] == FlashConfig(64, 64, 4, 2, 1, False)


def _fused_row(remote_bytes, tiles=1320, grid=132):
    return {"path": "host", "grid": grid, "tiles": tiles, "remote_bytes": remote_bytes}


def test_model_prediction_is_drain_bound_or_hidden():
    from xstage.model import load_default_profile

    drain = load_default_profile("host").params.drain  # bytes/s
    # 200 MB behind 100 us of compute: the exchange cannot finish before the path drains it
    pred = bu.predicted_exchange_ns(_fused_row(200e6), attention_ns=100e3)
    assert pred >= 200e6 / drain * 1e9 - 100e3
    # 1 MB spread over 10 ms of compute: every burst drains inside the next tile's compute
    hidden = bu.predicted_exchange_ns(_fused_row(1e6), attention_ns=10e6)
    assert hidden < 0.01 * 10e6


def test_report_ratios(tmp_path):
    w = ResultWriter(tmp_path / "ulysses.csv", bu.COLUMNS, bu.KEY_COLUMNS)
    common = {"heads": 24, "dim": 128, "tokens": 4608, "P": 2, "path": "host", "rank": 0, "rank_heads": 12,
              "block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "grid": 132, "tiles": 432,
              "tile_bytes": 32768, "remote_bytes": 7077888}
    times = {"attention": (100e3, 100e3), "serial_triton": (160e3, 160e3), "serial_cudnn": (150e3, 150e3),
             "fused": (110e3, 120e3)}
    for variant, (send, recv) in times.items():
        w.write({**common, "variant": variant, "sender_ns": send, "receiver_ns": recv, "tflops": 1.0,
                 "exchange_ok": 1})
    text = bu.write_report(tmp_path).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 24x128"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = next(line for line in text.splitlines() if line.startswith("| heads x dim"))
    col = {name.strip(): i for i, name in enumerate(header.strip("|").split("|"))}
    assert float(cells[col["serial/fused"]]) == pytest.approx(160 / 120, rel=1e-2)
    assert float(cells[col["fused/attn"]]) == pytest.approx(1.2, rel=1e-2)
    assert float(cells[col["exchange_meas_us"]]) == pytest.approx(20, rel=1e-2)
    assert (tmp_path / "speedup.png").exists() and (tmp_path / "overhead.png").exists()
