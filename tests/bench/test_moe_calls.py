"""`xstage bench moe-calls`: the two sides give the same output on the same inputs (transformers' own
experts module, where transformers is installed), the rows and their summary, the loader's refusals, and
the command's answers on a machine without a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xstage.bench.moe_calls import (
    COLUMNS,
    KEYS,
    MODELS,
    RESULTS,
    CallPair,
    ModelSpec,
    measure_pair,
    read_calls_csv,
    summarize,
)
from xstage.errors import InputError
from xstage.moe import BlockConfig, reference_moe_virtual
from xstage.results import ResultWriter, read_rows

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {"gpu": "test GPU", "driver": "1", "torch": "2", "triton": "3", "git_commit": "abc1234", "date": "2026-01-01"}
TINY = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32, num_warps=4, num_stages=2)


def _tiny(name: str, shape: str = "H64-I32-E8-K2") -> ModelSpec:
    """A model's transformers classes at a width the interpreter runs in a moment."""
    return ModelSpec(**{**MODELS[name].__dict__, "name": f"tiny-{name}", "shape": shape})


def test_widths_are_transformers_own_defaults():
    pytest.importorskip("transformers")
    import importlib

    for spec in MODELS.values():
        root = f"transformers.models.{spec.package}.configuration_{spec.package}"
        c = getattr(importlib.import_module(root), spec.config)()
        got = (c.hidden_size, getattr(c, spec.intermediate_key), getattr(c, spec.experts_key), c.num_experts_per_tok)
        assert got == tuple(spec.dims()), (spec.name, got)
        assert c.hidden_act == "silu"  # the SwiGLU both sides compute


@pytest.mark.parametrize("name", list(MODELS))
def test_both_sides_compute_the_same_layer(name):
    pytest.importorskip("transformers")
    pair = CallPair(_tiny(name), 16, "cpu", torch.float16, config=TINY)
    assert pair.experts.config._experts_implementation == "grouped_mm"
    assert pair.w2.data_ptr() == pair.experts.down_proj.data_ptr()  # the same weights, not a copy
    x, routes = pair.inputs(12)
    assert len(routes) == 16 and len({i.data_ptr() for i, _ in routes}) == 16
    ref = reference_moe_virtual([x.double()], [routes[0][0]], [routes[0][1].double()],
                                [pair.experts.gate_up_proj.double()], [pair.experts.down_proj.double()],
                                dtype=torch.float64)[0]
    with torch.no_grad():
        ys = {side: call(*routes[0]) for side, call in (("xstage", pair.xstage_call(x)),
                                                        ("transformers", pair.transformers_call(x)))}
    scale = float(ref.abs().max())
    for side, y in ys.items():
        assert y.shape == x.shape and y.dtype == torch.float16
        assert float((y.double() - ref).abs().max()) <= 2e-2 * scale, side  # the bench's 16-bit tolerance
    assert float((ys["xstage"].double() - ys["transformers"].double()).abs().max()) <= 2e-2 * scale


def test_rows_and_summary_of_a_measured_pair(tmp_path):
    pytest.importorskip("transformers")
    pair = CallPair(_tiny("qwen3-30b-a3b"), 16, "cpu", torch.float16, config=TINY)
    rows = measure_pair(pair, 12, warmup=0, rep=1, calls=16, profiled=1)
    assert [r["side"] for r in rows] == ["xstage", "transformers"]
    assert rows[0]["impl"] == "interleaved" and rows[1]["impl"] == "grouped_mm"
    for r in rows:
        assert float(r["call_ns"]) > 0 and r["max_err"] <= 2e-2
        assert r["graph_ns"] == "" and "graph: CUDA graphs need a GPU" in r["call_note"]
    assert float(rows[0]["kernel_ns"]) > 0 and rows[1]["kernel_ns"] == ""  # the profiler's sum needs a GPU
    assert rows[0]["launches"] >= 2  # Triton's launches; transformers' torch operations are CPU work here
    writer = ResultWriter(tmp_path / RESULTS, COLUMNS, KEYS, env=ENV)
    writer.write_many(rows)
    summary = summarize(tmp_path)
    got = summary["tiny-qwen3-30b-a3b"][12]
    assert got["call"] == pytest.approx(rows[1]["call_ns"] / rows[0]["call_ns"], rel=1e-9)
    assert got["kernels"] is None and got["kept"] is None and got["graph"] is None
    text = (tmp_path / "summary.md").read_text()
    assert f"| tiny-qwen3-30b-a3b | H64-I32-E8-K2 | 12 | {rows[1]['call_ns'] / 1e3:.1f} |" in text
    assert "commit abc1234" in text


def _row(**kw):
    base = dict(model="qwen3-30b-a3b", shape="H2048-I768-E128-K8", H=2048, I=768, E=128, K=8, tokens=64,
                dtype="bf16", side="xstage", impl="interleaved", kernel_ns=400e3, call_ns=500e3, host_ns=30e3,
                host_p10_ns=20e3, host_p90_ns=40e3, launches=3, syncs=0, graph_ns=410e3, call_note="", max_err=1e-3)
    return {**base, **kw}


def _write(folder, rows):
    writer = ResultWriter(folder / RESULTS, COLUMNS, KEYS, env=ENV)
    writer.write_many(rows)
    return folder


def test_summary_ratios_and_targets(tmp_path):
    rows = []
    for tokens, (tf_call, xs_call, tf_k, xs_k, tf_g, xs_g) in {
            64: (530e3, 500e3, 500e3, 380e3, 520e3, 390e3),  # graphs: 1.33x, met
            512: (900e3, 800e3, 880e3, 700e3, 890e3, 710e3),  # kept (900/800)/(880/700) = 0.895: missed
            4096: (1900e3, 950e3, 1850e3, 900e3, 1880e3, 920e3)}.items():  # kept 2.0 / 2.056 = 0.973: met
        rows += [_row(tokens=tokens, call_ns=xs_call, kernel_ns=xs_k, graph_ns=xs_g),
                 _row(tokens=tokens, side="transformers", impl="grouped_mm", call_ns=tf_call, kernel_ns=tf_k,
                      graph_ns=tf_g, launches=14)]
    summary = summarize(_write(tmp_path, rows))["qwen3-30b-a3b"]
    assert summary[512]["kept"] == pytest.approx((900 / 800) / (880 / 700))
    assert summary[64]["graph"] == pytest.approx(520 / 390)
    text = (tmp_path / "summary.md").read_text()
    assert "- from 512 tokens the call keeps >= 95% of the kernels' ratio: met in 1 of 2" in text
    assert "- under CUDA graphs the call is >= 1.0x transformers' at 64 tokens: met in 1 of 1" in text
    assert "| 14 / 3 |" in text


def test_summary_names_why_a_graph_is_missing(tmp_path):
    rows = [_row(graph_ns="", call_note="graph: capture failed: RuntimeError: a sync"),
            _row(side="transformers", impl="grouped_mm")]
    summarize(_write(tmp_path, rows))
    text = (tmp_path / "summary.md").read_text()
    assert ("no pair captured; not captured: qwen3-30b-a3b xstage: graph: capture failed: RuntimeError: a sync"
            in text)


@pytest.mark.parametrize("change, needle", [
    (dict(side="vllm"), "column side: 'vllm' is not one of xstage, transformers"),
    (dict(H=4096), "column H: 4096 differs from the shape H2048-I768-E128-K8"),
    (dict(shape="H2048-I768"), "column shape"),
    (dict(call_ns="fast"), "column call_ns: 'fast' is not a number"),
    (dict(kernel_ns="-1"), "column kernel_ns: -1: a time must be > 0 ns"),
    (dict(launches="x"), "column launches: 'x' is not an integer"),
    (dict(max_err="small"), "column max_err: 'small' is not a number"),
    (dict(model=""), "column model: empty"),
])
def test_loader_refuses_a_malformed_row_before_writing(tmp_path, change, needle):
    folder = _write(tmp_path, [_row(), _row(**change, tokens=512)])
    with pytest.raises(InputError, match=needle):
        read_calls_csv(folder / RESULTS)
    with pytest.raises(InputError, match="line 3"):
        summarize(folder)
    assert not (folder / "summary.md").exists()


def test_loader_names_a_file_of_another_kind(tmp_path):
    (tmp_path / RESULTS).write_text("shape,H,I,E,K,tokens,ep,path,variant,time_ns,block,ctas\n"
                                    "H64-I32-E4-K2,64,32,4,2,8,2,host,expert_wave,100,16x16x32x32,1\n")
    with pytest.raises(InputError, match="looks like a MoE results CSV .* not a MoE call comparison CSV"):
        read_calls_csv(tmp_path / RESULTS)


def _cli(*args, cwd):
    env = {"PYTHONPATH": SRC, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "xstage", "bench", "moe-calls", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_command_refuses_without_a_gpu_and_summarises_anywhere(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("there it would measure")
    res = _cli("-o", "new", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "xstage bench moe-calls: error: needs a CUDA GPU (--summarize-only runs anywhere)"], res.stderr
    res = _cli("-o", "new", "--only", "model=gpt-5", cwd=tmp_path)
    assert res.returncode == 2 and "--only model=gpt-5: selects none" in res.stderr
    assert not (tmp_path / "new").exists()
    _write(tmp_path, [_row(), _row(side="transformers", impl="grouped_mm", call_ns=600e3)])
    res = _cli("-o", ".", "--summarize-only", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert '"call": 1.2' in res.stdout and (tmp_path / "summary.md").exists()
    assert len(read_rows(tmp_path / RESULTS)) == 2  # the results are read, never rewritten


@pytest.mark.gpu
def test_gpu_pair_is_measured_on_both_sides():
    pytest.importorskip("transformers")
    pair = CallPair(_tiny("mixtral-8x7b", "H512-I256-E8-K2"), 512, "cuda")
    xs, tf = measure_pair(pair, 256, warmup=1, rep=3, calls=32, profiled=2)
    assert xs["max_err"] <= 2e-2 and float(xs["kernel_ns"]) > 0 and float(tf["kernel_ns"]) > 0
    assert tf["launches"] > 3  # sort, gathers, two grouped GEMMs, SwiGLU, the weighted sum
    assert tf["graph_ns"] != "", tf["call_note"]  # transformers' grouped_mm path captures
    assert xs["graph_ns"] != "" or "graph: " in xs["call_note"]
