"""Profile and task-cost JSON files go through the common input checks (`xstage.results.io.read_json`):
one line naming the file for what cannot be read, no NaN or negative time passed on as a number."""

import json
import os
import re
import threading

import numpy as np
import pytest

from xstage.errors import InputError
from xstage.model.profile import Profile
from xstage.sched.costs import TaskCosts, load_default_costs

from ..corrupt import COSTS_JSON, PROFILE_JSON, compressed, latin1, with_bom, write

LOADERS = {"profile": (Profile.load, PROFILE_JSON), "task costs file": (TaskCosts.load, COSTS_JSON)}


@pytest.mark.parametrize("what", LOADERS)
def test_a_byte_order_mark_is_accepted(tmp_path, what):
    load, src = LOADERS[what]
    plain, bom = load(src), load(write(tmp_path / "bom.json", with_bom(src.read_text())))
    assert bom.to_dict() == plain.to_dict()


@pytest.mark.parametrize("what", LOADERS)
@pytest.mark.parametrize("how, needle", [("gzip", "gzip-compressed"), ("bz2", "bzip2-compressed"),
                                         ("xz", "xz-compressed"), ("zip", "zip archive"),
                                         ("latin1", "line 3: not UTF-8"), ("utf16", "UTF-16"),
                                         ("empty", "is empty")])
def test_files_it_cannot_read_are_named(tmp_path, what, how, needle):
    load, src = LOADERS[what]
    text = src.read_text()
    data = {"latin1": lambda: latin1(text), "utf16": lambda: text.encode("utf-16"),
            "empty": lambda: b""}.get(how, lambda: compressed(text, how))()
    path = write(tmp_path / "x.json", data)
    with pytest.raises(InputError) as exc:
        load(path)
    assert str(exc.value).startswith(f"{what} {path}") and needle in str(exc.value), str(exc.value)


@pytest.mark.parametrize("what", LOADERS)
def test_a_fifo_or_folder_is_named_without_waiting(tmp_path, what):
    load, _ = LOADERS[what]
    with pytest.raises(InputError, match="is a folder, not a regular file"):
        load(tmp_path)
    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)
    got = []
    t = threading.Thread(target=lambda: got.append(pytest.raises(InputError, load, fifo)), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        with open(fifo, "w"):
            pass
        pytest.fail("loading a FIFO blocked")
    assert "is a FIFO (named pipe)" in str(got[0].value)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_refused_in_a_profile(tmp_path, literal):
    text = PROFILE_JSON.read_text()
    r0 = json.loads(text)["params"]["r0"]
    path = write(tmp_path / "p.json", text.replace(f'"r0": {json.dumps(r0)}', f'"r0": {literal}', 1))
    assert literal in path.read_text()
    with pytest.raises(InputError, match=f"{literal} is not a JSON number"):
        Profile.load(path)


@pytest.mark.parametrize("field, value, needle", [
    ("median_ns", -5.0, "table[0].median_ns must be finite and > 0"),
    ("median_ns", 0.0, "table[0].median_ns must be finite and > 0"),
    ("rows_per_expert", "abc", "table[0].rows_per_expert must be a number, got 'abc'"),
    ("fetch_ns", 1e400, "fetch_ns must be a finite time >= 0 ns"),
    ("fetch_ns", -1.0, "fetch_ns must be finite and >= 0, got -1.0"),
    # found by tests/test_fuzz_files.py: booleans and text read as numbers (true as a rate of 1)
    ("rows_per_expert", "64", "table[0].rows_per_expert must be a number, got '64'"),
    ("median_ns", True, "table[0].median_ns must be a number, got True"),
    ("rate", True, "kinds.dispatch@128x128x128x64.rate must be a number, got True"),
    ("overhead_ns", "0", "kinds.dispatch@128x128x128x64.overhead_ns must be a number, got '0'"),
    ("kind key", "dispatch@abc", "kinds: 'dispatch@abc' is not KIND or KIND@BMxBN"),
    ("kernel", 5, "kernel must be a name such as 'moe', got 5"),
    ("elem_bytes", 3, "table[0].elem_bytes must be 1, 2 or 4"),
])
def test_task_cost_times_are_checked(tmp_path, field, value, needle):
    d = json.loads(COSTS_JSON.read_text())
    assert d["table"] and TaskCosts.from_dict(d).table == load_default_costs("moe").table
    first = next(iter(d["kinds"]))
    if field in ("fetch_ns", "kernel"):
        d[field] = value
    elif field in ("rate", "overhead_ns"):
        d["kinds"][first][field] = value
    elif field == "kind key":
        d["kinds"][value] = d["kinds"].pop(first)
    else:
        d["table"][0][field] = value
    path = write(tmp_path / "c.json", json.dumps(d))  # 1e400 is written as Infinity: refused earlier
    with pytest.raises(InputError) as exc:
        TaskCosts.load(path)
    assert str(exc.value).startswith(f"task costs file {path}")
    assert needle in str(exc.value) or (value == 1e400 and "Infinity is not a JSON number" in str(exc.value))


@pytest.mark.parametrize("where, value, needle", [
    (("tile_model", "overhead_ns"), True, "overhead_ns=True: must be a finite number >= 0"),
    (("tile_model", "mma_flops_per_ns"), "5577", "mma_flops_per_ns='5577': must be a finite number > 0"),
    (("order_effect", "reference_busy"), True, "reference_busy=True in (0, 1]"),
])
def test_tile_model_and_order_effect_take_numbers_only(tmp_path, where, value, needle):
    """Booleans and text are no numbers in the tile model or the order effect either."""
    d = json.loads(COSTS_JSON.read_text())
    d[where[0]][where[1]] = value
    with pytest.raises(InputError, match=re.escape(needle)):
        TaskCosts.load(write(tmp_path / "c.json", json.dumps(d)))
    d = json.loads(COSTS_JSON.read_text())
    pts = d["order_effect"]["ratios"]["interleaved"]["H4096-I2048-E256-K6"]["dispatch"]
    pts[0][1] = "1.07"
    with pytest.raises(InputError, match="ratios must be numbers"):
        TaskCosts.load(write(tmp_path / "o.json", json.dumps(d)))


def test_loaders_name_what_is_not_a_path_or_a_document():
    """Found by tests/test_fuzz_api.py: Profile.load(None) and TaskCosts.load(None) raised a TypeError
    before the reader's checks, TaskCosts.from_dict of a number an IndexError."""
    for load, what in ((Profile.load, "profile"), (TaskCosts.load, "task costs file")):
        with pytest.raises(InputError, match=f"^{what} None: not a path"):
            load(None)
    with pytest.raises(InputError, match=r"^task costs: expected an object with 'kernel' and 'kinds', got int64$"):
        TaskCosts.from_dict(np.int64(-1))
