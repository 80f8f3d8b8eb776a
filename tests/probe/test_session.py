"""Resumable, sliceable sweep runs (the plumbing, in the interpreter: timers read 0 there)."""

import pytest
import torch

from tests.comm.ranks import run_ranks
from xstage.errors import InputError
from xstage.model.data import LONG_COLUMNS
from xstage.probe.session import measure
from xstage.results.io import read_rows

from .peer_worker import measure_worker

SLICE = ["burst_bytes=4096", "n_sm=1,4"]


def test_measure_writes_resumes_and_slices(tmp_path):
    first = measure(tmp_path, "hbm", ["first", "twoburst"], only=SLICE + ["gap_iters=0,500"], repeats=2,
                    progress=False, allow_interpreter=True)
    # first: n_sm 1 and 4 at 4 KiB; twoburst plans only n_sm = 4 (the whole "GPU") at 64/256 KiB.
    assert first["configs_run"] == 2 and first["configs_skipped"] == 0
    rows = read_rows(tmp_path / "raw" / "first.csv")
    assert list(rows[0]) == list(LONG_COLUMNS)
    assert len(rows) == 2 * (1 + 4)                          # repeats x CTAs x 1 burst
    assert len({r["launch"] for r in rows}) == 4
    again = measure(tmp_path, "hbm", ["first"], only=["n_sm=1,4", "burst_bytes=4096,8192"], repeats=1,
                    progress=False, allow_interpreter=True)
    assert again["configs_run"] == 2 and again["configs_skipped"] == 2
    rows = read_rows(tmp_path / "raw" / "first.csv")
    launches = [int(r["launch"]) for r in rows]
    assert len(set(launches)) == 6 and launches == sorted(launches)
    assert {r["burst_bytes"] for r in rows} == {"4096", "8192"}
    done = (tmp_path / "raw" / "first.done").read_text().splitlines()
    assert len(done) == 4 and all(len(line.split()) == 2 for line in done)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the run is a real measurement")
def test_measure_refuses_the_interpreter_by_default(tmp_path):
    with pytest.raises(InputError, match="needs a CUDA GPU"):
        measure(tmp_path, "host", ["first"], only=SLICE, progress=False)


def test_measure_on_peer_path_runs_in_step(tmp_path):
    """Two ranks run the same slice; rank 0 writes, and the peers sweep keeps its own copy of a
    configuration that the first sweep also has."""
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4
    out = tmp_path / "out"
    got = run_ranks(measure_worker, 2, tmp_path, str(out), n_sm)
    n_first, n_peers = 1, 4               # peers: one/all x n_bursts 1/16 on the whole GPU
    assert [g.split()[0] for g in got] == [str(n_first + n_peers)] * 2
    rows = read_rows(out / "raw" / "first.csv")
    assert {r["peer_mode"] for r in rows} == {"one"} and len(rows) == n_sm
    peers = read_rows(out / "raw" / "peers.csv")
    assert {r["peer_mode"] for r in peers} == {"one", "all"} and len(peers) == n_sm * (1 + 1 + 16 + 16)
