"""The probe plans for SM counts a GPU can have, from Python and from the command line."""

import pytest

from xstage.bounds import MAX_SMS
from xstage.cli import main
from xstage.errors import InputError
from xstage.probe.sweeps import plan


@pytest.mark.parametrize("sm_count, match", [
    (99999999999999, r"^sm_count=99999999999999: must be an integer in 1\.\.4096 \(SMs of the GPU to plan for\)$"),
    (0, r"^sm_count=0: must be"), (132.5, r"^sm_count=132\.5: must be an integer"), ("132", r"^sm_count='132'"),
])
def test_plan_refuses_sm_counts_no_gpu_has(sm_count, match):
    with pytest.raises(InputError, match=match):
        plan(["first"], "host", sm_count)


def test_the_largest_sm_count_plans_and_clips_nothing_below_it():
    cfgs = plan(["first"], "host", MAX_SMS)
    assert max(c.n_sm for _, c in cfgs) == MAX_SMS and min(c.n_sm for _, c in cfgs) == 1


@pytest.mark.parametrize("argv, needle", [
    (["--sm-count", "99999999999999"], "argument --sm-count: 99999999999999: must be an integer in 1..4096"),
    (["--repeats", "1e9"], "argument --repeats: 1e9: must be an integer in 1..10000"),
    (["--bootstrap", "-1"], "argument --bootstrap: -1: must be an integer in 0..10000"),
])
def test_the_command_line_names_flag_value_and_bound(capsys, argv, needle):
    assert main(["probe", "--plan", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
