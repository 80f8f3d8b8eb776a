"""`Outputs`: a command writes new files or its own earlier ones, a user's only with --force, an input
never; what it wrote is recorded in the folder's manifest, also when the run fails or was killed."""

import json
import os

import pytest

from xstage.errors import InputError
from xstage.results.output import MANIFEST, Outputs, file_digest, write_text

CMD = "xstage test"


def _run(folder, *, files=("a.txt",), append=(), force=False, inputs=(), command=CMD, write=None):
    """Declare, then write every named file (or `write(out)`) inside the run, like a command does."""
    outs = Outputs(command, force=force, inputs=inputs)
    out = outs.folder(folder, "-o", files=files, append=append)
    with outs:
        if write is not None:
            write(out)
        else:
            for name in files:
                write_text(out / name, f"{command} wrote {name}\n")
            for name in append:
                with open(out / name, "a") as f:
                    f.write("row\n")
    return out


def _manifest(folder):
    return json.loads((folder / MANIFEST).read_text())


def test_new_files_are_written_and_recorded_with_their_hash(tmp_path):
    out = _run(tmp_path / "new" / "deeper", files=("a.txt", "sub/b.txt"), append=("r.csv",))
    m = _manifest(out)
    assert m["files"] == {"a.txt": {"by": CMD, "sha256": file_digest(out / "a.txt")},
                          "r.csv": {"by": CMD, "append": True}}
    assert "unfinished" not in m  # the run ended
    assert _manifest(out / "sub")["files"]["b.txt"]["sha256"] == file_digest(out / "sub" / "b.txt")


def test_a_rerun_replaces_its_own_files_and_appends_to_its_results(tmp_path):
    out = _run(tmp_path, append=("r.csv",))
    inode = (out / "a.txt").stat().st_ino
    _run(tmp_path, append=("r.csv",))
    assert (out / "a.txt").stat().st_ino != inode  # replaced (through a rename), not refused
    assert (out / "r.csv").read_text() == "row\nrow\n"  # appended to, never rewritten


@pytest.mark.parametrize("append", [False, True], ids=["replaced", "appended"])
def test_a_user_file_is_refused_before_any_work_and_taken_with_force(tmp_path, append):
    (tmp_path / "a.txt").write_text("mine\n")
    kw = {"files": (), "append": ("a.txt",)} if append else {}
    with pytest.raises(InputError) as e:
        _run(tmp_path, write=lambda out: pytest.fail("work started"), **kw)
    assert str(e.value) == (f"-o {tmp_path}: {tmp_path / 'a.txt'} exists and was not written by `{CMD}`; choose "
                            f"another folder or give --force to {'write to' if append else 'replace'} it")
    assert (tmp_path / "a.txt").read_text() == "mine\n" and not (tmp_path / MANIFEST).exists()
    _run(tmp_path, force=True, **kw)
    assert (tmp_path / "a.txt").read_text() == ("mine\nrow\n" if append else f"{CMD} wrote a.txt\n")
    _run(tmp_path, **kw)  # now the command's own


def test_a_changed_file_and_another_commands_file_are_refused(tmp_path):
    _run(tmp_path)
    (tmp_path / "a.txt").write_text("edited by hand\n")
    with pytest.raises(InputError, match=f"was changed since `{CMD}` wrote it; choose another folder or give --force"):
        _run(tmp_path)
    _run(tmp_path, force=True)
    with pytest.raises(InputError, match=f"was written by `{CMD}`, not by `xstage other`"):
        _run(tmp_path, command="xstage other")
    assert (tmp_path / "a.txt").read_text() == f"{CMD} wrote a.txt\n"


def test_a_forced_file_left_unchanged_stays_the_users(tmp_path):
    (tmp_path / "a.txt").write_text("mine\n")
    _run(tmp_path, files=("a.txt", "b.txt"), force=True, write=lambda out: write_text(out / "b.txt", "new\n"))
    assert set(_manifest(tmp_path)["files"]) == {"b.txt"}
    with pytest.raises(InputError, match="a.txt exists and was not written"):
        _run(tmp_path, files=("a.txt",))


def test_patterns_cover_every_file_they_match(tmp_path):
    (tmp_path / "speedup-X.png").write_text("mine")
    (tmp_path / "notes.md").write_text("mine")  # not matched: not the command's business
    with pytest.raises(InputError, match="speedup-X.png exists and was not written"):
        _run(tmp_path, files=("speedup-*.png",), write=lambda out: None)
    _run(tmp_path, files=("speedup-*.png",), force=True,
         write=lambda out: [write_text(out / f"speedup-{s}.png", s) for s in "XY"])
    assert set(_manifest(tmp_path)["files"]) == {"speedup-X.png", "speedup-Y.png"}
    _run(tmp_path, files=("speedup-*.png",), write=lambda out: write_text(out / "speedup-Y.png", "again"))
    assert (tmp_path / "notes.md").read_text() == "mine"


def test_an_input_is_never_an_output_even_with_force(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("input\n")
    (tmp_path / "link").symlink_to(tmp_path)
    os.link(src, tmp_path / "hard.txt")
    for given, files in ((src, ("a.txt",)), (tmp_path / "link" / "a.txt", ("a.txt",)),
                         (tmp_path / "hard.txt", ("a.txt",)), (src, ("*.txt",)), (tmp_path / MANIFEST, ("b.txt",))):
        with pytest.raises(InputError, match=r"is the input --data .*never written, even with --force"):
            _run(tmp_path, files=files, force=True, inputs=[("--data", given)])
    assert src.read_text() == "input\n"
    _run(tmp_path, files=("b.txt",), inputs=[("--data", src), ("--none", None)])  # other files: fine


def test_a_killed_run_leaves_its_files_to_the_next_run_of_that_command(tmp_path):
    outs = Outputs(CMD)
    out = outs.folder(tmp_path, "-o", files=("a.txt", "p-*.png"))
    outs.begin()
    write_text(out / "a.txt", f"{CMD} wrote a.txt\n")  # what the next run writes again: unchanged by it
    write_text(out / "p-1.png", "x")
    # killed here: no finish()
    assert set(_manifest(out)["unfinished"][CMD]) == {"a.txt", "p-*.png"}
    with pytest.raises(InputError, match="not written by `xstage other`"):
        _run(tmp_path, command="xstage other")
    _run(tmp_path, files=("a.txt",))
    m = _manifest(out)
    assert set(m["files"]) == {"a.txt", "p-1.png"} and "unfinished" not in m
    _run(tmp_path, files=("p-*.png",), write=lambda o: None)


def test_a_failed_run_records_what_it_wrote_and_leaves_no_empty_folder(tmp_path):
    def fail_after_one(out):
        write_text(out / "a.txt", "done")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        _run(tmp_path / "o", files=("a.txt", "b.txt"), write=fail_after_one)
    assert set(_manifest(tmp_path / "o")["files"]) == {"a.txt"}
    with pytest.raises(RuntimeError):
        _run(tmp_path / "p" / "q", write=lambda out: (_ for _ in ()).throw(RuntimeError("before writing")))
    assert not (tmp_path / "p").exists()


def test_an_unreadable_manifest_is_refused_unless_forced(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(InputError, match=f"{MANIFEST} is not a record of xstage's outputs"):
        _run(tmp_path)
    _run(tmp_path, force=True)
    assert set(_manifest(tmp_path)["files"]) == {"a.txt"}


def test_folder_and_file_arguments_are_checked(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    with pytest.raises(InputError, match="exists and is not a folder"):
        Outputs(CMD).folder(tmp_path / "f", "-o")
    with pytest.raises(InputError, match="is not a folder"):
        Outputs(CMD).folder(tmp_path / "f" / "deeper", "-o")
    with pytest.raises(InputError, match="is a folder; give a file name"):
        Outputs(CMD).file(tmp_path / "d", "--plot")
    with pytest.raises(InputError, match="does not exist"):
        Outputs(CMD).file(tmp_path / "missing" / "x.png", "--plot")
    (tmp_path / "d" / "plots").write_text("a file where a subfolder goes")
    with pytest.raises(InputError, match="plots is not a folder"):
        Outputs(CMD).folder(tmp_path / "d", "-o", files=["plots/*.png"])
    (tmp_path / "d" / "x.png").mkdir()
    with pytest.raises(InputError, match="exists and is not a file"):
        Outputs(CMD).folder(tmp_path / "d", "-o", files=["x.png"])


def test_recheck_refuses_a_file_that_appeared_while_the_command_ran(tmp_path):
    outs = Outputs(CMD)
    p = outs.file(tmp_path / "p.json", "-o")
    with outs:
        outs.recheck(p)  # still absent: fine
        p.write_text("someone else")
        with pytest.raises(InputError, match="created or changed by another program while this command ran"):
            outs.recheck(p)
