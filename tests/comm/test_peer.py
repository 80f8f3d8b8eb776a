"""Path `peer` with two processes: shared-memory files on a CPU, symmetric memory on one GPU.

On one GPU both ranks share cuda:0 (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, gloo group); that
checks correctness only."""

from .exchange import peer_worker
from .ranks import run_ranks


def test_peer_ring_two_ranks(tmp_path):
    assert run_ranks(peer_worker, 2, tmp_path, 300, timeout=240) == ["ok", "ok"]
