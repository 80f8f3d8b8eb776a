"""The planner's measured constants come from data with their provenance, and are what the planner uses."""

import json
import math
from importlib import resources

import pytest

from xstage.errors import InputError
from xstage.model import load_default_profile
from xstage.sched.constants import CONSTANTS_JSON, constants_from_dict, planner_constants
from xstage.sched.exchange import CANDIDATES
from xstage.sched.pacing import resolve_pacing
from xstage.sched.plan import moe_path_params
from xstage.spec.exchange import parse_exchange

RAW = json.loads((resources.files("xstage.data") / CONSTANTS_JSON).read_text())


def test_every_constant_names_its_experiment_its_results_and_why():
    for part in ("hbm_path", "default_pacing", "exchange_candidates", "remote_path", "unpaced_drain_fit"):
        assert {"why", "measured_in", "experiment"} <= set(RAW[part]), part


def test_the_planner_uses_the_files_values():
    c = planner_constants()
    hbm = moe_path_params("hbm")
    assert (hbm.r0, hbm.drain, math.isinf(hbm.c_sm)) == (RAW["hbm_path"]["issue_rate"], RAW["hbm_path"]["drain"], True)
    paced = resolve_pacing("default", "host", 4)
    assert paced.rate == pytest.approx(RAW["default_pacing"]["rate_factor"] * load_default_profile("host").params.drain)
    assert paced.budget == RAW["default_pacing"]["budget_bytes"]
    assert CANDIDATES == tuple(RAW["exchange_candidates"]["candidates"]) == c.exchange_candidates
    assert all(parse_exchange(x).mechanism != "auto" for x in CANDIDATES)
    from xstage.sched.moe import remote_path

    # a persistent kernel's per-SM window on the host link (the probe's is larger)
    assert remote_path(moe_path_params("host")).c_sm == RAW["remote_path"]["held_store_window_bytes"]
    from xstage.calibrate.interference import UNPACED_MAX_FOOTPRINT, UNPACED_SATURATING_STORERS

    fit = RAW["unpaced_drain_fit"]
    assert UNPACED_SATURATING_STORERS == fit["saturating_storers"]
    assert UNPACED_MAX_FOOTPRINT == fit["max_footprint_bytes"]


@pytest.mark.parametrize("edit,words", [
    (lambda d: d.pop("hbm_path"), "expected hbm_path"),
    (lambda d: d["hbm_path"].update(drain=float("nan")), "drain must be a finite number > 0"),
    (lambda d: d["default_pacing"].update(rate_factor=-1), "rate_factor must be a finite number > 0"),
    (lambda d: d["exchange_candidates"].update(candidates=[]), "non-empty list"),
    (lambda d: d.pop("remote_path"), "expected hbm_path"),
    (lambda d: d["unpaced_drain_fit"].update(saturating_storers=0), "saturating_storers must be a finite number > 0"),
])
def test_a_malformed_file_is_one_line(edit, words):
    d = json.loads(json.dumps(RAW))
    edit(d)
    with pytest.raises(InputError, match=words) as err:
        constants_from_dict(d, "constants.json")
    assert "\n" not in str(err.value) and "constants.json" in str(err.value)
