"""Ulysses in a spawned group of 3 ranks (gloo; the CPU interpreter, or ranks sharing one GPU): a rank
with no token (2 tokens over 3 ranks) or no head (H < P) takes its part in every exchange, and a
refusal on some ranks reaches every rank as one agreed line, nobody left waiting
(tests/attention/ranks_agree.py does the work; one spawn per test, each rank's collectives bounded)."""

import pytest
import torch

from tests.attention.ranks_agree import worker
from tests.comm.ranks import run_ranks


@pytest.mark.slow
def test_empty_ranks_and_agreed_refusals_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the GPU variant runs instead")
    assert run_ranks(worker, 3, tmp_path, False, timeout=900) == ["ok"] * 3


@pytest.mark.gpu
def test_empty_ranks_and_agreed_refusals_sharing_one_gpu(tmp_path):
    assert run_ranks(worker, 3, tmp_path, True, timeout=600) == ["ok"] * 3
