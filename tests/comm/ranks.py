"""Run a test body as several ranks (spawned processes sharing a file:// store and a GPU or the CPU)."""

import multiprocessing as mp
import os

import pytest


def run_ranks(target, world, tmp_path, *extra, timeout=300):
    """Call `target(rank, world, init_file, result_file, *extra)` in `world` processes; return each
    rank's result file text. Fails the test if a rank hangs or exits with an error."""
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    spawn = mp.get_context("spawn")
    result = str(tmp_path / "result")
    procs = [spawn.Process(target=target, args=(r, world, str(tmp_path / "store"), result, *extra))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail(f"a rank did not finish within {timeout} s")
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [(tmp_path / f"result.{r}").read_text() for r in range(world)]
