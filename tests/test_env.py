"""Provenance: the source hash, the commit (`-dirty`, `XSTAGE_GIT_COMMIT` in a copy without git) and the
refusal to write results whose commit is unknown."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from xstage import env as xenv
from xstage.errors import InputError
from xstage.results.io import ResultWriter, read_rows

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "xstage"
DEVICE_SCRIPTS = sorted((ROOT / "benchmarks").glob("*.sh"))
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("x = 1\n")
    (root / "sub" / "kernels.py").write_text("def f():\n    return 2\n")
    (root / "sub" / "profile.json").write_text('{"a": 1}\n')
    (root / "table.csv").write_text("a,b\n1,2\n")
    return root


@pytest.fixture
def no_git_above(tmp_path, monkeypatch):
    """git must not find a repository above tmp_path (the copy on a device machine has none)."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.delenv("XSTAGE_GIT_COMMIT", raising=False)
    return tmp_path


def test_src_hash_is_stable_and_independent_of_location_and_times(tmp_path):
    a = _tree(tmp_path / "a" / "xstage")
    h = xenv.source_hash(a)
    assert len(h) == 12 and int(h, 16) >= 0
    assert xenv.source_hash(a) == h
    b = tmp_path / "b" / "xstage"
    shutil.copytree(a, b)  # another place, other file times
    os.utime(b / "__init__.py", (0, 0))
    assert xenv.source_hash(b) == h


@pytest.mark.parametrize("change", ["edit_py", "edit_json", "edit_csv", "add_py", "rename", "delete"])
def test_src_hash_changes_with_the_sources(tmp_path, change):
    root = _tree(tmp_path / "xstage")
    before = xenv.source_hash(root)
    if change == "edit_py":
        (root / "sub" / "kernels.py").write_text("def f():\n    return 3\n")
    elif change == "edit_json":
        (root / "sub" / "profile.json").write_text('{"a": 2}\n')
    elif change == "edit_csv":
        (root / "table.csv").write_text("a,b\n1,3\n")
    elif change == "add_py":
        (root / "sub" / "new.py").write_text("")
    elif change == "rename":
        (root / "sub" / "kernels.py").rename(root / "sub" / "kernel.py")
    else:
        (root / "table.csv").unlink()
    assert xenv.source_hash(root) != before


def test_src_hash_ignores_other_files(tmp_path):
    root = _tree(tmp_path / "xstage")
    before = xenv.source_hash(root)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0\1")
    (root / "__pycache__" / "stale.py").write_text("y = 1\n")
    (root / "notes.md").write_text("notes\n")
    assert xenv.source_hash(root) == before


def test_environment_records_the_package_hash():
    info = xenv.environment()
    assert info["src_hash"] == xenv.source_hash(PACKAGE) == xenv.source_hash()
    assert list(info).index("src_hash") == list(info).index("git_commit") + 1


def test_copy_without_git_records_the_given_commit(no_git_above, monkeypatch):
    copy = _tree(no_git_above / "copy" / "xstage")
    assert xenv._git_commit(copy) == "unknown"
    monkeypatch.setenv("XSTAGE_GIT_COMMIT", "0123456789ab")
    assert xenv._git_commit(copy) == "0123456789ab"  # as given: no git to tell whether it is dirty


def _git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@needs_git
def test_dirty_checkout_is_recorded_dirty(no_git_above, monkeypatch):
    repo = no_git_above / "repo"
    pkg = _tree(repo / "src" / "xstage")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "x")
    head = _git(repo, "rev-parse", "--short=12", "HEAD")
    assert xenv._git_commit(pkg) == head
    # A named commit wins over git metadata that names another one (a device copy may carry an older
    # .git); the source hash tells whether the named commit is stale.
    monkeypatch.setenv("XSTAGE_GIT_COMMIT", "feedfacecafe")
    assert xenv._git_commit(pkg) == "feedfacecafe"
    monkeypatch.setenv("XSTAGE_GIT_COMMIT", head)  # the same commit: git still tells a dirty tree
    (repo / "out").mkdir()
    (repo / "out" / "moe.csv").write_text("a\n")  # untracked results outside the package: still clean
    assert xenv._git_commit(pkg) == head
    (pkg / "sub" / "new.py").write_text("")  # an untracked module runs too
    assert xenv._git_commit(pkg) == head + "-dirty"
    (pkg / "sub" / "new.py").unlink()
    (pkg / "sub" / "kernels.py").write_text("def f():\n    return 3\n")  # a tracked edit
    assert xenv._git_commit(pkg) == head + "-dirty"
    _git(repo, "checkout", "-q", "--", ".")
    assert xenv._git_commit(pkg) == head


def test_stale_commit_is_detectable_from_src_hash(no_git_above, monkeypatch):
    """A device copy whose XSTAGE_GIT_COMMIT names the checkout's commit but carries edited sources."""
    checkout = _tree(no_git_above / "checkout" / "xstage")
    copy = no_git_above / "copy" / "xstage"
    shutil.copytree(checkout, copy)
    monkeypatch.setenv("XSTAGE_GIT_COMMIT", "0123456789ab")
    assert xenv._git_commit(copy) == "0123456789ab" and xenv.source_hash(copy) == xenv.source_hash(checkout)
    (copy / "sub" / "kernels.py").write_text("def f():\n    return 4\n")
    assert xenv._git_commit(copy) == "0123456789ab" and xenv.source_hash(copy) != xenv.source_hash(checkout)


def test_results_need_a_commit(no_git_above, monkeypatch):
    copy = _tree(no_git_above / "copy" / "xstage")
    env = {"gpu": "g", "git_commit": xenv._git_commit(copy), "src_hash": xenv.source_hash(copy)}
    out = no_git_above / "res" / "moe.csv"
    with pytest.raises(InputError, match="run inside a git checkout or set XSTAGE_GIT_COMMIT"):
        ResultWriter(out, ["shape", "time_ns"], ["shape"], env=env, require_commit=True)
    assert not out.exists()
    monkeypatch.setenv("XSTAGE_GIT_COMMIT", "0123456789ab")
    env["git_commit"] = xenv._git_commit(copy)
    ResultWriter(out, ["shape", "time_ns"], ["shape"], env=env, require_commit=True).write({"shape": "a", "time_ns": 1})
    row = read_rows(out)[0]
    assert (row["git_commit"], row["src_hash"]) == ("0123456789ab", xenv.source_hash(copy))


@pytest.mark.parametrize("script", DEVICE_SCRIPTS, ids=[p.name for p in DEVICE_SCRIPTS])
def test_device_scripts_require_xstage_git_commit(script, tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    env = {k: v for k, v in os.environ.items() if k != "XSTAGE_GIT_COMMIT"}
    env["OUT"] = str(tmp_path / "out")
    res = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "XSTAGE_GIT_COMMIT" in res.stderr
    assert not (tmp_path / "out").exists()  # refused before doing anything
