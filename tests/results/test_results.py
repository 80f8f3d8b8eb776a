import pytest

from xstage.errors import InputError
from xstage.results import ENV_COLUMNS, ResultWriter, markdown_table, parse_only, read_rows, select, time_device
from xstage.results.plots import bars_figure, lines_figure, plot_lines

ENV = {"gpu": "test-gpu", "driver": "1", "torch": "t", "triton": "tr", "git_commit": "abc", "src_hash": "0123456789ab",
       "date": "2026-01-01"}


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
    with pytest.raises(InputError, match=r"KEY=V1\[,V2...\]"):
        parse_only(["P"])


def test_markdown_and_plots(tmp_path):
    rows = [{"x": 1.0, "y": 2.0, "g": "a"}, {"x": 2.0, "y": 3.0, "g": "a"}, {"x": 1.0, "y": 1.0, "g": "b"}]
    table = markdown_table(rows, ["g", "x", "y"])
    assert table.splitlines()[0] == "| g | x | y |" and len(table.splitlines()) == 5
    fig = lines_figure(rows, "x", "y", ["g"], logx=True, ylabel="time")
    ax = fig.axes[0]
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}
    assert lines == {"g=a": ([1.0, 2.0], [2.0, 3.0]), "g=b": ([1.0], [1.0])}  # one line per group, sorted by x
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_xscale()) == ("x", "time", "log")
    fig = bars_figure(["c1", "c2"], {"s1": [1.0, 2.0], "s2": [1.5, 0.5]}, hline=1.0)
    ax = fig.axes[0]
    assert [round(p.get_height(), 6) for p in ax.patches] == [1.0, 2.0, 1.5, 0.5]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["c1", "c2"]
    assert [list(ln.get_ydata()) for ln in ax.get_lines()] == [[1.0, 1.0]]  # the reference line
    out = plot_lines(rows, "x", "y", ["g"], tmp_path / "p.png")
    assert out == tmp_path / "p.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    assert imread(out).shape[:2] == (int(4.5 * 110), int(7 * 110))  # the figure size at 110 dpi


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


def test_new_files_carry_src_hash_after_git_commit(tmp_path):
    _writer(tmp_path / "r.csv").write({"shape": "a", "tokens": 1, "time_ns": 2.0})
    header = (tmp_path / "r.csv").read_text().splitlines()[0].split(",")
    assert header[header.index("git_commit") + 1] == "src_hash"
    assert read_rows(tmp_path / "r.csv")[0]["src_hash"] == "0123456789ab"


def _old_format_file(path):
    """A results file written before `src_hash` existed (the header committed CSVs still have)."""
    old_env = [c for c in ENV_COLUMNS if c != "src_hash"]
    path.write_text(",".join(["shape", "tokens", "time_ns", *old_env]) + "\n"
                    + "a,1,2,test-gpu,1,t,tr,abc,2026-01-01\n")
    return old_env


def test_old_format_file_is_read_and_resumed_in_its_own_columns(tmp_path):
    path = tmp_path / "old.csv"
    old_env = _old_format_file(path)
    assert read_rows(path) == [{"shape": "a", "tokens": "1", "time_ns": "2", "gpu": "test-gpu", "driver": "1",
                                "torch": "t", "triton": "tr", "git_commit": "abc", "date": "2026-01-01"}]
    w = _writer(path)
    assert w.done({"shape": "a", "tokens": 1})
    assert w.columns == ["shape", "tokens", "time_ns", *old_env]
    w.write({"shape": "a", "tokens": 2, "time_ns": 4.0})
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(["shape", "tokens", "time_ns", *old_env])  # header unchanged
    rows = read_rows(path)
    assert [r["tokens"] for r in rows] == ["1", "2"] and all("src_hash" not in r for r in rows)
    assert rows[1]["git_commit"] == "abc" and rows[1]["date"] == "2026-01-01"


def test_old_format_file_with_other_measurement_columns_is_still_refused(tmp_path):
    path = tmp_path / "old.csv"
    _old_format_file(path)
    before = path.read_bytes()
    with pytest.raises(InputError, match="columns"):
        ResultWriter(path, columns=["shape", "tokens", "time_ns", "extra"], key_columns=["shape"], env=ENV)
    assert path.read_bytes() == before


def test_callers_own_provenance_layout_is_kept(tmp_path):
    cols = ["launch", "value", "gpu", "git_commit", "date"]
    ResultWriter(tmp_path / "r.csv", cols, ["launch"], env=ENV).write({"launch": 0, "value": 1})
    assert read_rows(tmp_path / "r.csv") == [{"launch": "0", "value": "1", "gpu": "test-gpu", "git_commit": "abc",
                                              "date": "2026-01-01"}]


@pytest.mark.parametrize("commit", ["unknown", "", "none"])
def test_require_commit_refuses_unknown_commit_before_touching_the_file(tmp_path, commit):
    path = tmp_path / "sub" / "r.csv"
    env = {**ENV, "git_commit": commit}
    with pytest.raises(InputError, match="XSTAGE_GIT_COMMIT") as exc:
        ResultWriter(path, ["shape"], ["shape"], env=env, require_commit=True)
    assert "\n" not in str(exc.value) and "git checkout" in str(exc.value)
    assert not path.exists() and not path.parent.exists()
    ResultWriter(path, ["shape"], ["shape"], env=env).write({"shape": "a"})  # without the flag: allowed
    assert read_rows(path)[0]["git_commit"] == commit


def test_require_commit_accepts_a_known_commit(tmp_path):
    env = {**ENV, "git_commit": "b6c17ad0069c-dirty"}
    ResultWriter(tmp_path / "r.csv", ["shape"], ["shape"], env=env, require_commit=True).write({"shape": "a"})
    assert read_rows(tmp_path / "r.csv")[0]["git_commit"] == "b6c17ad0069c-dirty"


def test_synchronize_waits_for_the_device_when_one_is_present(monkeypatch):
    import torch

    from xstage.results import synchronize

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(1))
    synchronize()
    assert calls == [1]
