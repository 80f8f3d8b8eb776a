"""Path `peer`: three ranks (processes) store bursts to one peer / to all peers, signal with release
flags, and every receiver waits for the flags and checks the bytes. On one GPU the ranks share it
(correctness only, not a timing); on a CPU they share memory through files (interpreter)."""

from tests.comm.ranks import run_ranks

from .peer_worker import probe_peer_worker

WORLD = 3


def test_peer_probe_one_and_all(tmp_path):
    results = run_ranks(probe_peer_worker, WORLD, tmp_path)
    for r, text in enumerate(results):
        lines = text.splitlines()
        assert [ln.split()[0] for ln in lines] == ["one", "all"], r
        for ln in lines:
            mode, got, want, bad = ln.split()
            assert int(got) == int(want) > 0 and int(bad) == 0, (r, ln)
