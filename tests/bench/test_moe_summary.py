"""The MoE summary's fair numbers on a hand-made moe.csv: same-pacing baseline, losses, oracle label."""

import math
import subprocess
import sys

import pytest

from xstage.bench.moe_summary import summarize
from xstage.results import ResultWriter

COLUMNS = ("shape", "H", "I", "E", "K", "tokens", "ep", "path", "variant", "time_ns", "reduce_ns", "tflops",
           "speedup", "block", "ctas")
KEYS = ("shape", "tokens", "ep", "path", "variant")
ENV = {"gpu": "test GPU", "driver": "1", "torch": "2", "triton": "3", "git_commit": "abc1234", "date": "2026-01-01"}

SMALL, BIG = "H1152-I4608-E8-K2", "H4096-I2048-E256-K6"  # BIG comes first in the report order
# Times (ns) per configuration (shape, tokens, EP); without `@` the run's default pacing, `@off` unpaced.
TIMES = {
    (SMALL, 256, 2): {"expert_wave": 100, "lag:4": 80, "lag:8": 90, "expert_wave@off": 120, "lag:4@off": 110,
                      "lag:4@40:512": 70, "unfused": 300},
    (SMALL, 512, 2): {"expert_wave": 100, "lag:4": 125, "lag:8": 95, "expert_wave@off": 100, "lag:4@off": 90},
    (BIG, 256, 4): {"expert_wave": 200, "lag:4": 160, "lag:8": 190, "expert_wave@off": 260, "lag:4@off": 250},
}


def _dims(shape):
    return dict(zip("HIEK", (int(part[1:]) for part in shape.split("-"))))


def _gm(values):
    return math.prod(values) ** (1 / len(values))


@pytest.fixture
def out(tmp_path):
    writer = ResultWriter(tmp_path / "moe.csv", COLUMNS, KEYS, env=ENV)
    for (shape, tokens, ep), times in TIMES.items():
        for variant, t in times.items():
            fused = variant != "unfused"
            writer.write(dict(shape=shape, **_dims(shape), tokens=tokens, ep=ep, path="host", variant=variant,
                              time_ns=float(t), reduce_ns=10.0 if fused else "", tflops=1.0, speedup="",
                              block="128x128x256x64" if fused else "", ctas=132 if fused else ""))
    return tmp_path


def test_speedups_are_over_expert_wave_at_the_same_pacing(out):
    summary = summarize(out)["host"]
    lag4 = [100 / 80, 100 / 125, 200 / 160]  # over paced expert_wave, not over unpaced (120/80, ...)
    s = summary["lag:4"]
    assert s["baseline"] == "expert_wave" and s["configs"] == 3
    assert s["geomean"] == pytest.approx(_gm(lag4)) and s["max"] == pytest.approx(1.25)
    assert s["min"] == pytest.approx(0.8) and s["losses"] == 1
    off = [120 / 110, 100 / 90, 260 / 250]
    s = summary["lag:4@off"]
    assert s["baseline"] == "expert_wave@off" and s["geomean"] == pytest.approx(_gm(off)) and s["losses"] == 0
    assert summary["lag:8"]["losses"] == 0 and summary["lag:8"]["min"] == pytest.approx(200 / 190)
    assert summary["unfused"]["configs"] == 1 and summary["unfused"]["geomean"] == pytest.approx(1 / 3)
    assert "lag:4@40:512" not in summary  # no expert_wave at that pacing: no baseline, no speedup
    text = (out / "summary.md").read_text()
    assert f"| lag:4 | expert_wave | kernels | 3 | {_gm(lag4):.3f} | 1.250 | 0.800 | 1 of 3 |" in text


def test_oracle_is_labelled_and_shown_beside_the_best_constant_variant(out):
    summarize(out)
    text = (out / "summary.md").read_text()
    lag4 = _gm([100 / 80, 100 / 125, 200 / 160])
    lag8 = _gm([100 / 90, 100 / 95, 200 / 190])
    assert lag4 > lag8  # so the best constant variant is lag:4
    oracle = _gm([100 / 80, 100 / 95, 200 / 160])
    assert (f"- best constant variant (one schedule everywhere, chosen by geomean): `lag:4` geomean {lag4:.3f}, "
            "max 1.250, min 0.800, slower in 1 of 3;") in text
    assert (f"- oracle (best of 3 schedules per configuration, chosen after measuring): geomean {oracle:.3f}, "
            "max 1.250.") in text
    oracle_off = _gm([120 / 110, 100 / 90, 260 / 250])
    assert f"- oracle (best of 2 schedules per configuration, chosen after measuring): geomean {oracle_off:.3f}" in text
    assert "Best schedule per configuration:" not in text  # the unlabelled best-of line is gone


def test_pacing_table_counts_where_pacing_loses(out):
    summarize(out)
    text = (out / "summary.md").read_text()
    gains = [110 / 80, 90 / 125, 250 / 160]
    assert (f"| lag:4 | default | 3 | {_gm(gains):.3f} | {min(gains):.3f} | {max(gains):.3f} | 1 of 3 |") in text
    # Pacing and order together, over unpaced expert_wave: labelled, with the constant policy beside the oracle.
    cross_lag4 = _gm([120 / 80, 100 / 125, 260 / 160])
    cross_lag8 = _gm([120 / 90, 100 / 95, 260 / 190])
    best = max(cross_lag4, cross_lag8)
    name = "lag:4" if cross_lag4 > cross_lag8 else "lag:8"
    cross_oracle = _gm([120 / 80, 100 / 95, 260 / 160])
    assert f"not a same-pacing comparison): best constant paced variant `{name}` geomean {best:.3f}" in text
    assert ("oracle: Best paced schedule per configuration over unpaced `expert_wave` "
            f"geomean {cross_oracle:.3f}") in text


def test_shapes_in_report_order_and_eps_from_the_rows(out):
    summarize(out)
    text = (out / "summary.md").read_text()
    big, small = text.index(f"| {BIG} | 4 |"), text.index(f"| {SMALL} | 2 |")
    assert big < small
    assert f"| {SMALL} | 4 |" not in text and f"| {BIG} | 2 |" not in text  # only measured (shape, EP) pairs
    row = [line for line in text.splitlines() if line.startswith(f"| {SMALL} | 2 |")][0]
    # columns lag:4, lag:8, lag:4@off (lag:4@40:512 has no baseline); a cell is geomean / min over tokens
    assert row.split(" | ")[2] == f"{_gm([100 / 80, 100 / 125]):.3f} / 0.800"
    assert "commit abc1234" in text and "test GPU" in text


def test_summary_module_does_not_import_the_bench_grid():
    code = "import sys, xstage.bench.moe_summary; print('xstage.bench.moe' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


# ---- call times ------------------------------------------------------------------------------------------

CALL_COLUMNS = (*COLUMNS, "call_ns", "host_ns", "launches", "syncs", "graph_ns", "reduce_host_ns", "call_note")


def _write(folder, rows):
    writer = ResultWriter(folder / "moe.csv", CALL_COLUMNS, KEYS, env=ENV)
    for shape, tokens, ep, variant, t, extra in rows:
        fused = variant != "unfused"
        writer.write(dict(shape=shape, **_dims(shape), tokens=tokens, ep=ep, path="host", variant=variant,
                          time_ns=float(t), reduce_ns=10.0 if fused else "", tflops=1.0, speedup="",
                          block="128x128x256x64" if fused else "", ctas=132 if fused else "", **extra))
    return folder


def test_old_files_without_call_columns_are_summarised_on_kernel_times(out):
    summary = summarize(out)["host"]
    assert {s["basis"] for s in summary.values()} == {"kernels"}
    assert "## Calls against kernels" not in (out / "summary.md").read_text()


def test_speedups_are_of_call_times_where_both_rows_have_one(tmp_path):
    rows = []
    for (shape, tokens, ep), times in TIMES.items():
        for variant, t in times.items():
            # calls cost 1 us more than the kernels, in the first configuration only (and not the baseline)
            call = (shape, tokens, ep) == (SMALL, 256, 2) and variant != "unfused"
            rows.append((shape, tokens, ep, variant, t, dict(call_ns=t + 1000.0) if call else {}))
    summary = summarize(_write(tmp_path, rows))["host"]
    lag4 = [1100 / 1080, 100 / 125, 200 / 160]
    assert summary["lag:4"]["geomean"] == pytest.approx(_gm(lag4)) and summary["lag:4"]["basis"] == "call in 1 of 3"
    assert summary["unfused"]["basis"] == "kernels" and summary["unfused"]["geomean"] == pytest.approx(1 / 3)
    text = (tmp_path / "summary.md").read_text()
    assert f"| lag:4 | expert_wave | call in 1 of 3 | 3 | {_gm(lag4):.3f} |" in text
    # the oracle of each configuration on one basis: the calls in the first, the kernels elsewhere
    oracle = _gm([1100 / 1080, 100 / 95, 200 / 160])
    assert f"chosen after measuring): geomean {oracle:.3f}" in text
    assert "## Calls against kernels" in text


def test_calls_against_kernels_section_counts_each_target(tmp_path):
    row = dict(host_ns=20000.0, reduce_host_ns=3000.0, syncs=0, launches=3, call_note="")
    rows = [
        (BIG, 2048, 2, "expert_wave", 1000, dict(row, call_ns=1030.0, graph_ns=1150.0)),  # kernels 1010: all met
        (BIG, 2048, 2, "lag:4", 900, dict(row, call_ns=1100.0, graph_ns="", launches=4, host_ns=50000.0, syncs=2,
                                          call_note="graph: capture failed: RuntimeError: no")),  # each missed
        (BIG, 256, 2, "expert_wave", 100, dict(row, call_ns=5000.0, graph_ns=20000.0, host_ns=10000.0,
                                               reduce_host_ns=1000.0)),  # under 1024 tokens; graph missed
        (BIG, 256, 2, "lag:4", 90, dict(call_note="call not measured")),
    ]
    summarize(_write(tmp_path, rows))
    text = (tmp_path / "summary.md").read_text()
    section = text[text.index("## Calls against kernels"):]
    assert "### bf16, path `host`, EP 2 (3 rows)" in section
    assert "- call <= 1.03 x kernels from 1024 tokens: met in 1 of 2 rows" in section
    assert ("- graph replay <= 1.03 x kernels + 10 us: met in 1 of 2 captured rows; 1 rows not captured: "
            "graph: capture failed: RuntimeError: no") in section
    assert "- launches <= 3 per call: met in 2 of 3 rows" in section
    assert "- host_ns <= launches x reduce_host_ns + 30 us: met in 2 of 3 rows" in section
    assert "- no synchronisation torch reports (`syncs` = 0): met in 2 of 3 rows" in section
    gm = _gm([1030 / 1010, 1100 / 910])
    assert f"| 2048 | 2 | {gm:.3f}, {1100 / 910:.3f} | {1150 / 1010:.3f}; 1 of 2 | 4 | 35.0, 50.0 | 2 |" in section


@pytest.mark.parametrize("column, value, needle", [
    ("call_ns", "abc", "column call_ns: 'abc' is not a number"),
    ("graph_ns", "-5", "column graph_ns: -5: a time must be > 0 ns"),
    ("launches", "2.5", "column launches: '2.5' is not an integer"),
    ("syncs", "-1", "column syncs: -1: must be an integer >= 0"),
    ("host_ns", "nan", "column host_ns: nan: must be a finite time in ns"),
])
def test_malformed_call_columns_are_refused_before_anything_is_written(tmp_path, column, value, needle):
    from xstage.errors import InputError

    folder = _write(tmp_path, [(BIG, 256, 2, "expert_wave", 100, {column: value})])
    with pytest.raises(InputError, match=needle):
        summarize(folder)
    assert not (folder / "summary.md").exists()
