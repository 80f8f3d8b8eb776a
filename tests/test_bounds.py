"""One validator per kind of number: integers within a stated bound, finite reals in a physical range,
the same rule from Python and from the command line."""

import argparse
import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xstage.bounds import INT64_MAX, check_int, check_real, number_from_text
from xstage.cli.args import cli_int, cli_real
from xstage.errors import InputError


@pytest.mark.parametrize("value, expected", [(7, 7), (np.int64(7), 7), (7.0, 7), (2e9, 2_000_000_000),
                                             (np.float32(8.0), 8)])
def test_integers_and_exact_integral_floats_pass(value, expected):
    got = check_int(value, "n", 1, 2**40, "a count")
    assert got == expected and type(got) is int


@pytest.mark.parametrize("value", [0, 2**40 + 1, 1.5, math.nan, math.inf, -math.inf, True, "7", None, 10**30,
                                   1e300, [7]], ids=repr)
def test_integers_outside_the_bound_or_not_integers_are_refused_naming_the_bound(value):
    with pytest.raises(InputError, match=r"^n=.*: must be an integer in 1\.\.1099511627776 \(a count\)$"):
        check_int(value, "n", 1, 2**40, "a count")


def test_a_flag_is_named_the_way_it_is_typed():
    with pytest.raises(InputError, match=r"^--ctas 99999999: must be an integer in 1\.\.4096 \(persistent CTAs\)$"):
        check_int(99999999, "--ctas", 1, 4096, "persistent CTAs")


def test_bounds_beyond_int64_are_a_programming_error():
    with pytest.raises(ValueError, match="int64"):
        check_int(1, "n", 1, INT64_MAX + 1, "a count")


@pytest.mark.parametrize("value", [1e9, 50e9, 1e13, 2_000_000_000, np.float64(2e10)])
def test_reals_in_range_pass(value):
    assert check_real(value, "rate", 1e9, 1e13, "pacing rate", "B/s") == float(value)


@pytest.mark.parametrize("value", [1e300, 1e-300, 0.0, -1.0, math.nan, math.inf, "50", True, None], ids=repr)
def test_reals_out_of_range_or_not_finite_are_refused_with_the_unit(value):
    with pytest.raises(InputError, match=r"^rate=.*: must be a finite number in 1e\+09\.\.1e\+13 B/s \(pacing rate\)$"):
        check_real(value, "rate", 1e9, 1e13, "pacing rate", "B/s")


def test_inf_only_where_allowed():
    assert check_real(math.inf, "c_sm", 1.0, 2.0**50, "window", "B", allow_inf=True) == math.inf
    with pytest.raises(InputError, match=r"or inf \(window\)"):
        check_real(-math.inf, "c_sm", 1.0, 2.0**50, "window", "B", allow_inf=True)


@given(st.integers(-(2**70), 2**70))
def test_check_int_agrees_with_the_plain_rule(n):
    lo, hi = -5, 2**62
    if lo <= n <= hi:
        assert check_int(n, "n", lo, hi, "x") == n
    else:
        with pytest.raises(InputError):
            check_int(n, "n", lo, hi, "x")


@pytest.mark.parametrize("text, expected", [("4096", 4096), (" 12 ", 12), ("1e9", 1e9), ("2.5", 2.5)])
def test_command_line_words_are_read_as_numbers(text, expected):
    assert number_from_text(text) == expected


def test_cli_types_give_argparse_one_line_with_the_bound():
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    p.add_argument("--ctas", type=cli_int(1, 4096, "persistent CTAs"))
    p.add_argument("--rate", type=cli_real(1e9, 1e13, "pacing rate", "B/s"))
    assert p.parse_args(["--ctas", "132", "--rate", "5e10"]) == argparse.Namespace(ctas=132, rate=5e10)
    assert p.parse_args(["--ctas", "1e2"]).ctas == 100
    for argv, message in ((["--ctas", "99999999"], "99999999: must be an integer in 1..4096 (persistent CTAs)"),
                          (["--ctas", "99999999999999999999999"], "must be an integer in 1..4096"),
                          (["--ctas", "2.5"], "2.5: must be an integer"),
                          (["--ctas", "abc"], "'abc': not a number"),
                          (["--rate", "nan"], "nan: must be a finite number in 1e+09..1e+13 B/s (pacing rate)")):
        with pytest.raises(argparse.ArgumentError, match=re.escape(message)):
            p.parse_args(argv)
