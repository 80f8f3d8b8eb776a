"""Input files the CLI accepts as well as refuses: a UTF-8 byte-order mark (what spreadsheet programs
write) and Windows line ends change nothing; the refusals are in `loader_cases.py`."""

import json

from xstage.cli import main

from .corrupt import CALIBRATION_CSV, ULYSSES_CSV, committed, with_bom, write


def _run(capsys, args) -> dict:
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_a_byte_order_mark_or_crlf_line_ends_change_nothing(tmp_path, capsys):
    text = committed(ULYSSES_CSV)
    files = {"plain": write(tmp_path / "plain.csv", text), "bom": write(tmp_path / "bom.csv", with_bom(text)),
             "crlf": write(tmp_path / "crlf.csv", text.replace("\n", "\r\n"))}
    costs = {k: _run(capsys, ["plan", "attention-costs", str(f), "-o", str(tmp_path / f"a-{k}"), "--json"])
             for k, f in files.items()}
    assert costs["plain"]["kinds"] and costs["bom"]["kinds"] == costs["plain"]["kinds"] == costs["crlf"]["kinds"]
    # the committed calibration is the embedded one: with a byte-order mark it plans as the default does
    assert CALIBRATION_CSV.read_bytes() == ULYSSES_CSV.read_bytes()
    plan = ["plan", "ulysses", "--heads", "24", "--dim", "128", "--tokens", "32760", "--ranks", "8", "--json"]
    assert _run(capsys, [*plan, "--calibration", str(files["bom"])])["rows"] == _run(capsys, plan)["rows"]
