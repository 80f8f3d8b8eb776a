"""The floors hold at run time, not only in the import graph: what a floor loads, and who writes what.

import-linter checks the imports a module names (`lint-imports`). Two properties it cannot see are
checked here, in fresh processes: importing a package runs its parents' `__init__`, so a floor that
must not load torch is checked by loading it; and no module may change another package's module
state (a registry, a global) when it is imported or by the assignments it makes, so that a lower floor
never depends on who imported what.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("modules", [
    pytest.param(["xstage"], id="xstage"),
    pytest.param(["xstage.spec.moe", "xstage.spec.schedule", "xstage.spec.variant", "xstage.spec.pacing",
                  "xstage.spec.exchange", "xstage.spec.ulysses", "xstage.spec.paths", "xstage.spec.stages"], id="spec"),
    pytest.param(["xstage.model", "xstage.model.fit", "xstage.model.profile"], id="model"),
])
def test_spec_the_model_and_the_root_package_load_neither_torch_nor_triton(modules):
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + \
        "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))\n"
    assert _run(code).strip() == "[]"


# In one fresh process, import every module of the package in turn; before each import, note the module
# state of every xstage module already loaded (each global's identity, and the contents of dicts, lists
# and sets); after it, any change in a module of another package than the modules just loaded is a write.
_SNAPSHOT = r"""
import importlib, json, pkgutil, sys, types, warnings
warnings.simplefilter("ignore")  # the deprecated modules warn when imported
import xstage

def package(name):
    return ".".join(name.split(".")[:2])

def state(mod):
    out = {}
    for k, v in list(vars(mod).items()):
        if k.startswith("__") or isinstance(v, types.ModuleType):  # an import binds submodules: not a write
            continue
        if isinstance(v, dict):
            out[k] = (id(v), sorted((repr(a), id(b)) for a, b in v.items()))
        elif isinstance(v, (list, set)):
            out[k] = (id(v), sorted(id(x) for x in v))
        else:
            out[k] = id(v)
    return out

names = sorted(m.name for m in pkgutil.walk_packages(xstage.__path__, "xstage.") if not m.name.endswith("__main__"))
writes = []
for name in names:
    loaded = {n: m for n, m in sys.modules.items() if n == "xstage" or n.startswith("xstage.")}
    before = {n: state(m) for n, m in loaded.items()}
    importlib.import_module(name)
    new = [n for n in sys.modules if (n == "xstage" or n.startswith("xstage.")) and n not in loaded]
    for n, m in loaded.items():
        after = state(m)
        changed = sorted(k for k in set(before[n]) | set(after) if before[n].get(k) != after.get(k))
        others = [w for w in [name, *new] if package(w) != package(n)]
        if changed and others:
            writes.append([n, changed, others])
print(json.dumps({"modules": len(names), "writes": writes}))
"""


def test_importing_any_module_writes_no_other_packages_module_state():
    got = json.loads(_run(_SNAPSHOT).strip().splitlines()[-1])
    assert got["modules"] > 100  # every module was imported
    assert got["writes"] == []


_MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "update", "setdefault", "add", "discard",
             "popitem", "cache_clear"}


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = SRC / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported_modules(tree: ast.Module) -> dict[str, str]:
    """Local name -> xstage module, for the names a file binds to a module of the package."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "xstage" or a.name.startswith("xstage."):
                    out[a.asname or "xstage"] = a.name if a.asname else "xstage"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("xstage") and not node.level:
            for a in node.names:
                if _is_module(f"{node.module}.{a.name}"):
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _written(node) -> list[ast.expr]:
    """The expressions `node` assigns to, deletes, or mutates through a method call or `setattr`."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        return node.targets if isinstance(node, ast.Assign) else [node.target]
    if isinstance(node, ast.Delete):
        return node.targets
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args:
            return [ast.Attribute(value=node.args[0], attr="?", ctx=ast.Store())]
        if isinstance(f, ast.Attribute) and f.attr in _MUTATORS:
            return [f.value]
    return []


def _base_name(expr) -> str | None:
    """`m` of `m.x`, `m.x[k]`, `m.x.y`: the name a written expression hangs off, if it is an attribute."""
    seen_attr = False
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        seen_attr = seen_attr or isinstance(expr, ast.Attribute)
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) and seen_attr else None


def test_no_module_assigns_to_another_packages_module():
    found = []
    for path in sorted((SRC / "xstage").rglob("*.py")):
        me = _module_name(path)
        tree = ast.parse(path.read_text())
        mods = _imported_modules(tree)
        for node in ast.walk(tree):
            for target in _written(node):
                base = _base_name(target)
                if base in mods and _package(mods[base]) != _package(me):
                    found.append(f"{me}:{node.lineno} writes {mods[base]}")
    assert found == []


def test_the_checks_above_see_a_write(tmp_path):
    # The AST check on a module that writes another package's registry, and one that does not.
    bad = ast.parse("import xstage.spec.schedule as S\nS._REGISTRY['x'] = 1\nS._CHOOSERS.update({})\n"
                    "setattr(S, 'PLANNED', 'x')\n")
    mods = _imported_modules(bad)
    hits = [_base_name(t) for n in ast.walk(bad) for t in _written(n)]
    assert mods == {"S": "xstage.spec.schedule"} and hits.count("S") == 3
    good = ast.parse("import xstage.spec.schedule as S\nx = S.CANDIDATES\nlocal = {}\nlocal['a'] = 1\n")
    assert [h for n in ast.walk(good) for t in _written(n) if (h := _base_name(t))] == []
