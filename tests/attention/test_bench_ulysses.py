"""The host-side parts of `xstage bench ulysses`: grid, tuned-config choice, model prediction, report."""

import pytest

from xstage.attention.flash import FlashConfig
from xstage.bench import ulysses as bu
from xstage.bench.ulysses_report import write_report
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
    text = write_report(tmp_path).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 24x128"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = next(line for line in text.splitlines() if line.startswith("| heads x dim"))
    col = {name.strip(): i for i, name in enumerate(header.strip("|").split("|"))}
    assert float(cells[col["best serial / auto"]]) == pytest.approx(150 / 120, rel=1e-3)
    assert float(cells[col["auto / attention"]]) == pytest.approx(120 / 90, rel=1e-3)
    assert cells[col["auto runs"]] == "overlap:cudnn"
    assert (tmp_path / "speedup.png").exists() and (tmp_path / "overhead.png").exists()


def test_policy_table_counts_the_targets_per_policy_beside_the_oracle():
    """Two configurations, one short and one long, times chosen by hand: every count, extreme and
    geomean of the table against the ratios worked out here."""
    from xstage.bench.ulysses_report import policy_table

    def config(tokens, times):
        return [{"heads": 24, "dim": 128, "tokens": tokens, "P": 2, "path": "host", "variant": v, "time_ns": t}
                for v, t in times.items()]

    rows = (config(4608, {"attention:triton": 100, "attention:cudnn": 90, "serial": 160, "serial:cudnn": 150,
                          "overlap:cudnn:3": 120, "stores:paced": 155, "auto": 125})
            + config(32760, {"attention:triton": 1000, "attention:cudnn": 1010, "serial": 1100, "serial:cudnn": 1200,
                             "overlap:cudnn:3": 1020, "stores:paced": 1040, "auto": 1020}))
    table = {r["policy"]: r for r in policy_table(rows)}
    assert list(table)[0] == "auto" and list(table)[-1] == "oracle (best per configuration)"
    auto, overlap, stores = table["auto"], table["overlap:cudnn:3"], table["stores:paced"]
    oracle = table["oracle (best per configuration)"]
    # best serial: 150 (short), 1100 (long); attention: 90, 1000
    assert auto[">= 0.99x best serial"] == 2 and auto["min over best serial"] == pytest.approx(1100 / 1020)
    assert auto["<= 1.03x attention from 32760 tokens"] == 1 and auto["max over attention from 32760"] == 1.02
    assert auto["geomean over best serial below 32760"] == pytest.approx(150 / 125)
    assert auto["geomean over best serial, all"] == pytest.approx(((150 / 125) * (1100 / 1020)) ** 0.5)
    assert stores[">= 0.99x best serial"] == 1 and stores["min over best serial"] == pytest.approx(150 / 155)
    assert stores["<= 1.03x attention from 32760 tokens"] == 0
    assert oracle["geomean over best serial below 32760"] == pytest.approx(150 / 120)  # overlap there, not auto
    assert oracle["max over attention from 32760"] == overlap["max over attention from 32760"] == 1.02
    # a serial or core missing from a configuration leaves it out (no NaN ratio)
    partial = [r for r in rows if not (r["tokens"] == 4608 and r["variant"] == "serial:cudnn")]
    assert policy_table(partial)[0]["configurations"] == 1
@pytest.mark.parametrize("extra, needle", [
    (["--block-n", "-1"], "argument --block-n: -1: must be an integer in 16..1024"),
    (["--block-m", "2048"], "argument --block-m: 2048: must be an integer in 0..1024"),
    (["--block-n", "64"], "--block-n needs --block-m"),
    (["--block-m", "24"], "--block-m 24: config.block_m=24: must be a power of two in 16..1024"),
    (["--block-m", "64", "--tuned-from", "core.csv"], "--block-m and --tuned-from both choose"),
    (["--core-shapes", "axb"], "--core-shapes needs --core"),
    (["--calibration", "missing.csv"], "missing.csv: does not exist"),
    (["--only", "P=3"], "--only P=3: selects none"),
])
@pytest.mark.parametrize("mode", [["--summarize-only"], []])
def test_every_option_is_checked_before_any_work_measuring_or_not(tmp_path, capsys, monkeypatch, extra, needle, mode):
    """Found by tests/test_fuzz_args.py: with --summarize-only these options were ignored (--block-n -1,
    --calibration missing.csv ran), and a measuring run looked for the GPU before reading them."""
    from xstage.cli import main

    from ..corrupt import ULYSSES_CSV, committed, write

    monkeypatch.chdir(tmp_path)
    write(tmp_path / "ulysses.csv", committed(ULYSSES_CSV, 4))
    write(tmp_path / "core.csv", "")
    out = tmp_path if mode else tmp_path / "new"  # a summary reads the folder's CSV; a measurement starts one
    assert main(["bench", "ulysses", "-o", str(out), *mode, *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and "needs a CUDA GPU" not in err and len(err.strip().splitlines()) == 1, err
