"""The TMA-store repro (`benchmarks/experiments/tma_store_repro.py`) on CPU: the interpreter's emulation of a
tensor-descriptor store writes exactly the clipped rows of the destination region (sentinel elsewhere)."""

import csv
import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments" / "tma_store_repro.py"


def _load():
    spec = importlib.util.spec_from_file_location("tma_store_repro", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter's run")
def test_host_descriptor_store_clips_rows_on_cpu(tmp_path):
    rows = _load().main(["--out", str(tmp_path)])
    got = {(r["destination"], r["descriptor"], r["D"], r["case"]): r["result"] for r in rows}
    for d in (128, 64):
        for case in ("inside", "straddle_start", "straddle_end"):
            assert got[("device", "host_desc", d, case)] == "ok", (d, case)
        for dest in ("host_pinned", "peer_gpu"):
            assert got[(dest, "host_desc", d, "inside")] == "skipped: no GPU"
    with open(tmp_path / "tma_store_repro.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows) == 3 * 2 * 2 * 3
    md = (tmp_path / "tma_store_repro.md").read_text()
    assert "| device | host_desc | 128 | straddle_end | ok |" in md and "triton" in md
