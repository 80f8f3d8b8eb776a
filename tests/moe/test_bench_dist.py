"""The multi-process MoE bench (`python -m xstage.bench.moe_dist`) on two CPU ranks under gloo.

The ranks run the fused kernel in Triton's interpreter over shared-memory "peer" buffers and the
unfused pipeline over gloo all-to-alls; their outputs are checked against a float64 reference
rebuilt in this process from the same per-rank inputs.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xstage.bench.calls import CALL_COLUMNS
from xstage.bench.moe_dist import TINY_SHAPES, TINY_TOKENS, make_inputs, peer_configs
from xstage.cli.moe_dist import main
from xstage.errors import InputError
from xstage.moe import reference_moe_virtual
from xstage.results import read_rows

SRC = str(Path(__file__).resolve().parents[2] / "src")
SCHEDULES = ("expert_wave", "lag:1", "interleaved", "lag:1@40:64")  # the last one with paced stores


def test_peer_grid_is_the_ep_slice_of_the_grid():
    cfgs = peer_configs(2)
    assert len(cfgs) == 28 and {c["ep"] for c in cfgs} == {2}
    assert len({(c["shape"], c["tokens"]) for c in cfgs}) == 28
    with pytest.raises(InputError, match="world size 3"):
        peer_configs(3)


def test_needs_a_launcher(monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(InputError, match="torchrun"):
        main(["-o", str(tmp_path)])


def _launch(out, env, *extra, timeout=150):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "xstage.bench.moe_dist", "-o", str(out), "--tiny", "--warmup", "0", "--rep", "1",
           "--schedules", ",".join(SCHEDULES), "--dump-outputs", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]), **env)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _check(out, device, dtype, tol):
    """CSV rows of the peer path, and every rank's outputs against a float64 reference of all ranks
    built here from the inputs each rank generated (same seeds, same device type)."""
    rows = read_rows(out / "moe.csv")
    assert [r["variant"] for r in rows] == [*SCHEDULES, "unfused"]
    assert all(r["path"] == "peer" and r["ep"] == "2" and float(r["time_ns"]) > 0 for r in rows)
    assert all(float(r["time_p10_ns"]) <= float(r["time_ns"]) <= float(r["time_p90_ns"]) for r in rows[:-1])
    assert all(float(r["max_err"]) < tol for r in rows[:-1])  # fused vs unfused, first run
    for r in rows[:-1]:  # every fused variant's public call, on both ranks together (the slowest counts)
        assert float(r["call_ns"]) > 0 and float(r["reduce_host_ns"]) > 0, r
        assert float(r["host_p10_ns"]) <= float(r["host_ns"]) <= float(r["host_p90_ns"])
        assert int(r["launches"]) >= 2  # the main kernel and the reduce at least
        if device == "cpu":
            assert r["graph_ns"] == "" and "graph: CUDA graphs need a GPU" in r["call_note"]
    assert all(rows[-1][c] == "" for c in CALL_COLUMNS)  # the unfused baseline is not a call
    assert "Path `peer`" in (out / "summary.md").read_text()
    (shape, dims), T = next(iter(TINY_SHAPES.items())), TINY_TOKENS[0]
    ins = [[t.cpu() for t in make_inputs(dims, T, r, 2, device, dtype)] for r in range(2)]
    ref = reference_moe_virtual(*[[t[i].double() if i != 1 else t[i] for t in ins] for i in range(5)],
                                dtype=torch.float64)
    for r in range(2):
        outs = torch.load(out / f"outputs-rank{r}.pt")
        scale = float(ref[r].abs().max())
        for v in [*SCHEDULES, "unfused"]:
            err = float((outs[(shape, T, v)].double() - ref[r]).abs().max())
            assert err <= tol * scale, (r, v, err, scale)
    return rows


def test_two_cpu_ranks_gloo_rows_and_outputs(tmp_path):
    _launch(tmp_path, dict(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1"))
    _check(tmp_path, "cpu", torch.float32, 1e-4)
    (tmp_path / "summary.md").unlink()
    assert main(["-o", str(tmp_path), "--summarize-only"]) == 0  # no launcher needed to summarise
    assert "Path `peer`" in (tmp_path / "summary.md").read_text()


@pytest.mark.multi_gpu
def test_two_gpus_nccl_rows_and_outputs(tmp_path):
    res = _launch(tmp_path, {}, timeout=300)
    assert "backend nccl" in res.stdout
    _check(tmp_path, "cuda", torch.bfloat16, 2e-2)
