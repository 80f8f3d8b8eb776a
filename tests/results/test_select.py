"""`--only KEY=V1,V2`: one parser, the same refusal of a malformed spelling in every command."""

import pytest

from xstage.cli import main
from xstage.errors import InputError
from xstage.results.select import parse_only, parse_spec, select

GRID = [{"P": p, "tokens": t, "path": "host"} for p in (2, 4, 8) for t in (256, 512)]

MALFORMED = {
    "n_sm==1": "the value '=1'",
    "n_sm=1=2": "the value '1=2'",
    "=1": "expected KEY=V1",
    "n_sm": "expected KEY=V1",
    "n_sm=": "an empty value",
    "n_sm=1,,2": "an empty value",
    "n_sm=1,": "an empty value",
    "n sm=1": "expected KEY=V1",
    "n_sm=1 2": "the value '1 2'",
    "1x=1": "expected KEY=V1",
}


@pytest.mark.parametrize("spec", list(MALFORMED))
def test_malformed_spellings_are_refused_by_the_parser(spec):
    with pytest.raises(InputError) as e:
        parse_spec(spec)
    assert str(e.value).startswith(f"--only {spec!r}: ") and MALFORMED[spec] in str(e.value)
    assert "KEY=V1[,V2...]" in str(e.value)


def test_wellformed_spellings_parse_to_their_values():
    assert parse_spec("P=2,4") == ("P", ["2", "4"])
    assert parse_spec(" variant = lag:4@off , overlap:cudnn:3:waves") == ("variant", ["lag:4@off",
                                                                                    "overlap:cudnn:3:waves"])
    assert parse_only(["P=2", "P=8", "tokens=512"]) == {"P": {"2", "8"}, "tokens": {"512"}}


def test_select_matches_as_strings_and_refuses_an_empty_selection():
    assert select(GRID, ["P=2,8", "tokens=512"]) == [GRID[1], GRID[5]]
    assert select(GRID, None) == GRID and select([], ["P=2"]) == []
    with pytest.raises(InputError, match=r"--only P=3: selects none of the 6 \(P is one of 2, 4, 8\)"):
        select(GRID, ["P=3"])
    with pytest.raises(InputError, match="selects none"):
        select(GRID, ["P=2", "tokens=1024"])
    with pytest.raises(InputError, match=r"unknown field\(s\) \['heads'\]"):
        select(GRID, ["heads=3"])


def _one_line(capsys) -> str:
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and cap.out == "", cap
    return lines[0]


@pytest.mark.parametrize("spec", ["n_sm==1", "P=2,,4", "=3"])
def test_every_command_refuses_a_malformed_only_the_same_way(spec, tmp_path, capsys):
    csv = tmp_path / "r.csv"
    csv.write_text("a\n1\n")
    commands = {
        "xstage probe": ["probe", "--plan"],
        "xstage plan validate": ["plan", "validate", str(csv), "-o", str(tmp_path / "v")],
        "xstage bench moe": ["bench", "moe", "-o", str(tmp_path / "m")],
        "xstage bench ulysses": ["bench", "ulysses", "-o", str(tmp_path / "u")],
    }
    reasons = set()
    for prog, argv in commands.items():
        assert main([*argv, "--only", spec]) == 2, prog
        line = _one_line(capsys)
        assert line.startswith(f"{prog}: error: argument --only: {spec!r}: ") and line.endswith(f"(see {prog} -h)")
        reasons.add(line.removeprefix(f"{prog}: error: ").removesuffix(f" (see {prog} -h)"))
    assert len(reasons) == 1  # one parser: the same words everywhere
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv"]


def test_probe_plan_refuses_a_slice_that_selects_nothing(capsys):
    assert main(["probe", "--plan", "--only", "n_sm=7"]) == 2
    assert "--only n_sm=7: selects none of the" in _one_line(capsys)
    assert main(["probe", "--plan", "--only", "n_sm=1", "--json"]) == 0
    assert '"n_sm": 1' in capsys.readouterr().out


def test_what_is_not_a_list_of_spellings_or_configurations_is_named():
    """Found by tests/test_fuzz_api.py: True or None here raised a TypeError."""
    with pytest.raises(InputError, match=r"^--only: must be a list of KEY=V1,V2 spellings, got bool$"):
        parse_only(True)
    with pytest.raises(InputError, match=r"^--only\[0\]=4: must be KEY=V1,V2 spellings$"):
        parse_only([4])
    with pytest.raises(InputError, match=r"^configs: must be a list of configurations .*, got NoneType$"):
        select(None, ["P=2"])
    with pytest.raises(InputError, match=r"^configs\[1\]=3: must be configurations"):
        select([{"P": 2}, 3], ["P=2"])
