import pytest

from xstage.bench import ResultWriter, markdown_table, parse_only, read_rows, select, time_device
from xstage.bench.plots import plot_bars, plot_lines
from xstage.errors import InputError

ENV = {"gpu": "test-gpu", "driver": "1", "torch": "t", "triton": "tr", "git_commit": "abc", "date": "2026-01-01"}


def _writer(path):
    return ResultWriter(path, columns=["shape", "tokens", "time_ns"], key_columns=["shape", "tokens"], env=ENV)


def test_rows_resume_and_skip_done(tmp_path):
    path = tmp_path / "r.csv"
    w = _writer(path)
    w.write({"shape": "a", "tokens": 256, "time_ns": 1.5})
    w2 = _writer(path)
    assert w2.done({"shape": "a", "tokens": 256})
    assert not w2.done({"shape": "a", "tokens": 512})
    w2.write({"shape": "a", "tokens": 512, "time_ns": 3.0})
    rows = read_rows(path)
    got = [(r["tokens"], r["time_ns"], r["gpu"]) for r in rows]
    assert got == [("256", "1.5", "test-gpu"), ("512", "3", "test-gpu")]


def test_torn_last_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "r.csv"
    _writer(path).write({"shape": "a", "tokens": 1, "time_ns": 2.0})
    with path.open("a") as f:
        f.write("a,2,")  # a run killed mid-row
    w = _writer(path)
    assert not w.done({"shape": "a", "tokens": 2})
    w.write({"shape": "a", "tokens": 2, "time_ns": 4.0})
    assert [r["tokens"] for r in read_rows(path)] == ["1", "2"]


def test_mismatched_columns_refused_and_file_kept(tmp_path):
    path = tmp_path / "r.csv"
    _writer(path).write({"shape": "a", "tokens": 1, "time_ns": 2.0})
    before = path.read_bytes()
    with pytest.raises(InputError, match="columns"):
        ResultWriter(path, columns=["other"], key_columns=["other"], env=ENV)
    assert path.read_bytes() == before


def test_unknown_column_refused(tmp_path):
    with pytest.raises(InputError, match="bogus"):
        _writer(tmp_path / "r.csv").write({"shape": "a", "tokens": 1, "bogus": 3})


def test_only_filter_selects_slice():
    grid = [{"P": p, "tokens": t} for p in (2, 4, 8) for t in (256, 512)]
    assert select(grid, ["P=2,8", "tokens=512"]) == [{"P": 2, "tokens": 512}, {"P": 8, "tokens": 512}]
    assert select(grid, None) == grid
    with pytest.raises(InputError, match="unknown field"):
        select(grid, ["heads=3"])
    with pytest.raises(InputError, match="KEY=VALUE"):
        parse_only(["P"])


def test_markdown_and_plots(tmp_path):
    rows = [{"x": 1.0, "y": 2.0, "g": "a"}, {"x": 2.0, "y": 3.0, "g": "a"}, {"x": 1.0, "y": 1.0, "g": "b"}]
    table = markdown_table(rows, ["g", "x", "y"])
    assert table.splitlines()[0] == "| g | x | y |" and len(table.splitlines()) == 5
    out = plot_lines(rows, "x", "y", ["g"], tmp_path / "p.png", logx=True)
    assert out.stat().st_size > 1000
    out = plot_bars(["c1", "c2"], {"s1": [1.0, 2.0], "s2": [1.5, 0.5]}, tmp_path / "b.png", hline=1.0)
    assert out.stat().st_size > 1000


def test_time_device_counts_runs():
    calls = []
    t = time_device(lambda: calls.append(1), warmup=2, rep=5)
    assert len(calls) == 7 and t.runs == 5 and t.p10_ns <= t.median_ns <= t.p90_ns


def test_non_finite_values_round_trip(tmp_path):
    w = _writer(tmp_path / "r.csv")
    w.write({"shape": "a", "tokens": 1, "time_ns": float("nan")})
    w.write({"shape": "a", "tokens": 2, "time_ns": float("inf")})
    got = [float(r["time_ns"]) for r in read_rows(tmp_path / "r.csv")]
    assert got[0] != got[0] and got[1] == float("inf")
