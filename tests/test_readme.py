"""The README tells the truth: its CPU example runs as written, and every `xstage ...` command it (or a
docstring) shows parses with the real command line."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from xstage.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _cpu_example() -> str:
    section = README.split("### Anywhere", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_cpu_example_runs_as_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # import xstage must choose it
    env["PYTHONPATH"] = str(ROOT / "src")
    if "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the example is the no-GPU path even on a GPU machine
    script = tmp_path / "example.py"
    script.write_text(_cpu_example())
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert "moe (16, 64) True True" in lines  # matches the float32 reference; schedules and pacing agree
    assert "ulysses (1, 24, 4, 32)" in lines
    issue = next(int(line.split()[1]) for line in lines if line.startswith("issue_ns"))
    assert 3000 < issue < 8000  # 256 KiB at the host link's ~50 GB/s per SM, past its per-SM window
    assert "Triton's CPU interpreter" in out.stderr  # the one-time notice


def _xstage_lines(text: str) -> list[str]:
    """`xstage ...` commands in code spans, code blocks and table cells (placeholders made concrete)."""
    cmds = []
    # In code: after a backtick, or at the start of a (code block or docstring example) line.
    for m in re.finditer(r"(?:^[ \t]*|`)((?:PYTHONPATH=src python3 -m )?xstage (?:[a-z<][\w<>-]*)(?: [^`|\n#]*)?)",
                         text, re.M):
        cmd = m.group(1).replace("PYTHONPATH=src python3 -m ", "").strip()
        cmd = cmd.replace("\\|", "|")
        cmds.append(cmd)
    return cmds


def _args(cmd: str) -> list[str] | None:
    try:
        words = shlex.split(cmd)[1:]
    except ValueError:
        return None
    out = []
    for w in words:
        if w == "..." or w.startswith("<"):  # elisions and placeholders such as <grid>
            continue
        if w.startswith("[") or w.endswith("]"):  # optional parts: keep the flag words inside
            w = w.strip("[]")
        if "|" in w and not w.startswith("-"):
            w = w.split("|")[0]  # alternatives: take the first
        if w:
            out.append(w)
    return out


def _docstring_texts() -> list[str]:
    import ast

    texts = []
    for f in (ROOT / "src" / "xstage").rglob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    return texts


def _check(parser, words: list[str]) -> str | None:
    """None when `words` name real subcommands and only flags they have; else what is wrong. Required
    arguments may be left out: prose names commands without their arguments."""
    import argparse

    value = False  # the word after a flag that takes one is its value, not a command
    for w in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and not w.startswith("-") and not value:
            if w not in subs[0].choices:
                return f"unknown command {w!r}"
            parser = subs[0].choices[w]
            continue
        value = False
        if w.startswith("-"):
            flag = w.split("=", 1)[0]
            action = next((a for a in parser._actions if flag in a.option_strings), None)
            if action is None:
                known = {o for a in parser._actions for o in a.option_strings}
                return f"unknown flag {flag!r} (known: {sorted(known)})"
            value = "=" not in w and action.nargs != 0
    return None


DOCS = sorted((ROOT / "docs").rglob("*.md"))


@pytest.mark.parametrize("source", ["README and docs", "docstrings"])
def test_every_documented_command_parses(source):
    texts = [README, *(p.read_text() for p in DOCS)] if source == "README and docs" else _docstring_texts()
    parser = build_parser()
    bad, seen = [], 0
    for text in texts:
        for cmd in _xstage_lines(text):
            args = _args(cmd)
            if not args:
                continue
            seen += 1
            problem = _check(parser, args)
            if problem:
                bad.append(f"{cmd}: {problem}")
    assert seen >= (10 if source == "README and docs" else 1)
    assert not bad, "\n".join(bad)


def test_the_readme_is_a_users_page():
    # at most 150 lines of at most 120 characters; the rest lives in docs/ (the site CI builds)
    lines = README.splitlines()
    assert len(lines) <= 150, len(lines)
    assert max(len(line) for line in lines) <= 120
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).is_file(), link
