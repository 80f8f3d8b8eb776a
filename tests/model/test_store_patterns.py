"""Where the tiles-beside-tile-stores experiment sends its rows (`--pattern`): host-side, so checked on CPU."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments" / "tiles_beside_tile_stores.py"


@pytest.fixture(scope="module")
def experiment():
    spec = importlib.util.spec_from_file_location("tiles_beside_tile_stores_experiment", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_uniform_rows_stay_inside_the_footprint(experiment):
    rows = experiment.destinations("uniform", 1000, 3, 5)
    assert rows.shape == (3, 5, experiment.BM) and rows.dtype == torch.int32
    assert int(rows.min()) >= 0 and int(rows.max()) < 1000


def test_combine_rows_follow_a_linear2_tile(experiment):
    hidden, n_dst, store = 1024, 1 << 16, 64
    blocks = hidden // experiment.BN  # 4 column blocks of 512 bytes per combine row
    rows = experiment.destinations(f"combine:{hidden}", n_dst, 2, 10, store)
    assert int(rows.max()) < n_dst
    for cta in range(2):
        for r in range(10):
            seg = rows[cta, r]
            # the column block of the round, the stored rows in routing (ascending) order
            assert bool(((seg % blocks) == r % blocks).all())
            assert bool((seg[:store].diff() >= 0).all())
            # one unit's rows for `blocks` rounds, then the next unit's
            same_unit = rows[cta, r - r % blocks] // blocks
            assert torch.equal(seg // blocks, same_unit)
        assert not torch.equal(rows[cta, 0] // blocks, rows[cta, blocks] // blocks)


@pytest.mark.parametrize("bad", ["combine", "combine:100", "combine:abc", "scatter"])
def test_a_malformed_pattern_is_refused(experiment, bad):
    with pytest.raises(SystemExit, match="--pattern"):
        experiment.destinations(bad, 1 << 16, 1, 2)
