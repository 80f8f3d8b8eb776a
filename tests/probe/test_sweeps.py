"""Sweep planning and the `xstage probe` command line (no GPU needed)."""

import json

import pytest

from xstage.cli import main
from xstage.errors import InputError
from xstage.probe.sweeps import PATH_SWEEPS, parse_sweeps, plan

from .synthetic import write_folder


@pytest.mark.parametrize("sm_count", [132, 78, 16], ids=["SM132", "SM78", "SM16"])
def test_every_sweep_varies_bytes_and_sms_independently(sm_count):
    for path in ("host", "peer"):
        by_sweep = {}
        for sweep, cfg in plan(parse_sweeps("all", path), path, sm_count):
            by_sweep.setdefault(sweep, []).append(cfg)
        assert set(by_sweep) == set(PATH_SWEEPS[path])
        for sweep, cfgs in by_sweep.items():
            sms = {c.n_sm for c in cfgs}
            assert max(sms) == sm_count and all(1 <= n <= sm_count for n in sms), sweep
            if sweep in ("first", "periodic", "completion"):
                # a full cross product: every size at every SM count
                grid = {(c.n_sm, c.burst_bytes) for c in cfgs}
                assert len(grid) == len(sms) * len({c.burst_bytes for c in cfgs}) and len(sms) >= 2, sweep
            assert len({c.label() for c in cfgs}) == len(cfgs), f"duplicate configurations in {sweep}"


def test_sweep_shapes():
    cfgs = dict.fromkeys(("first", "periodic", "twoburst", "completion", "knobs"), None)
    for sweep, cfg in plan(list(cfgs), "host", 132):
        cfgs[sweep] = cfgs[sweep] or []
        cfgs[sweep].append(cfg)
    assert {c.n_bursts for c in cfgs["first"]} == {1} and {c.gap_iters for c in cfgs["first"]} == {0}
    assert {c.n_bursts for c in cfgs["periodic"]} == {16} and len({c.gap_iters for c in cfgs["periodic"]}) >= 4
    assert {c.n_bursts for c in cfgs["twoburst"]} == {2} and len({c.gap_iters for c in cfgs["twoburst"]}) >= 10
    assert {c.completion for c in cfgs["completion"]} == {"fence"}
    assert {(c.warps, c.vector_bytes) for c in cfgs["knobs"]} >= {(4, 16), (16, 16), (8, 8), (8, 4)}
    assert all(c.peer_mode == "none" and c.path == "host" for v in cfgs.values() for c in v)
    peers = [c for s, c in plan(["peers"], "peer", 132)]
    assert {c.peer_mode for c in peers} == {"one", "all"}


@pytest.mark.parametrize(
    "spec, path, match",
    [("bogus", "host", "--sweep"), ("peers", "host", "not available"), ("", "host", "--sweep"),
     ("all", "nvlink", "--path")],
)
def test_parse_sweeps_rejects(spec, path, match):
    with pytest.raises(InputError, match=match):
        parse_sweeps(spec, path)


def test_cli_plan_counts_and_slices(capsys):
    assert main(["probe", "--path", "host", "--plan", "--sm-count", "132", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["configs"]
    assert len(full) == len(plan(PATH_SWEEPS["host"], "host", 132))
    assert main(["probe", "--path", "host", "--plan", "--sm-count", "132", "--only", "sweep=first",
                 "--only", "n_sm=8,132", "--json"]) == 0
    part = json.loads(capsys.readouterr().out)["configs"]
    assert len(part) == 20 and {c["n_sm"] for c in part} == {8, 132} and {c["sweep"] for c in part} == {"first"}


def test_cli_errors_exit_2(capsys, tmp_path):
    assert main(["probe", "--path", "host", "--sweep", "peers", "--plan"]) == 2
    assert "not available on path host" in capsys.readouterr().err
    assert main(["probe", "--path", "host", "--plan", "--only", "colour=red"]) == 2
    assert main(["probe", "--analyse-only", "-o", str(tmp_path / "empty")]) == 2
    assert "neither raw" in capsys.readouterr().err


def test_cli_analyse_only(tmp_path, capsys):
    write_folder(tmp_path, ["first", "twoburst"], sm_count=4, repeats=1)
    assert main(["probe", "--analyse-only", "--no-fit", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "summary rows" in out and (tmp_path / "summary.md").exists()
