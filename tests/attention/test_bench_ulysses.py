"""The host-side parts of `xstage bench ulysses`: grid, tuned-config choice, model prediction, report."""

import pytest

from xstage.attention.flash import FlashConfig
from xstage.bench import ulysses as bu
from xstage.errors import InputError
from xstage.results import ResultWriter, select
from xstage.results.timing import time_in_turns


def test_grid_covers_the_issue_grid():
    cfgs = bu.grid_configs()
    assert len(cfgs) == 3 * 6 * 3
    assert {(c["heads"], c["dim"]) for c in cfgs} == {(24, 128), (40, 128), (30, 64)}
    assert {c["tokens"] for c in cfgs} == {4608, 8192, 16384, 32760, 75600, 118800}
    assert [c["tokens"] for c in cfgs] == sorted(c["tokens"] for c in cfgs)  # short sequences first
    assert len(select(cfgs, ["P=8", "heads=30"])) == 6


def test_tuned_configs_take_the_fastest_per_dim(tmp_path):
    w = ResultWriter(tmp_path / "core.csv", bu.CORE_COLUMNS, bu.CORE_COLUMNS[:11])
    base = {"tokens": 1, "heads": 1, "layout": "bshd", "ctas_per_sm": 1, "tma": 1, "time_ns": 1e6}
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


def test_variants_are_cores_or_exchange_spellings():
    assert bu.check_variants(["attention:cudnn", "stores", "serial:triton", "overlap:cudnn:3"]) == [
        "attention:cudnn", "stores:paced", "serial", "overlap:cudnn:3"]
    for bad in (["attention:flash"], ["fused"], ["stores", "stores:paced"]):
        with pytest.raises(InputError):
            bu.check_variants(bad)


def test_turns_time_every_variant_with_fresh_callables():
    built = {"a": 0, "b": 0}
    calls = {"a": 0, "b": 0}

    def maker(name):
        def make():
            built[name] += 1
            return lambda: calls.__setitem__(name, calls[name] + 1)
        return make

    got = time_in_turns({n: maker(n) for n in built}, warmup=1, rep=5, turns=2)
    assert built == {"a": 2, "b": 2}  # one callable per turn
    assert calls == {"a": 7, "b": 7}  # 1 warm-up per turn + 5 timed
    assert got["a"].runs == 5 and got["b"].runs == 5


def test_report_ratios(tmp_path):
    w = ResultWriter(tmp_path / "ulysses.csv", bu.COLUMNS, bu.KEY_COLUMNS)
    common = {"heads": 24, "dim": 128, "tokens": 4608, "P": 2, "path": "host", "rank": 0, "rank_heads": 12,
              "block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "grid": 132, "tiles": 432,
              "tile_bytes": 32768, "remote_bytes": 7077888, "timed": "graph"}
    times = {"attention:triton": 100e3, "attention:cudnn": 90e3, "serial": 160e3, "serial:cudnn": 150e3,
             "auto": 120e3}
    for variant, t in times.items():
        w.write({**common, "variant": variant, "exchange": "overlap:cudnn" if variant == "auto" else variant,
                 "time_ns": t, "p10_ns": t, "p90_ns": t * 1.1, "tflops": 1.0,
                 "exchange_ok": "" if variant.startswith("attention") else 1})
    text = bu.write_report(tmp_path).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 24x128"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = next(line for line in text.splitlines() if line.startswith("| heads x dim"))
    col = {name.strip(): i for i, name in enumerate(header.strip("|").split("|"))}
    assert float(cells[col["best serial / auto"]]) == pytest.approx(150 / 120, rel=1e-3)
    assert float(cells[col["auto / attention"]]) == pytest.approx(120 / 90, rel=1e-3)
    assert cells[col["auto runs"]] == "overlap:cudnn"
    assert (tmp_path / "speedup.png").exists() and (tmp_path / "overhead.png").exists()
