"""One variant type (schedule + pacing), one schedule registry, and `model_guided` after `import xstage`."""

import subprocess
import sys

import pytest

from xstage.errors import InputError
from xstage.sched.pacing import resolve_pacing
from xstage.spec.schedule import CANDIDATES, register_schedule, schedule_names
from xstage.spec.variant import Variant, parse_variants


@pytest.mark.parametrize("text,schedule,pacing", [
    pytest.param("lag:4", "lag:4", None, id="no-pacing"),
    pytest.param("lag:4@off", "lag:4", "off", id="off"),
    pytest.param("interleaved@50:128", "interleaved", "50:128", id="rate-budget"),
    pytest.param("expert_wave@auto", "expert_wave", "auto", id="auto"),
    pytest.param("expert_wave@default", "expert_wave", "default", id="default"),
])
def test_variant_parses_and_formats_back(text, schedule, pacing):
    v = Variant.parse(text)
    assert (v.schedule, v.pacing) == (schedule, pacing)
    assert str(v) == text and Variant.parse(str(v)) == v
    assert v.pacing_or("off") == (pacing or "off")


@pytest.mark.parametrize("bad", ["", "lag", "lag:x", "wave", "lag:4@", "lag:4@fast", "lag:4@50", "interleaved:2"])
def test_bad_variants_name_the_problem(bad):
    with pytest.raises(InputError, match="variant|schedule|pacing"):
        Variant.parse(bad)


def test_parse_variants_names_the_argument():
    assert [str(v) for v in parse_variants("expert_wave, lag:4@off")] == ["expert_wave", "lag:4@off"]
    with pytest.raises(InputError, match="--schedules"):
        parse_variants("expert_wave,bogus")
    with pytest.raises(InputError, match="--schedules"):
        parse_variants(" , ")


def test_one_registry_serves_every_list():
    names = schedule_names()
    assert {"expert_wave", "interleaved", "lag"} <= set(names)
    for c in CANDIDATES:
        Variant.parse(c)  # every candidate is a registered order
    with pytest.raises(InputError, match="exactly one"):
        register_schedule("both", lambda *a: [], chooser=lambda *a: "lag:1")


def test_resolve_pacing_is_the_one_resolver():
    assert resolve_pacing("off", "host", 4) is None
    assert resolve_pacing(None, "host", 4) is None
    default = resolve_pacing("default", "host", 4)
    assert default is not None and 40e9 < default.rate < 60e9  # 0.9 x the host profile's ~55 GB/s drain
    assert resolve_pacing("default", "hbm", 4) is None and resolve_pacing("default", "host", 1) is None
    with pytest.raises(InputError, match="chosen per call"):
        resolve_pacing("auto", "host", 4)  # depends on the call: `choose_pacing` resolves it
    assert resolve_pacing("50:128", "hbm", 4).budget == 128 * 1024
    with pytest.raises(InputError, match="pacing"):
        resolve_pacing(5e10, "host", 4)


def test_model_guided_and_auto_are_decided_in_a_process_that_imports_only_the_kernels():
    # The kernels ask the planner's policy themselves: no import of the planner, no registration.
    code = ("import torch\n"
            "from xstage.moe import BlockConfig, LoopbackGroup, MoEBuffer\n"
            "from xstage.moe.fused import plan\n"
            "cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)\n"
            "buf = MoEBuffer(8, 4, 2, 64, 32, LoopbackGroup(2, path='host'), device='cpu', dtype=torch.float16,\n"
            "                config=cfg)\n"
            "p = plan(torch.tensor([[0, 1], [2, 3], [1, 2]]), buf, 'model_guided', pacing='auto')\n"
            "(d,) = buf.decisions()\n"
            "print(p.schedule.name == d.schedule, [x.kind for x in d.planner])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True ['pacing', 'schedule']"


def test_off_and_a_rate_read_no_profile_and_default_reads_it_once(monkeypatch):
    # Only "default" depends on the path's embedded profile; it is read once per process.
    from xstage.sched import pacing as P

    P._default_of_path.cache_clear()
    reads = []
    real = P.load_default_profile
    monkeypatch.setattr(P, "load_default_profile", lambda path: reads.append(path) or real(path))
    assert P.resolve_pacing("off", "host", 8) is None
    assert P.resolve_pacing("50:128", "host", 8).rate == 50e9
    assert reads == []
    first, again = P.resolve_pacing("default", "host", 8), P.resolve_pacing("default", "host", 4)
    from xstage.sched.constants import planner_constants

    factor = planner_constants().default_rate_factor
    assert first == again and first.rate == pytest.approx(factor * real("host").params.drain)
    assert reads == ["host"]
    P._default_of_path.cache_clear()
