"""Irregular trains: the committed families and split, the kernel's bytes (CPU interpreter), and
the timers turned into trace rows that `xstage model score` reads."""

import numpy as np
import pytest
import torch

from xstage.comm import create_context
from xstage.errors import InputError
from xstage.model.trace import trace_from_rows
from xstage.probe.runner import LaunchResult
from xstage.probe.trains import (
    FAMILIES,
    MAX_TRAIN_BURST,
    TRACE_ROW_COLUMNS,
    Train,
    expected_regions,
    launch_train,
    plan_trains,
    split,
    trace_rows,
)

POISON = -123456789


def test_the_split_names_every_family_once_and_holds_out_some_of_each_kind():
    d = split()
    assert set(d["families"]) == set(FAMILIES)
    held = {f for f, s in d["families"].items() if s == "heldout"}
    assert held and held != set(FAMILIES)


@pytest.mark.parametrize("sm_count", [132, 16, 3])
def test_every_family_plans_valid_trains_the_same_way_twice(sm_count):
    a, b = plan_trains("host", sm_count), plan_trains("host", sm_count)
    assert a == b and len(a) == len(FAMILIES) * split()["launches"]
    for t in a:
        assert 1 <= t.n_ctas <= sm_count and t.region_bytes <= MAX_TRAIN_BURST
    by = {f: [t for t in a if t.family == f] for f in FAMILIES}
    assert all(g == 0 for t in by["zero_gap"] for p in t.programs for _, g in p[1:])
    assert all(len({p[0][1] for p in t.programs}) > 1 for t in by["staggered"] if t.n_ctas > 4)
    if sm_count >= 16:  # (on 3 SMs, big_small's few choices can repeat)
        assert len({t.programs for t in a}) == len(a)  # seeds differ between launches


def test_bad_trains_are_refused_by_name():
    with pytest.raises(InputError, match=r"CTA 1, burst 0: burst_bytes 1000 must be a multiple of .* = 4096"):
        Train("mixed", 0, "host", (((4096, 0),), ((1000, 0),))).validate(8)
    with pytest.raises(InputError, match=r"9 CTAs; a train has 1\.\.8"):
        Train("mixed", 0, "host", ((((4096, 0),),) * 9)).validate(8)
    with pytest.raises(InputError, match=r"gap_iters -1 must be"):
        Train("mixed", 0, "host", (((4096, -1),),)).validate(8)
    with pytest.raises(InputError, match=r"path 'peer'"):
        Train("mixed", 0, "peer", (((4096, 0),),)).validate(8)
    with pytest.raises(InputError, match=r"families \['nope'\]"):
        plan_trains("host", 8, families=["nope"])


def test_the_kernel_writes_each_ctas_train_and_nothing_else(device):
    # warps=1, 4-byte stores: a step is 128 bytes; three CTAs of different lengths, sizes and gaps
    t = Train("mixed", 0, "hbm", (((256, 0), (128, 3), (384, 0)), ((128, 2),), ((384, 1), (256, 0))),
              warps=1, vector_bytes=4).validate(4)
    world, rank = 2, 0
    with create_context(path="hbm", loopback_world=world, rank=rank) as ctx:
        n = t.dest_elems(world) + 1024
        dest = ctx.alloc("trains", (n,), torch.int32)
        for p in dest.peers:
            p.fill_(POISON)
        raw = launch_train(ctx, dest, t)
        got = dest.peers[(rank + 1) % world].cpu().numpy()
        assert bool((dest.local.cpu() == POISON).all())
    region = t.region_bytes // 4
    written = np.zeros(n, dtype=bool)
    for c, want in enumerate(expected_regions(t, rank)):
        lo = (rank * t.n_ctas + c) * region
        have = got[lo:lo + region]
        assert np.array_equal(np.where(want == -1, POISON, want), have), c
        written[lo:lo + region] = True
    assert (got[~written] == POISON).all()
    assert raw.times.shape == (3, 3, 6) and raw.cta.shape == (3, 8)


def test_timers_become_trace_rows_on_one_time_line():
    # Two CTAs at 1 ns per cycle (clock and globaltimer advance together), CTA 1 leaving the common
    # start 40 ns after CTA 0; its first burst starts 100 cycles after it left.
    t = Train("staggered", 7, "host", (((4096, 0), (8192, 5)), ((4096, 9),)))
    times = np.zeros((2, 2, 6), dtype=np.int64)
    #             clk_gap clk_start clk_issued clk_done gt_start gt_issued
    times[0, 0] = [1000, 1010, 1510, 1510, 0, 0]
    times[0, 1] = [1510, 1600, 2600, 2600, 0, 0]
    times[1, 0] = [5000, 5100, 5900, 5900, 0, 0]
    cta = np.zeros((2, 8), dtype=np.int64)
    cta[0] = [0, 0, 10_000, 10_000, 3, 0, 2000, 1000]   # gt_begin clk_begin gt_end clk_end smid - gt_go clk_go
    cta[1] = [0, 0, 10_000, 10_000, 4, 0, 2040, 5000]
    rows = trace_rows(t, LaunchResult(times, cta), launch_index=11)
    assert list(rows[0]) == TRACE_ROW_COLUMNS and len(rows) == 3
    assert [(r["cta"], r["burst_index"], r["start_ns"], r["issue_ns"], r["smid"]) for r in rows] == [
        (0, 0, 10.0, 500.0, 3), (0, 1, 600.0, 1000.0, 3), (1, 0, 140.0, 800.0, 4)]
    trace = trace_from_rows(rows)
    (la,) = trace.launches
    progs, starts = la.programs()
    assert progs == [[(4096.0, 90.0), (8192.0, 0.0)], [(4096.0, 0.0)]] and starts == [0.0, 130.0]


def test_trains_are_recorded_resumably_and_launch_ids_continue(tmp_path, monkeypatch, device):
    from xstage.probe import session

    small = [Train("mixed", 1, "hbm", (((4096, 0), (8192, 2)), ((4096, 1),))),
             Train("ramp_down", 2, "hbm", (((8192, 0), (4096, 0)),))]
    monkeypatch.setattr(session, "plan_trains", lambda path, sm: small)
    env = {"git_commit": "abc1234"}
    with create_context(path="hbm", loopback_world=2) as ctx:
        first = session.measure_trains(ctx, tmp_path, "hbm", 4, env, repeats=2, progress=False)
        again = session.measure_trains(ctx, tmp_path, "hbm", 4, env, repeats=2, progress=False)
    assert first == {"trains_run": 2, "trains_skipped": 0} and again == {"trains_run": 0, "trains_skipped": 2}
    from xstage.results.io import read_rows

    rows = read_rows(tmp_path / "traces" / "irregular.csv")
    assert len(rows) == 2 * 3 + 2 * 2  # two launches of each train
    assert sorted({int(r["launch"]) for r in rows}) == [0, 1, 2, 3]
    assert {r["family"] for r in rows} == {"mixed", "ramp_down"} and {r["git_commit"] for r in rows} == {"abc1234"}
    done = (tmp_path / "traces" / "irregular.done").read_text().splitlines()
    assert done == [f"{small[0].label()} 0,1", f"{small[1].label()} 2,3"]


def test_analyse_only_scores_a_folders_traces_per_split(tmp_path, capsys):
    # A folder holding only traces (made by the reference engine, so the model's error is ~0 on both
    # sides): the analysis scores them per split and family and writes traces/score.json.
    from xstage.cli import main
    from xstage.model.profile import load_default_profile
    from xstage.model.simulate import simulate_bursts

    params = load_default_profile("host").params
    sides = split()["families"]
    held, train = next(f for f, s in sides.items() if s == "heldout"), next(f for f, s in sides.items() if s == "train")
    rows = []
    for launch, fam in enumerate((held, train, held)):
        progs = [[(4096.0 * (1 + c + k), 100.0 * k) for k in range(3)] for c in range(3)]
        res = simulate_bursts(params, progs, engine="reference")
        rows += [dict(launch=launch, cta=c, burst_index=k, burst_bytes=int(b), start_ns=res.start_ns[c][k],
                      issue_ns=res.issue_ns[c][k], family=fam, path="host")
                 for c, prog in enumerate(progs) for k, (b, _) in enumerate(prog)]
    (tmp_path / "traces").mkdir()
    import csv

    with open(tmp_path / "traces" / "irregular.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert main(["probe", "--path", "host", "--analyse-only", "-o", str(tmp_path), "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)["irregular"]["scores"]
    assert out["heldout"]["bursts"]["n"] == 18 and out["train"]["bursts"]["n"] == 9
    assert out["heldout"]["end"]["n"] == 2 and out["heldout"]["bursts"]["max"] < 1e-6
    assert set(out["heldout"]["families"]) == {held}
    assert json.loads((tmp_path / "traces" / "score.json").read_text()) == out
    assert not (tmp_path / "summary.md").exists()  # no regular sweep here: no regular analysis
