"""The store/compute interference term: validation, occupancy, onset, stretch, JSON and the embedded
host calibration."""

import json
import math

import pytest

from xstage.errors import InputError
from xstage.model.interference import Interference, load_default_interference
from xstage.model.profile import load_default_profile

FIELDS = ("per_storer", "onset_bytes", "window_bytes")
TERM = Interference(per_storer=0.25, onset_bytes=300e3, window_bytes=100e3, provenance={"gpu": "test"})


@pytest.mark.parametrize("field", [pytest.param(f, id=f) for f in FIELDS])
@pytest.mark.parametrize("bad", [
    pytest.param(-1.0, id="negative"),
    pytest.param(-1, id="negative-int"),
    pytest.param(math.nan, id="nan"),
    pytest.param(math.inf, id="inf"),
    pytest.param(True, id="bool"),
    pytest.param("1.0", id="str"),
    pytest.param(None, id="none"),
])
def test_bad_fields_raise_input_error_naming_the_field(field, bad):
    kw = {"per_storer": 0.1, "onset_bytes": 1e6, "window_bytes": 1e5, field: bad}
    with pytest.raises(InputError, match=field):
        Interference(**kw)


def test_zero_and_int_fields_are_valid():
    t = Interference(per_storer=0, onset_bytes=0, window_bytes=65536)
    assert (t.per_storer, t.onset_bytes, t.window_bytes) == (0, 0, 65536)
    assert t.provenance == {}


@pytest.mark.parametrize("bursts, capacity, want", [
    pytest.param([], 1e9, 0.0, id="empty"),
    pytest.param([50e3], 1e9, 50e3, id="one-below-window"),
    pytest.param([1 << 20], 1e9, 100e3, id="one-capped-by-window"),
    pytest.param([50e3, 1 << 20, 100e3], 1e9, 250e3, id="mixed"),
    pytest.param([1 << 20] * 16, 1e9, 1.6e6, id="16-windows"),
    pytest.param([1 << 20] * 16, 1.2e6, 1.2e6, id="16-capped-by-capacity"),
    pytest.param([10e3] * 4, 0.0, 0.0, id="zero-capacity"),
    pytest.param([1 << 20] * 3, math.inf, 300e3, id="infinite-capacity"),
])
def test_occupancy_caps_each_burst_at_the_window_and_the_sum_at_capacity(bursts, capacity, want):
    assert TERM.occupancy(bursts, capacity) == pytest.approx(want, rel=1e-12, abs=1e-9)


def test_occupancy_accepts_any_iterable():
    assert TERM.occupancy((b for b in [1 << 20, 1 << 20]), 1e9) == pytest.approx(200e3)
    assert TERM.occupancy({3: 1 << 20, 7: 20e3}.values(), 1e9) == pytest.approx(120e3)


def test_active_from_the_onset_on():
    assert not TERM.active(0.0)
    assert not TERM.active(300e3 * (1 - 1e-9))
    assert TERM.active(300e3)
    assert TERM.active(1e9)
    # Three full windows reach the onset, two do not; a capacity below the onset never does.
    assert TERM.active(TERM.occupancy([1 << 20] * 3, 1e9))
    assert not TERM.active(TERM.occupancy([1 << 20] * 2, 1e9))
    assert not TERM.active(TERM.occupancy([1 << 20] * 64, 299e3))


@pytest.mark.parametrize("storing, share, want", [
    pytest.param(0, 1.0, 0.0, id="k0"),
    pytest.param(16, 0.0, 0.0, id="share0"),
    pytest.param(16, 1.0, 4.0, id="k16-m1"),
    pytest.param(4, 0.5, 0.5, id="k4-m0.5"),
    pytest.param(7, 0.3, 0.525, id="k7-m0.3"),
])
def test_stretch_is_per_storer_times_storers_times_share(storing, share, want):
    assert TERM.stretch(storing, share) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_json_round_trip_keeps_fields_and_provenance():
    d = json.loads(json.dumps(TERM.to_dict()))
    assert set(d) == {*FIELDS, "unpaced_bias", "unpaced_drain", "provenance"}
    back = Interference.from_dict(d)
    assert back == TERM
    assert back.provenance == {"gpu": "test"}
    # Equality ignores provenance (compare=False) but not the numbers.
    assert Interference(0.25, 300e3, 100e3) == TERM
    assert Interference(0.26, 300e3, 100e3) != TERM


def test_from_dict_without_provenance_gives_an_empty_one():
    t = Interference.from_dict({"per_storer": 0.1, "onset_bytes": 2.0, "window_bytes": 1.0})
    assert t == Interference(0.1, 2.0, 1.0) and t.provenance == {}


@pytest.mark.parametrize("missing", [pytest.param(f, id=f) for f in FIELDS])
def test_from_dict_names_a_missing_key(missing):
    d = {k: v for k, v in TERM.to_dict().items() if k != missing}
    with pytest.raises(InputError, match=missing):
        Interference.from_dict(d, source="my.json")
    with pytest.raises(InputError, match="my.json"):
        Interference.from_dict(d, source="my.json")


@pytest.mark.parametrize("bad", [
    pytest.param([0.1, 1.0, 1.0], id="list"),
    pytest.param("per_storer=0.1", id="str"),
    pytest.param(None, id="none"),
    pytest.param(0.25, id="float"),
])
def test_from_dict_rejects_non_objects(bad):
    with pytest.raises(InputError, match="interference"):
        Interference.from_dict(bad)


def test_from_dict_rejects_bad_values_and_provenance():
    with pytest.raises(InputError, match="provenance"):
        Interference.from_dict({**TERM.to_dict(), "provenance": ["x"]})
    with pytest.raises(InputError, match="onset_bytes"):
        Interference.from_dict({**TERM.to_dict(), "onset_bytes": -5.0})
    with pytest.raises(InputError, match="per_storer"):
        Interference.from_dict({**TERM.to_dict(), "per_storer": "0.3"})


def test_embedded_host_calibration():
    t = load_default_interference("host")
    assert isinstance(t, Interference)
    assert t.per_storer > 0 and math.isfinite(t.per_storer)
    assert t.window_bytes == pytest.approx(load_default_profile("host").params.c_sm, rel=1e-12)
    assert t.provenance["path"] == "host"
    k_lo, k_hi = t.provenance["onset_storers"]
    assert (k_lo, k_hi) == (8, 16)
    # The onset lies between 8 and 16 full per-SM windows (the geometric mean of the two).
    assert 8 * t.window_bytes < t.onset_bytes < 16 * t.window_bytes
    assert t.onset_bytes == pytest.approx(math.sqrt(k_lo * k_hi) * t.window_bytes, rel=1e-9)
    assert load_default_interference("host") == t


@pytest.mark.parametrize("path", [pytest.param("hbm", id="hbm"), pytest.param("nonexistent", id="unknown")])
def test_paths_without_a_calibration_give_none(path):
    assert load_default_interference(path) is None


def test_unpaced_bias_is_optional_in_json_and_checked():
    d = {"per_storer": 0.3, "onset_bytes": 1e6, "window_bytes": 1.5e5}
    assert Interference.from_dict(d).unpaced_bias == 1.0  # a calibration without it
    assert Interference.from_dict({**d, "unpaced_bias": 1.12}).unpaced_bias == 1.12
    for bad in (-1.0, float("nan"), "1.1", True):
        with pytest.raises(InputError, match="unpaced_bias"):
            Interference.from_dict({**d, "unpaced_bias": bad})


def test_unpaced_drain_is_optional_in_json_and_checked():
    d = {"per_storer": 0.3, "onset_bytes": 1e6, "window_bytes": 1.5e5}
    assert Interference.from_dict(d).unpaced_drain == 0.0  # a calibration without it: the path's own drain
    assert Interference.from_dict({**d, "unpaced_drain": 42e9}).unpaced_drain == 42e9
    for bad in (-1.0, float("inf"), "4e10", True):
        with pytest.raises(InputError, match="unpaced_drain"):
            Interference.from_dict({**d, "unpaced_drain": bad})


def test_embedded_host_term_drains_unpaced_kernels_below_the_probe():
    term = load_default_interference("host")
    drain = load_default_profile("host").params.drain
    assert 0 < term.unpaced_drain < drain
    assert "unpaced_drain_from" in term.provenance
