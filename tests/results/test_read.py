"""`xstage.results.io` reading: every file a command reads goes through these checks, one line each."""

import csv
import json
import os
import socket
import threading

import pytest

from xstage.errors import InputError
from xstage.results.io import (
    CSV_KINDS,
    ResultWriter,
    cell_count,
    cell_number,
    cell_time,
    read_json,
    read_rows,
    read_table,
)

from ..corrupt import (
    COMPRESSIONS,
    MOE_CSV,
    NON_FINITE,
    PROFILE_JSON,
    ULYSSES_CSV,
    committed,
    compressed,
    duplicate_column,
    header_only,
    latin1,
    with_bom,
    write,
)

MOE = {"moe": ("shape", "H", "I", "E", "K", "tokens", "ep", "path", "variant", "time_ns")}
ULY = {"ulysses": ("heads", "dim", "tokens", "P", "variant", "grid")}


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def _reference_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_committed_file_reads_as_csv_reads_it():
    table = read_table(MOE_CSV, MOE)
    assert table.kind == "moe"
    assert table.rows == _reference_rows(MOE_CSV)
    assert table.lines[:3] == [2, 3, 4] and table.where(1).endswith("moe.csv, line 3")


@pytest.mark.parametrize("how", COMPRESSIONS)
def test_compressed_files_are_refused_by_name(tmp_path, how):
    path = write(tmp_path / "moe.csv", compressed(committed(MOE_CSV, 5), how))
    with pytest.raises(InputError) as exc:
        read_table(path, MOE)
    text = _one_line(exc)
    assert str(path) in text and {"gzip": "gzip", "bz2": "bzip2", "xz": "xz", "zip": "zip"}[how] in text
    assert "decompress" in text or "archive" in text


def test_text_that_is_not_utf8_names_the_line(tmp_path):
    path = write(tmp_path / "moe.csv", latin1(committed(MOE_CSV, 5), line=4))
    with pytest.raises(InputError, match=r"moe.csv, line 4: not UTF-8 text \(byte 0xe9\)"):
        read_rows(path, MOE)
    utf16 = write(tmp_path / "u16.csv", committed(MOE_CSV, 2).encode("utf-16"))
    with pytest.raises(InputError, match="UTF-16"):
        read_rows(utf16, MOE)
    binary = write(tmp_path / "bin.csv", b"shape,H\n\x00\x01\x02\n")
    with pytest.raises(InputError, match="line 2: holds NUL bytes"):
        read_rows(binary)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    text = committed(MOE_CSV, 5)
    plain = read_table(write(tmp_path / "plain.csv", text), MOE)
    bom = read_table(write(tmp_path / "bom.csv", with_bom(text)), MOE)
    assert bom.columns == plain.columns and bom.columns[0] == "shape"
    assert bom.rows == plain.rows and len(bom.rows) == 5


def test_windows_line_ends_read_alike(tmp_path):
    text = committed(MOE_CSV, 5)
    crlf = read_table(write(tmp_path / "crlf.csv", text.replace("\n", "\r\n")), MOE)
    assert crlf.rows == read_table(write(tmp_path / "lf.csv", text), MOE).rows and crlf.lines == [2, 3, 4, 5, 6]


def test_duplicate_columns_are_refused_instead_of_the_last_copy_winning(tmp_path):
    text = duplicate_column(committed(MOE_CSV, 5), "time_ns")
    assert list(csv.DictReader(text.splitlines()))[0]["time_ns"] == "1"  # what a plain DictReader would read
    path = write(tmp_path / "moe.csv", text)
    n = len(text.splitlines()[0].split(","))
    with pytest.raises(InputError) as exc:
        read_rows(path)  # also without a kind: no reader of xstage takes a repeated column
    assert _one_line(exc).endswith(f"line 1: column 'time_ns' appears twice (columns 10 and {n}); each column "
                                   "must appear once")
    unnamed = write(tmp_path / "unnamed.csv", "shape,,H\na,1,2\n")
    with pytest.raises(InputError, match="column 2 of the header has no name"):
        read_rows(unnamed)


def test_a_results_file_of_the_other_kind_is_named(tmp_path):
    uly = write(tmp_path / "ulysses.csv", committed(ULYSSES_CSV, 4))
    moe = write(tmp_path / "moe.csv", committed(MOE_CSV, 4))
    with pytest.raises(InputError) as exc:
        read_rows(uly, MOE)
    assert _one_line(exc) == (f"results file {uly}: looks like a Ulysses results CSV (from `xstage bench ulysses`), "
                              "not a MoE results CSV (from `xstage bench moe`)")
    with pytest.raises(InputError, match="looks like a MoE results CSV .*, not a Ulysses results CSV"):
        read_rows(moe, ULY)
    both = {**MOE, **ULY}
    assert read_table(uly, both).kind == "ulysses" and read_table(moe, both).kind == "moe"
    with pytest.raises(InputError, match="looks like a reference probe CSV"):
        read_rows(write(tmp_path / "ref.csv", "dst,nblocks,issue_first\nhost,1,2\n"), both)
    with pytest.raises(InputError, match=r"its columns \(a, b\) match none of the kinds read here: MoE results"):
        read_rows(write(tmp_path / "ab.csv", "a,b\n1,2\n"), both)


def test_a_required_column_is_named(tmp_path):
    text = committed(MOE_CSV, 2).replace("time_ns,", "t_ns,", 1)
    with pytest.raises(InputError, match=r"no column\(s\) time_ns; a MoE results CSV \(from `xstage bench moe`\) has"):
        read_rows(write(tmp_path / "moe.csv", text), MOE)


def test_files_without_rows_are_refused(tmp_path):
    empty = write(tmp_path / "empty.csv", "")
    blank = write(tmp_path / "blank.csv", "\n \n")
    head = write(tmp_path / "head.csv", header_only(committed(MOE_CSV)))
    torn = write(tmp_path / "torn.csv", header_only(committed(MOE_CSV)) + "H4096-I2048,4096,20")
    for path in (empty, blank):
        with pytest.raises(InputError, match="is empty"):
            read_rows(path, MOE)
    with pytest.raises(InputError, match=r"head.csv: a header but no rows$"):
        read_rows(head, MOE)
    with pytest.raises(InputError, match=r"a header but no rows \(its last line has no line end: a torn row\)"):
        read_rows(torn, MOE)
    assert read_rows(head, allow_empty=True) == []  # what a resumed results file may be


def test_a_header_swallowed_by_an_open_quote_is_one_line(tmp_path):
    """Found by tests/test_fuzz_files.py: a quote before the first column made the whole file one column
    name, and the refusal quoted it, line ends and all."""
    text = '"' + committed(MOE_CSV, 3)
    with pytest.raises(InputError) as exc:
        read_rows(write(tmp_path / "moe.csv", text), {**MOE, **ULY})
    assert _one_line(exc).startswith(f"results file {tmp_path / 'moe.csv'}, line 1: column 1 of the header, 'shape,H,")
    assert _one_line(exc).endswith("holds a line end or control character (a quote left open?)")
    with pytest.raises(InputError) as exc:
        read_rows(write(tmp_path / "bell.csv", "shape,H\x07x\na,1\n"))
    assert _one_line(exc).endswith(r"column 2 of the header, 'H\x07x', holds a line end or control character")


def test_rows_of_the_wrong_width_name_their_line(tmp_path):
    text = committed(MOE_CSV, 3).splitlines()
    text[2] = text[2] + ",extra"
    with pytest.raises(InputError, match=rf"moe.csv, line 3: {len(text[0].split(',')) + 1} fields, the header has"):
        read_rows(write(tmp_path / "moe.csv", "\n".join(text) + "\n"))


def test_line_numbers_count_quoted_line_ends(tmp_path):
    path = write(tmp_path / "q.csv", 'a,b\n"x\ny",1\nz,2\n')
    table = read_table(path)
    assert table.rows == [{"a": "x\ny", "b": "1"}, {"a": "z", "b": "2"}] and table.lines == [3, 4]


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "moe.csv"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(pytest.raises(InputError, read_rows, fifo, MOE)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the reader before failing, so the test run does not hang
        with open(fifo, "w"):
            pass
        pytest.fail("reading a FIFO blocked")
    assert str(got[0].value) == f"results file {fifo}: is a FIFO (named pipe), not a regular file; give a file"


def test_folders_devices_sockets_and_missing_files_say_what_they_are(tmp_path):
    with pytest.raises(InputError, match="is a folder, not a regular file"):
        read_rows(tmp_path)
    with pytest.raises(InputError, match="is a character device, not a regular file"):
        read_rows("/dev/null")
    sock_path = tmp_path / "s.csv"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
        with pytest.raises(InputError, match="is a socket, not a regular file"):
            read_rows(sock_path)
    with pytest.raises(InputError, match=r"absent.csv: does not exist$"):
        read_rows(tmp_path / "absent.csv")
    afile = write(tmp_path / "afile", "x")
    with pytest.raises(InputError, match="does not exist"):
        read_rows(afile / "moe.csv")
    link = tmp_path / "link.csv"
    link.symlink_to(MOE_CSV)
    assert read_table(link, MOE).rows == _reference_rows(MOE_CSV)  # a link to a file is that file


@pytest.mark.parametrize("path, needle", [(None, "None: not a path"), (7, "7: not a path"),
                                         (b"moe.csv", "b'moe.csv': not a path"),
                                         ("a\x00b.csv", "'a\\x00b.csv': not a path (it holds a NUL character)")])
def test_what_is_not_a_path_is_refused_by_name(path, needle):
    """Found by tests/test_fuzz_api.py: None raised a TypeError and a NUL character a ValueError."""
    for read in (read_rows, read_json):
        with pytest.raises(InputError) as exc:
            read(path)
        assert needle in _one_line(exc)


def test_resuming_a_compressed_results_file_is_one_line(tmp_path):
    path = write(tmp_path / "r.csv", compressed("shape,tokens\na,1\n", "gzip"))
    before = path.read_bytes()
    with pytest.raises(InputError, match="gzip-compressed"):
        ResultWriter(path, ["shape", "tokens"], ["shape"], env={"gpu": "g"})
    assert path.read_bytes() == before


def test_a_results_file_that_is_a_fifo_or_folder_is_refused_before_writing(tmp_path):
    os.mkfifo(tmp_path / "r.csv")
    with pytest.raises(InputError, match="r.csv: is a FIFO"):  # opening it to write would wait for a reader
        ResultWriter(tmp_path / "r.csv", ["shape"], ["shape"], env={"gpu": "g"})
    (tmp_path / "d.csv").mkdir()
    with pytest.raises(InputError, match="d.csv: is a folder"):
        ResultWriter(tmp_path / "d.csv", ["shape"], ["shape"], env={"gpu": "g"})


def test_json_goes_through_the_same_checks(tmp_path):
    text = PROFILE_JSON.read_text()
    assert read_json(write(tmp_path / "bom.json", with_bom(text))) == json.loads(text)
    with pytest.raises(InputError, match="gzip-compressed"):
        read_json(write(tmp_path / "p.json", compressed(text, "gzip")), "profile")
    with pytest.raises(InputError, match=r"p2.json, line 2, column 8: not valid JSON"):
        read_json(write(tmp_path / "p2.json", '{"a": 1,\n  "b": }'), "profile")
    with pytest.raises(InputError, match=r"NaN is not a JSON number; write null or a finite number"):
        read_json(write(tmp_path / "nan.json", '{"r0": NaN}'), "profile")
    assert read_json(tmp_path / "nan.json", allow_nonfinite=True)["r0"] != 0  # NaN, where the writer allows it
    with pytest.raises(InputError, match="is empty"):
        read_json(write(tmp_path / "e.json", ""))
    with pytest.raises(InputError, match="is a folder"):
        read_json(tmp_path, "task costs file")


@pytest.mark.parametrize("number", ["1e999", "-1e400", "1.5e309"])
def test_json_numbers_past_the_largest_float_are_refused_like_infinity(tmp_path, number):
    """Found by tests/test_fuzz_files.py: `"kernel": 1e999` read as inf and went on as the text 'inf'."""
    path = write(tmp_path / "big.json", f'{{"r0": {number}}}')
    with pytest.raises(InputError, match=rf"big.json: {number} is past the largest float .*; write null or a finite"):
        read_json(path, "profile")
    assert read_json(write(tmp_path / "ok.json", '{"r0": 1e308}')) == {"r0": 1e308}


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000])
def test_json_nested_past_the_recursion_limit_is_one_line(tmp_path, text):
    """Found by tests/test_fuzz_files.py: the decoder's RecursionError escaped as a traceback."""
    path = write(tmp_path / "deep.json", text)
    with pytest.raises(InputError, match=r"deep.json: arrays or objects nested too deep to read"):
        read_json(path, "profile")


@pytest.mark.parametrize("value", [*NON_FINITE, "-5", "0", "abc", ""])
def test_cells_refuse_what_is_not_a_time(value):
    row = {"time_ns": value}
    with pytest.raises(InputError, match=r"^f.csv, line 3, column time_ns: "):
        cell_time(row, "time_ns", "f.csv, line 3")


def test_cells_read_what_is_a_time_count_or_number():
    assert cell_time({"t": " 12.5 "}, "t", "x") == 12.5
    assert cell_time({"t": "0"}, "t", "x", zero=True) == 0.0
    assert cell_time({"t": ""}, "t", "x", optional=True) is None
    assert cell_count({"n": "132"}, "n", "x") == 132
    assert cell_number({"r": "-0.5"}, "r", "x") == -0.5
    for bad in ("0", "-1", "1.5", "abc", "nan"):
        with pytest.raises(InputError, match="column n"):
            cell_count({"n": bad}, "n", "x")
    with pytest.raises(InputError, match="column r: -0.5: must be > 0"):
        cell_number({"r": "-0.5"}, "r", "x", positive=True)
    with pytest.raises(InputError, match="x: no column q"):
        cell_time({}, "q", "x")


def test_every_kind_has_a_distinct_signature():
    sigs = {k: frozenset(v.signature) for k, v in CSV_KINDS.items()}
    for a, sa in sigs.items():
        for b, sb in sigs.items():
            assert a == b or not sa <= sb, f"a {b} file would also look like {a}"


def test_a_refusal_quoting_a_line_end_stays_one_line(tmp_path):
    """Found by tests/test_fuzz_api.py: a path holding a line end (from Python, not a shell) split the
    message; every XstageError writes its control characters as escapes."""
    with pytest.raises(InputError) as exc:
        read_rows(tmp_path / "a\nb.csv")
    assert _one_line(exc).endswith("a\\nb.csv: does not exist")
    assert str(InputError("x\r\x1b[2Jy\tz")) == "x\\r\\x1b[2Jy\\tz" and str(InputError("é ∞")) == "é ∞"
