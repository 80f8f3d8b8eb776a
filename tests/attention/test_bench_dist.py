"""`python3 -m xstage.bench.ulysses_dist` on two processes (torchrun, gloo, CPU interpreter), and its report."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xstage.bench import ulysses_dist as ud
from xstage.cli.ulysses_dist import main as ulysses_dist_main
from xstage.errors import InputError
from xstage.results import ResultWriter, read_rows

ROOT = Path(__file__).resolve().parents[2]
ALL_VARIANTS = set(ud.VARIANTS)


def _common(heads, dim, tokens, P=2):
    return {"heads": heads, "dim": dim, "tokens": tokens, "P": P, "path": "peer", "rank": 0}


def test_grid_is_the_issue_grid_at_the_world_size():
    cfgs = ud.grid_configs(4)
    assert len(cfgs) == 18 and {c["P"] for c in cfgs} == {4}
    assert {(c["heads"], c["dim"]) for c in cfgs} == {(24, 128), (40, 128), (30, 64)}
    assert [c["tokens"] for c in cfgs] == sorted(c["tokens"] for c in cfgs)


def test_outside_torchrun_is_an_input_error(monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(InputError, match="torchrun"):
        ulysses_dist_main(["-o", str(tmp_path)])


def test_report_ratios(tmp_path):
    w = ResultWriter(tmp_path / ud.CSV_NAME, ud.COLUMNS, ud.KEY_COLUMNS)
    times = {"pre_alltoall": 20e3, "attention": 100e3, "serial_triton": 180e3, "serial_cudnn": 160e3,
             "fused": 130e3}
    for variant, t in times.items():
        w.write({**_common(24, 128, 4608), "variant": variant, "sender_ns": 115e3 if variant == "fused" else t,
                 "receiver_ns": t, "rel_err": 0.0 if variant == "fused" else "", "exchange_ok": 1})
    text = ud.write_report(tmp_path).read_text()
    header = next(line for line in text.splitlines() if line.startswith("| heads x dim"))
    row = next(line for line in text.splitlines() if line.startswith("| 24x128"))
    cells = dict(zip((c.strip() for c in header.strip("|").split("|")), (c.strip() for c in row.strip("|").split("|"))))
    assert float(cells["serial/fused"]) == pytest.approx(180 / 130, rel=1e-2)
    assert float(cells["serial_cudnn/fused"]) == pytest.approx(160 / 130, rel=1e-2)
    assert float(cells["fused/attn"]) == pytest.approx(1.3, rel=1e-2)
    assert float(cells["post_exposed_us"]) == pytest.approx(10, rel=1e-2)
    assert float(cells["fused_send_us"]) == pytest.approx(115, rel=1e-2)


def test_two_ranks_under_torchrun(tmp_path):
    """Two gloo ranks in the interpreter (fp16): every variant of every tiny configuration gets a
    row, fused and serial agree, both match the float64 reference, and a configuration already in
    the CSV is not measured again."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter run; the device run uses benchmarks/ulysses_multi_gpu.sh")
    seeded = _common(4, 16, 40)
    w = ResultWriter(tmp_path / ud.CSV_NAME, ud.COLUMNS, ud.KEY_COLUMNS)
    for variant in ud.VARIANTS:
        w.write({**seeded, "variant": variant, "sender_ns": 1.0, "receiver_ns": 1.0})
    env = {**os.environ, "TRITON_INTERPRET": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "xstage.bench.ulysses_dist", "-o", str(tmp_path), "--tiny", "--dtype", "fp16",
           "--warmup", "0", "--rep", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_rows(tmp_path / ud.CSV_NAME)
    by_cfg: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (int(r["heads"]), int(r["dim"]), int(r["tokens"]))
        assert r["variant"] not in by_cfg.setdefault(key, {}), f"duplicate row {key} {r['variant']}"
        by_cfg[key][r["variant"]] = r
    assert set(by_cfg) == {(h, d, t) for (h, d) in ud.TINY_SHAPES for t in ud.TINY_TOKENS}
    assert all(set(v) == ALL_VARIANTS for v in by_cfg.values())
    assert all(float(r["sender_ns"]) == 1.0 for r in by_cfg[(4, 16, 40)].values()), "seeded rows rewritten"
    for key, v in by_cfg.items():
        if key == (4, 16, 40):
            continue
        f = v["fused"]
        assert f["path"] == "peer" and f["P"] == "2" and f["backend"] == "gloo" and f["dtype"] == "fp16"
        assert f["exchange"] == "stores:paced"
        assert f["exchange_ok"] == "1" and float(f["rel_err"]) <= 1e-2, (key, f)
        for name in ("serial_triton", "serial_cudnn", "fused"):
            assert float(v[name]["ref_err"]) <= 2e-3, (key, name, v[name]["ref_err"])
        for name in ud.VARIANTS:
            assert float(v[name]["receiver_ns"]) > 0
        assert float(f["sender_ns"]) > 0
        # 5 heads over 2 ranks: rank 0 owns 3; 67 tokens: rank 0 holds 34
        if key[0] == 5:
            assert f["rank_heads"] == "3"
            assert int(f["remote_bytes"]) == (key[2] - (key[2] + 1) // 2) * 3 * key[1] * 2
    summary = (tmp_path / "summary.md").read_text()
    assert sum(line.startswith("| 5x32") for line in summary.splitlines()) == 2
