"""Path `peer` with two processes: shared-memory files on a CPU, symmetric memory on one GPU.

On one GPU both ranks share cuda:0 (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, gloo group); that
checks correctness only."""

import multiprocessing as mp
import os

import pytest

from .exchange import peer_worker


def _run_ring(tmp_path, world, n_elem):
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    spawn = mp.get_context("spawn")
    result = str(tmp_path / "result")
    procs = [spawn.Process(target=peer_worker, args=(r, world, str(tmp_path / "store"), n_elem, result))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("a rank of the ring exchange did not finish within 240 s")
    for r in range(world):
        assert (tmp_path / f"result.{r}").read_text() == "ok", f"rank {r}"
    assert all(p.exitcode == 0 for p in procs)


def test_peer_ring_two_ranks(tmp_path):
    _run_ring(tmp_path, 2, 300)
