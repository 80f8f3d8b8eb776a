"""Store pacing takes only paces the kernel can keep and a link can mean: every spelling checked."""

import math

import pytest

from xstage.errors import InputError
from xstage.spec.pacing import MAX_BUDGET, MAX_RATE, MIN_RATE, StorePacing, parse_pacing, spec_of


@pytest.mark.parametrize("spec, message", [
    ("50:1e300", r"BUDGET_KIB=1e\+300: must be a finite number in 0\.\.1048576 KiB"),
    ("1e290:128", r"RATE_GBPS=1e\+290: must be a finite number in 1\.\.10000 GB/s"),
    ("0.5:128", r"RATE_GBPS=0\.5: must be"),
    ("nan:128", r"RATE_GBPS=nan: must be"),
    ("50:inf", r"BUDGET_KIB=inf: must be"),
    ("50:-1", r"BUDGET_KIB=-1\.0: must be"),
    ("50", r"expected 'off', 'default', 'auto' or RATE_GBPS:BUDGET_KIB"),
    ("fast:128", r"expected"),
])
def test_absurd_or_malformed_spellings_are_refused_naming_the_field(spec, message):
    with pytest.raises(InputError, match=rf"^pacing {spec!r}: .*{message}"):
        parse_pacing(spec)


def test_the_bounds_round_trip_and_give_integer_kernel_arguments_that_pace():
    for spec in ("1:0", "10000:1048576", "50:128"):
        p = parse_pacing(spec)
        assert (p.rate, p.budget) == (float(spec.split(":")[0]) * 1e9, float(spec.split(":")[1]) * 1024)
        assert spec_of(p) == spec and parse_pacing(spec_of(p)) == p
        fs_per_byte, budget_ns = p.kernel_args()
        assert fs_per_byte >= 100  # never 0 (which switches pacing off), 1% resolution at worst
        assert 0 <= budget_ns < 2**31
    assert (MIN_RATE, MAX_RATE, MAX_BUDGET) == (1e9, 1e13, 1 << 30)


@pytest.mark.parametrize("kw, field", [
    (dict(rate=1e6, budget=0), "StorePacing.rate"), (dict(rate=1e14, budget=0), "StorePacing.rate"),
    (dict(rate=math.nan, budget=0), "StorePacing.rate"), (dict(rate="50e9", budget=0), "StorePacing.rate"),
    (dict(rate=50e9, budget=1e300), "StorePacing.budget"), (dict(rate=50e9, budget=-1), "StorePacing.budget"),
    (dict(rate=50e9, budget=math.inf), "StorePacing.budget"),
])
def test_store_pacing_states_its_ranges(kw, field):
    with pytest.raises(InputError, match=rf"^{field}=.*: must be a finite number in .* \(.*\)$"):
        StorePacing(**kw)
