"""Path `peer`: three ranks (processes) store bursts to one peer / to all peers, signal with release
flags, and every receiver waits for the flags and checks the bytes. On one GPU the ranks share it
(correctness only, not a timing); on a CPU they share memory through files (interpreter)."""

import multiprocessing as mp
import os

import pytest

from .peer_worker import probe_peer_worker

WORLD = 3


def test_peer_probe_one_and_all(tmp_path):
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    spawn = mp.get_context("spawn")
    result = str(tmp_path / "result")
    procs = [spawn.Process(target=probe_peer_worker, args=(r, WORLD, str(tmp_path / "store"), result))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("a rank of the peer probe did not finish within 300 s")
    assert all(p.exitcode == 0 for p in procs)
    for r in range(WORLD):
        lines = (tmp_path / f"result.{r}").read_text().splitlines()
        assert [ln.split()[0] for ln in lines] == ["one", "all"], r
        for ln in lines:
            mode, got, want, bad = ln.split()
            assert int(got) == int(want) > 0 and int(bad) == 0, (r, ln)
