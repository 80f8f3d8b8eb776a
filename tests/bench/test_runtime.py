"""The torchrun runtime of the distributed grids, as one gloo rank in this process (world size 1)."""

import os
import socket

import pytest
import torch

from xstage.bench import runtime
from xstage.bench.runtime import MULTICAST_OFF, Runtime
from xstage.errors import InputError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def torchrun_env(monkeypatch):
    """What torchrun sets for one process of a world of one."""
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), GLOO_SOCKET_IFNAME="lo").items():
        monkeypatch.setenv(name, value)
    for name in MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return monkeypatch


def test_outside_torchrun_is_an_input_error(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(InputError, match="torchrun"):
        Runtime.start(name="grid")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rule: no GPU means Triton's interpreter")
def test_cpu_without_the_interpreter_is_refused_before_joining(torchrun_env):
    torchrun_env.delenv("TRITON_INTERPRET")
    with pytest.raises(InputError, match="TRITON_INTERPRET=1"):
        Runtime.start()
    assert not torch.distributed.is_initialized()


def test_one_gloo_rank(torchrun_env, capsys):
    rt = Runtime.start("gloo")
    try:
        assert {k: os.environ[k] for k in MULTICAST_OFF} == MULTICAST_OFF
        assert (rt.rank, rt.world, rt.backend) == (0, 1, "gloo") and rt.ctrl is rt.group
        assert rt.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        assert rt.dtype(None) == (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
        assert rt.dtype("fp16") == torch.float16
        with pytest.raises(InputError, match="--dtype"):
            rt.dtype("float16")
        rt.barrier()
        rt.sync_start()
        assert rt.max_over_ranks([1.5, -2.0]) == [1.5, -2.0]
        assert rt.all_ok(True) and not rt.all_ok(False)
        assert rt.from_rank0({"go": True}) == {"go": True}
        assert rt.gather("x") == ["x"]
        main, red = rt.timings([30.0, 10.0, 20.0], [5.0])
        assert (main.median_ns, main.runs, red.median_ns) == (20.0, 3, 5.0)
        assert main.p10_ns <= main.median_ns <= main.p90_ns
        # 16-bit rows cross gloo as bytes: the values arrive unchanged
        inp = torch.arange(12, dtype=torch.float32).view(3, 4).to(torch.bfloat16)
        out = torch.empty_like(inp)
        rt.all_to_all(out, inp)
        assert torch.equal(out, inp)
        rt.log("from rank 0")
        assert capsys.readouterr().out == "from rank 0\n"
        with rt:
            pass
        assert not torch.distributed.is_initialized()
    finally:
        rt.close()


def test_a_failure_leaves_at_once(torchrun_env, monkeypatch, capsys):
    """An exception inside `with rt:` must not wait for peers that sit in a collective."""
    rt = Runtime.start("gloo")

    def _exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(runtime.os, "_exit", _exit)
    try:
        with pytest.raises(SystemExit) as stop, rt:
            raise RuntimeError("rank failed")
        assert stop.value.code == 1
        assert "RuntimeError: rank failed" in capsys.readouterr().err
        assert torch.distributed.is_initialized()  # no shutdown handshake with the peers
    finally:
        rt.close()
