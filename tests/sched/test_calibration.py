"""A user's own calibration reaches every decision: by argument, by the XSTAGE_CALIBRATION setting, and
through the MoE buffer; each decision names the files it used."""

import dataclasses
import json

import pytest
import torch

from xstage.errors import InputError
from xstage.model import load_default_profile
from xstage.sched.calibration import ENV, Calibration, calibration_of
from xstage.sched.costs import load_default_costs
from xstage.sched.exchange import costs_to_dict, default_exchange_costs
from xstage.sched.moe import MoeConfig
from xstage.sched.policy import choose_exchange, choose_schedule
from xstage.spec.moe import BlockConfig

CFG = MoeConfig.parse("H1152-I4608-E8-K2", tokens_per_rank=256, ep=2)


def _slow_host():
    p = load_default_profile("host")
    return dataclasses.replace(p, params=dataclasses.replace(p.params, drain=p.params.drain / 50))


@pytest.fixture
def folder(tmp_path):
    """A user's folder: a host profile that drains 50x slower, the embedded tile costs, and exchange
    costs whose copy engine is 10x slower."""
    _slow_host().save(tmp_path / "my-host-profile.json")
    load_default_costs("moe").save(tmp_path / "moe-task-costs.json")
    ex = default_exchange_costs()
    slow = dataclasses.replace(ex, copy={c: (x0, rate / 10) for c, (x0, rate) in ex.copy.items()}, source="mine")
    (tmp_path / "ulysses-exchange-costs.json").write_text(json.dumps(costs_to_dict(slow)))
    return tmp_path, slow


def test_a_folder_drives_the_moe_decision_as_the_same_profile_given_directly(folder):
    path, _ = folder
    got = choose_schedule(CFG, "host", 132, None, calibration=path)
    want = choose_schedule(CFG, "host", 132, None, profile=_slow_host())
    assert got.choice == want.choice and got.predicted_ns == want.predicted_ns
    assert got.predicted_ns != choose_schedule(CFG, "host", 132, None).predicted_ns  # not the embedded one
    assert f"profile {path}/my-host-profile.json" in got.calibration and "moe-task-costs.json" in got.calibration
    assert not got.validated
    # a path the folder has no profile for keeps the embedded profile, and its own tile costs
    peer = choose_schedule(CFG, "peer", 132, None, calibration=path)
    assert "embedded H200 peer path" in peer.calibration and "moe-task-costs.json" in peer.calibration


def test_the_setting_reaches_code_that_passes_nothing(folder, monkeypatch):
    path, slow = folder
    monkeypatch.setenv(ENV, str(path))
    d = choose_exchange(24, 128, 8192, 4, path="host", dtype="bf16")
    assert d.predicted_ns == choose_exchange(24, 128, 8192, 4, path="host", dtype="bf16", costs=slow).predicted_ns
    assert "ulysses-exchange-costs.json" in d.calibration and not d.validated
    monkeypatch.delenv(ENV)
    assert choose_exchange(24, 128, 8192, 4, path="host", dtype="bf16").validated


def test_a_moe_buffer_decides_with_its_calibration_and_names_it(folder):
    from xstage.moe import LoopbackGroup, MoEBuffer
    from xstage.moe.fused import plan

    path, _ = folder
    cfg = BlockConfig(block_m=16, block_n1=16, block_n2=32, block_k=32, block_d=32)
    buf = MoEBuffer(8, 4, 2, 64, 32, LoopbackGroup(2, path="host"), device="cpu", dtype=torch.float16, config=cfg,
                    calibration=path)
    plan(torch.tensor([[0, 1], [2, 3], [1, 2]]), buf, "model_guided", pacing="auto")
    (d,) = buf.decisions()
    assert [p.kind for p in d.planner] == ["pacing", "schedule"]
    assert all(f"{path}/my-host-profile.json" in p.calibration for p in d.planner)


def test_bad_folders_get_one_line_before_any_work(tmp_path):
    from xstage.moe import LoopbackGroup, MoEBuffer

    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "moe-task-costs.json").write_text("{not json")
    (tmp_path / "twice").mkdir()
    for name in ("a-profile.json", "b-profile.json"):
        load_default_profile("host").save(tmp_path / "twice" / name)
    cases = [(tmp_path / "missing", "not a folder"), (tmp_path / "empty", "holds no"),
             (tmp_path / "broken", "not readable JSON"), (tmp_path / "twice", "a second profile of path 'host'")]
    for folder, words in cases:
        with pytest.raises(InputError, match=words) as err:
            Calibration.load(folder)
        assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="not a folder"):
        MoEBuffer(8, 4, 2, 64, 32, LoopbackGroup(2, path="host"), device="cpu", dtype=torch.float16,
                  calibration=tmp_path / "missing")
    with pytest.raises(InputError, match="expected a folder or a Calibration"):
        calibration_of(3)
