"""Per-burst traces and `xstage model score`: the format, its refusals, and scores held to the closed
forms, the reference engine and plain numpy on the same rows."""

import csv
import json

import numpy as np
import pytest

from xstage.cli import main
from xstage.errors import InputError
from xstage.model import closed_form as cf
from xstage.model.params import PathParams
from xstage.model.profile import load_default_profile
from xstage.model.simulate import simulate_bursts
from xstage.model.trace import TRACE_COLUMNS, read_trace, rel_error, score_trace, trace_from_rows

HOST = load_default_profile("host").params
REL = 1e-6


def _write(path, rows, columns=None):
    columns = columns or list(rows[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    return path


def _row(launch, cta, burst, nbytes, start, issue, **extra):
    return dict(launch=launch, cta=cta, burst_index=burst, burst_bytes=nbytes, start_ns=start, issue_ns=issue, **extra)


def _irregular(params, seed, n_cta=7):
    """A launch of `n_cta` CTAs with mixed sizes, zero, random and long gaps and staggered starts, its
    issue times those the reference engine predicts: (rows, the reference engine's issue times)."""
    rng = np.random.default_rng(seed)
    progs = [[(float(rng.choice([512, 4096, 65536, 1 << 20])), float(rng.choice([0.0, rng.uniform(0, 5e3), 2e5])))
              for _ in range(int(rng.integers(1, 9)))] for _ in range(n_cta)]
    starts = [float(rng.uniform(0, 2e4)) for _ in range(n_cta)]
    starts[int(rng.integers(n_cta))] = 0.0
    res = simulate_bursts(params, progs, start_ns=starts, engine="reference")
    rows = []
    for c, prog in enumerate(progs):
        for k, (b, _) in enumerate(prog):
            start = 1000.0 + res.start_ns[c][k]
            rows.append(_row(seed, c, k, int(b), start, res.issue_ns[c][k], family=f"f{seed % 2}"))
    return rows, res


def test_one_burst_alone_is_the_closed_form_and_its_error_is_the_definition():
    # Three CTAs, each one burst, far apart in time (nothing shared): each is one issuer alone.
    sizes, factor = (4096, 65536, 4 << 20), (1.2, 0.9, 1.0)
    want = [cf.issue_time(HOST, b) for b in sizes]
    rows = [_row(0, c, 0, b, 1e9 * c, w * f) for c, (b, w, f) in enumerate(zip(sizes, want, factor))]
    s = score_trace(trace_from_rows(rows), HOST)
    assert np.allclose(s.bursts["predicted_ns"], want, rtol=REL)
    measured = np.array(want) * factor
    expect = np.abs(np.array(want) - measured) / np.maximum(measured, 500.0)
    assert np.allclose(s.bursts["error"], expect, rtol=REL)
    assert np.allclose(s.bursts["naive_ns"], np.array(sizes) / HOST.r0 * 1e9, rtol=REL)
    assert s.summary()["bursts"]["median"] == pytest.approx(float(np.median(expect)), rel=REL)


def test_the_gap_given_to_the_model_is_the_measured_compute_after_each_burst():
    # One CTA, two bursts: the second starts `gap` after the first ends (start + measured issue); with
    # the first burst measured at the model's own issue time, the second is the closed form's.
    for b1, gap, b2 in ((1 << 20, 0.0, 65536), (1 << 20, 3e3, 1 << 20), (4 << 20, 1e4, 4096)):
        i1 = cf.issue_time(HOST, b1)
        rows = [_row(3, 0, 0, b1, 50.0, i1), _row(3, 0, 1, b2, 50.0 + i1 + gap, 1000.0)]
        s = score_trace(trace_from_rows(rows), HOST)
        assert s.bursts["predicted_ns"][1] == pytest.approx(cf.two_burst_issue_time(HOST, b1, gap, b2), rel=1e-5)
        assert s.launches["measured_ns"][0] == pytest.approx(i1 + gap + 1000.0, rel=REL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_trace_the_reference_engine_made_scores_zero_on_the_fast_engine(seed):
    # Irregular trains (mixed sizes, zero and long gaps, staggered starts, 7 CTAs): the fast engine,
    # given only the rows, predicts every burst and the end as the reference engine played them.
    rows, res = _irregular(HOST, seed)
    trace = trace_from_rows(rows)
    fast, ref = score_trace(trace, HOST, "fast"), score_trace(trace, HOST, "reference")
    assert np.allclose(fast.bursts["predicted_ns"], ref.bursts["predicted_ns"], rtol=REL, atol=1e-6)
    assert np.allclose(fast.bursts["predicted_ns"], np.concatenate(res.issue_ns), rtol=REL, atol=1e-6)
    assert fast.bursts["error"].max() < 1e-6
    end = max(float(e[-1]) for e in res.issue_end_ns) - min(float(s[0]) for s in res.start_ns)
    assert fast.launches["predicted_ns"][0] == pytest.approx(end, rel=REL)
    assert fast.launches["error"][0] < 1e-6


def test_errors_by_family_are_the_pooled_statistics_of_each_familys_rows(tmp_path):
    # Four launches, two families, issue times 30% off the model's on family f1's launches only
    rows = []
    for seed in range(4):
        rs, _ = _irregular(HOST, seed, n_cta=3)
        if seed % 2:  # each burst 1.3x longer, the compute between bursts unchanged
            shift = {}
            for r in rs:
                r["start_ns"] += shift.get(r["cta"], 0.0)
                shift[r["cta"]] = shift.get(r["cta"], 0.0) + 0.3 * r["issue_ns"]
                r["issue_ns"] *= 1.3
        rows += rs
    s = score_trace(read_trace(_write(tmp_path / "t.csv", rows)), HOST)
    summ = s.summary()
    for fam in ("f0", "f1"):
        mask = np.array([r["family"] == fam for r in rows])
        err = rel_error(s.bursts["predicted_ns"][mask], np.array([r["issue_ns"] for r in rows])[mask])
        assert summ["families"][fam]["bursts"]["n"] == mask.sum()
        assert summ["families"][fam]["bursts"]["median"] == pytest.approx(float(np.median(err)), rel=1e-9)
        assert summ["families"][fam]["end"]["n"] == 2
    assert summ["families"]["f0"]["bursts"]["max"] < 1e-6 < summ["families"]["f1"]["bursts"]["median"]
    assert summ["bursts"]["n"] == len(rows)
    by = s.by("burst_index")
    for k, g in by.items():
        mask = s.bursts["burst_index"] == k
        assert g["bursts"]["n"] == mask.sum() and g["bursts"]["median"] == pytest.approx(
            float(np.median(s.bursts["error"][mask])), rel=1e-9)
    assert sum(g["bursts"]["n"] for g in s.by("burst_bytes").values()) == len(rows)
    with pytest.raises(InputError, match="by 'family': must be one of burst_index"):
        s.by("family")


def test_score_command_prints_writes_and_never_replaces_the_trace(tmp_path, capsys):
    rows, _ = _irregular(HOST, 5)
    trace = _write(tmp_path / "t.csv", rows)
    out = tmp_path / "per-burst.csv"
    assert main(["model", "score", str(trace), "-o", str(out), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["bursts"]["n"] == len(rows) and payload["bursts"]["max"] < 1e-6
    assert set(payload["families"]) == {"f1"}
    with open(out) as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows) and float(written[0]["predicted_ns"]) == pytest.approx(rows[0]["issue_ns"])
    assert main(["model", "score", str(trace), "--by", "burst_index"]) == 0
    text = capsys.readouterr().out
    assert "issue time per burst, model" in text and "bytes / r0" in text and "family f1:" in text
    assert "per-burst issue time by burst_index" in text and "burst_index 0 " in text
    before = trace.read_bytes()
    assert main(["model", "score", str(trace), "-o", str(trace)]) == 2
    assert trace.read_bytes() == before
    # the profile's path and the trace's must agree
    _write(tmp_path / "peer.csv", [dict(r, path="peer") for r in rows])
    assert main(["model", "score", str(tmp_path / "peer.csv")]) == 2
    assert "its path is peer, the profile's is host" in capsys.readouterr().err


def test_score_command_admits_the_shared_window_as_asked(tmp_path, capsys):
    # 40 CTAs, enough to fill the shared window: a trace the reference engine made under fair-share
    # admission scores zero when scored that way, and not under the profile's own first-come admission.
    rows, _ = _irregular(HOST.replace(admission="fair_share"), 3, n_cta=40)
    trace = _write(tmp_path / "t.csv", rows)
    assert main(["model", "score", str(trace), "--admission", "fair_share", "--json"]) == 0
    fair = json.loads(capsys.readouterr().out)
    assert fair["admission"] == "fair_share" and fair["bursts"]["max"] < 1e-6
    assert main(["model", "score", str(trace), "--json"]) == 0
    first_come = json.loads(capsys.readouterr().out)
    assert first_come["admission"] == "first_come" and first_come["bursts"]["max"] > 0.05
    assert main(["model", "score", str(trace), "--admission", "fair"]) == 2
    assert "--admission: invalid choice: 'fair'" in capsys.readouterr().err


GOOD = [_row(0, 0, 0, 4096, 0, 900), _row(0, 0, 1, 4096, 2000, 900), _row(0, 1, 0, 65536, 10, 1500)]


@pytest.mark.parametrize("change, message", [
    (lambda rs: [{k: v for k, v in r.items() if k != "start_ns"} for r in rs],
     r"columns \(launch, cta, burst_index, burst_bytes, issue_ns\) match none of the kinds read here: burst trace"),
    (lambda rs: [dict(rs[0], issue_ns="nan"), *rs[1:]], r"line 2, column issue_ns: nan: must be a finite"),
    (lambda rs: [rs[0], dict(rs[1], burst_bytes=-4096), rs[2]],
     r"line 3, column burst_bytes: -4096: must be a positive"),
    (lambda rs: [rs[0], rs[1], dict(rs[2], start_ns=-1)], r"line 4, column start_ns: -1: a time must be >= 0"),
    (lambda rs: [dict(rs[0], smid=3), dict(rs[1], smid=-1), dict(rs[2], smid=7)],
     r"line 3, column smid: -1: must be an integer >= 0"),
    (lambda rs: [rs[0], rs[1], dict(rs[2], cta=2)], r"launch 0: CTA 1 has no bursts, though CTA 2 has"),
    (lambda rs: [rs[0], dict(rs[1], burst_index=2), rs[2]], r"launch 0, CTA 0: burst 1 is missing"),
    (lambda rs: [rs[0], dict(rs[1], start_ns=500), rs[2]],
     r"line 3: launch 0, CTA 0: burst 1 starts at 500 ns, before burst 0 ends \(0 \+ 900 ns\)"),
    (lambda rs: [rs[0], dict(rs[1], burst_index=0), rs[2]],
     r"line 3: launch 0, CTA 0, burst 0 again \(first at .*line 2\)"),
    (lambda rs: [dict(r, family="a" if i else "b") for i, r in enumerate(rs)],
     r"line 3, column family: 'a', but launch 0"),
    (lambda rs: [dict(r, path="nvlink") for r in rs], r"line 2, column path: 'nvlink': must be one of"),
])
def test_malformed_traces_are_refused_in_one_line_naming_the_row(tmp_path, capsys, change, message):
    rows = change([dict(r) for r in GOOD])
    trace = _write(tmp_path / "t.csv", rows, columns=[c for c in rows[0]])
    with pytest.raises(InputError, match=message):
        read_trace(trace)
    out = tmp_path / "o.csv"
    assert main(["model", "score", str(trace), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()


def test_a_probe_long_file_is_a_trace_whose_ctas_start_together(tmp_path):
    # What `xstage probe` writes (raw/<sweep>.csv): the CTAs' bursts placed by their measured gaps.
    from xstage.model.data import LONG_COLUMNS

    rows = []
    for launch, (n_sm, nbytes, gap) in enumerate(((3, 65536, 2000.0), (5, 262144, 0.0))):
        progs = [[(float(nbytes), gap)] * 4 for _ in range(n_sm)]
        res = simulate_bursts(HOST, progs, engine="reference")
        for c in range(n_sm):
            for k in range(4):
                rows.append(dict(path="host", peer_mode="none", n_sm=n_sm, ctas_per_sm=1, warps=8, vector_bytes=16,
                                 burst_bytes=nbytes, gap_iters=int(gap), gap_ns=gap if k else "", launch=launch,
                                 cta=c, burst_index=k, issue_ns=res.issue_ns[c][k], completion_ns="", gpu="g",
                                 driver="d", torch="t", triton="x", git_commit="abc", date="2026-12-07"))
    trace = read_trace(_write(tmp_path / "first.csv", rows, LONG_COLUMNS))
    assert trace.path == "host" and [la.family for la in trace.launches] == ["3sm-65536B-g2000", "5sm-262144B-g0"]
    s = score_trace(trace, HOST)
    assert s.bursts["error"].max() < 1e-6 and s.launches["error"].max() < 1e-6
    broken = [dict(r, gap_ns="") if r["burst_index"] == 2 and r["cta"] == 1 else r for r in rows]
    with pytest.raises(InputError, match=r"line 8: burst 2 of launch 0, CTA 1 needs the burst before it and its "
                                         r"measured gap_ns"):
        read_trace(_write(tmp_path / "broken.csv", broken, LONG_COLUMNS))


def test_a_trace_is_told_from_other_files_and_the_columns_it_needs_are_named(tmp_path):
    ref = tmp_path / "ref.csv"
    _write(ref, [dict(dst="host", nblocks=1, burst_bytes=4096, gap_iters=0, issue_first=1, issue_2=1, issue_steady=1,
                      issue_max=1, gap_cycles=0, kernel_ms=1, agg_GBps=1)])
    with pytest.raises(InputError, match="looks like a reference probe CSV"):
        read_trace(ref)
    assert TRACE_COLUMNS == ["launch", "cta", "burst_index", "burst_bytes", "start_ns", "issue_ns"]
    with pytest.raises(InputError, match="engine 'exact': must be one of fast, reference"):
        score_trace(trace_from_rows(GOOD), PathParams(r0=50e9, c_sm=1e5, drain=50e9, capacity=4e6), engine="exact")


def test_a_start_within_a_nanosecond_of_the_previous_end_is_rounding_and_a_zero_gap():
    # Met while writing these tests: float sums put a zero-gap burst's start a hair before the last end.
    rows = [_row(0, 0, 0, 4096, 0, 900), _row(0, 0, 1, 4096, 899.5, 900)]
    (la,) = trace_from_rows(rows).launches
    assert la.programs()[0] == [[(4096.0, 0.0), (4096.0, 0.0)]]
    with pytest.raises(InputError, match="burst 1 starts at 898 ns, before burst 0 ends"):
        trace_from_rows([rows[0], dict(rows[1], start_ns=898)])
