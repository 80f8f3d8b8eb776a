"""The call-timing helper (`xstage.bench.calls`): its bookkeeping on the CPU (counts, inputs cycled, one
sync at the end, launches counted by Triton's interpreter), and on a GPU the profiler's launch count and
the graph replay (captured, checked against eager calls, or refused with its reason)."""

import pytest
import torch
import triton
import triton.language as tl

from xstage.bench.calls import (
    CallMeasure,
    count_launches,
    interpreter_launches,
    measure_call,
    time_calls,
    time_graph,
)
from xstage.env import interpreter_active
from xstage.errors import InputError


class Recorder:
    """A call, a clock and a sync that write what happens, in order, to one log; each call takes 100 ns
    of the fake clock and the sync 1000 ns."""

    def __init__(self):
        self.log, self.t = [], 0

    def call(self, x):
        self.log.append(("call", int(x[0])))
        self.t += 100

    def clock(self):
        return self.t

    def sync(self):
        self.log.append(("sync",))
        self.t += 1000


def _inputs(n):
    return [(torch.full((3,), float(i)),) for i in range(n)]


def test_time_calls_cycles_the_inputs_and_syncs_once_after_the_last_call():
    rec = Recorder()
    t = time_calls(rec.call, _inputs(16), 40, warmup=0, sync=rec.sync, clock=rec.clock)
    assert rec.log == [("call", i % 16) for i in range(40)] + [("sync",)]
    assert (t.calls, t.routings) == (40, 16)
    assert t.call_ns == pytest.approx(100 + 1000 / 40)  # the final sync's wait is spread over the calls
    assert (t.host.median_ns, t.host.p10_ns, t.host.p90_ns, t.host.runs) == (100, 100, 100, 40)


def test_time_calls_warms_up_apart_from_the_timed_calls():
    rec = Recorder()
    time_calls(rec.call, _inputs(16), 16, warmup=2, sync=rec.sync, clock=rec.clock)
    # two untimed calls on the last inputs, a sync, then the timed calls from the first input on
    assert rec.log[:3] == [("call", 15), ("call", 14), ("sync",)]
    assert rec.log[3:] == [("call", i) for i in range(16)] + [("sync",)]


def test_time_calls_host_time_is_per_call():
    rec = Recorder()
    costs = iter([100, 300] * 10)

    def call(x):
        rec.t += next(costs)

    t = time_calls(call, _inputs(4), 20, warmup=0, sync=rec.sync, clock=rec.clock)
    assert t.host.median_ns == 200 and t.host.p10_ns == 100 and t.host.p90_ns == 300
    assert t.call_ns == pytest.approx((20 * 200 + 1000) / 20)


@pytest.mark.parametrize("inputs, calls, needle", [
    ([], 10, "at least one"),
    (_inputs(16), 15, "calls=15: must be an integer >= the 16 inputs"),
    (_inputs(2), True, "calls=True"),
])
def test_time_calls_refuses_what_would_not_cycle(inputs, calls, needle):
    with pytest.raises(InputError, match=needle):
        time_calls(lambda x: None, inputs, calls)


def test_inputs_sharing_a_tensor_are_refused():
    a, b = torch.zeros(3), torch.ones(3)
    with pytest.raises(InputError, match="inputs 0 and 2: share a tensor"):
        time_calls(lambda x, y: None, [(a, b), (torch.ones(3), torch.ones(3)), (torch.ones(3), b)], 3)
    with pytest.raises(InputError, match="share a tensor"):  # a view of the same storage start
        time_calls(lambda x: None, [(a,), (a[:2],)], 2)


@triton.jit
def _add_one(p, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    tl.store(p + o, tl.load(p + o, mask=m) + 1, mask=m)


@pytest.mark.skipif(not interpreter_active(), reason="counts the launches of Triton's CPU interpreter")
def test_interpreter_counts_every_triton_launch_and_nothing_else():
    x = torch.zeros(8)

    def three_launches():
        for _ in range(3):
            _add_one[(1,)](x, 8, BLOCK=8)
        torch.add(x, 1)  # a torch operation: CPU work, not a launch

    n = count_launches(three_launches)
    assert (n.kernels, n.names, n.how) == (3, ("_add_one",), "Triton interpreter launches")
    assert count_launches(three_launches, calls=2).kernels == 3  # per call
    assert count_launches(lambda: torch.add(x, 1)).kernels == 0
    assert torch.equal(x, torch.full((8,), 9.0))  # the launches ran


@pytest.mark.skipif(not interpreter_active(), reason="counts the launches of Triton's CPU interpreter")
def test_interpreter_counter_is_removed_after_its_block_even_on_error():
    from triton.runtime import interpreter

    run = interpreter.GridExecutor.__call__
    with pytest.raises(RuntimeError, match="boom"), interpreter_launches():
        raise RuntimeError("boom")
    assert interpreter.GridExecutor.__call__ is run
    x = torch.zeros(8)
    with interpreter_launches() as outer:
        _add_one[(1,)](x, 8, BLOCK=8)
    _add_one[(1,)](x, 8, BLOCK=8)
    assert outer == ["_add_one"]


def test_measure_call_refuses_to_time_a_call_that_computes_something_else():
    inputs = [(torch.full((3,), float(i + 1)),) for i in range(16)]
    ref = inputs[0][0] * 2
    m = measure_call(lambda x: x * 2, inputs, ref, 2e-2, calls=16)
    assert m.timing is not None and m.timing.calls == 16 and m.columns()["call_ns"] > 0
    wrong = measure_call(lambda x: x * 3, inputs, ref, 2e-2, calls=16)
    assert wrong.timing is None and wrong.columns()["call_ns"] == ""
    assert "differs from the kernels' by 0.5 (tolerance 0.02)" in wrong.columns()["call_note"]


def test_columns_spell_what_was_not_measured_as_empty():
    cols = CallMeasure(notes=("call not measured",)).columns()
    assert cols == dict(call_ns="", host_ns="", host_p10_ns="", host_p90_ns="", launches="", syncs="", graph_ns="",
                        call_note="call not measured")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_no_graph_without_a_gpu():
    assert time_graph(lambda x: x + 1, _inputs(16)) == (None, "CUDA graphs need a GPU")


# ---- on the GPU ----------------------------------------------------------------------------------------


def _cuda_inputs(n, size=1024):
    return [(torch.randn(size, device="cuda"),) for _ in range(n)]


@pytest.mark.gpu
def test_gpu_profiler_counts_kernels_and_copies():
    x, y = torch.randn(1024, device="cuda"), torch.randn(1024, device="cuda")
    host = torch.randn(1024).pin_memory()

    def fn():
        torch.add(x, y)
        torch.mul(x, y)
        _add_one[(1,)](x, 8, BLOCK=8)
        x.copy_(host, non_blocking=True)

    n = count_launches(fn)
    assert n.kernels == 3 and n.copies == 1 and n.how == "torch profiler CUDA kernels"
    assert any("_add_one" in name for name in n.names) and n.kernel_ns > 0
    assert count_launches(fn, calls=4).kernels == 3


@pytest.mark.gpu
def test_gpu_graph_replays_each_input_and_times_it():
    w = torch.randn(1024, 1024, device="cuda")
    median, why = time_graph(lambda x: (x[None] @ w)[0], _cuda_inputs(16), replays=50)
    assert why == "" and median.runs == 50 and median.median_ns > 0


@pytest.mark.gpu
def test_gpu_graph_refuses_a_replay_that_keeps_the_capture_time_value():
    calls = [0]

    def call(x):  # a host value read at capture: every replay repeats it
        calls[0] += 1
        return x + calls[0]

    median, why = time_graph(call, _cuda_inputs(16))
    assert median is None and why.startswith("replay differs from the eager call on the same inputs")


@pytest.mark.gpu
def test_gpu_graph_reports_a_capture_that_fails_and_the_device_stays_usable():
    median, why = time_graph(lambda x: x * float(x.sum()), _cuda_inputs(16))  # a host read: a sync
    assert median is None and why.startswith("capture failed:"), why
    assert float(torch.ones(4, device="cuda").sum()) == 4.0


@pytest.mark.gpu
def test_gpu_fused_moe_call_launches_and_graph():
    from xstage.bench.calls import count_syncs
    from xstage.moe import LoopbackGroup, MoEBuffer, fused_moe, transform_weights
    from xstage.moe.problem import routing

    T, E, K, H, I = 256, 16, 4, 512, 256
    buf = MoEBuffer(T, E, K, H, I, LoopbackGroup(1), device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    l1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) / H**0.5
    l2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) / I**0.5
    w1t, w2 = transform_weights(l1, l2, buf.cfg.block_n1)
    routes = [routing(T, E, K, "cuda", seed=s) for s in range(16)]

    def host_planned(idx, w):
        return fused_moe(x, idx, w, w1t, w2, buf, plan_on="host", check=True)

    n = count_launches(lambda: host_planned(*routes[0]))
    assert {"moe_main_kernel", "moe_reduce_kernel"} <= {name.split("(")[0] for name in n.names}, n.names
    assert n.copies >= 1  # the host-built task table crosses to the device
    assert count_syncs(lambda: host_planned(*routes[0])) >= 1  # the counts read back to plan on the host
    median, why = time_graph(host_planned, routes)
    assert median is None and why.startswith("capture failed:"), why

    def device_planned(idx, w):
        return fused_moe(x, idx, w, w1t, w2, buf, plan_on="device", check=False)

    device_planned(*routes[1])  # compiles the prologue and settles the per-call decisions
    assert count_syncs(lambda: device_planned(*routes[0])) == 0
    median, why = time_graph(device_planned, routes, after=buf.check)
    assert why == "" and median.median_ns > 0


@pytest.mark.gpu
def test_gpu_bench_rows_carry_the_profiled_call():
    from xstage.bench.moe import run_config

    rows = run_config(dict(shape="H1152-I4608-E8-K2", tokens=256, ep=2), "host", ("expert_wave",), None, warmup=1,
                      rep=3, log=lambda m: None, call_tokens=1024)
    r = rows[0]
    assert float(r["call_ns"]) > 0 and int(r["launches"]) >= 2 and isinstance(r["syncs"], int)
    assert float(r["reduce_host_ns"]) > 0 and float(r["host_p10_ns"]) <= float(r["host_ns"])
    # Captured and checked against eager calls, or the reason it was not: never an empty cell without one.
    assert r["graph_ns"] != "" or "graph: " in r["call_note"], r
