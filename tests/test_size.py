"""No file past a reader's patience: every module of the package is at most 600 lines, and every function
at most 120 lines, except Triton kernels (a kernel is one program; splitting it into device functions
would only move its lines)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "xstage"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120


def _is_kernel(fn: ast.FunctionDef) -> bool:
    """Decorated with `triton.jit` (or `@jit`), with or without arguments."""
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Attribute) and target.attr == "jit") or (
                isinstance(target, ast.Name) and target.id == "jit"):
            return True
    return False


def _modules():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50, f"only {len(files)} modules under {SRC}"  # the walk found the package
    return files


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(SRC)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_but_a_kernel_is_over_120_lines():
    long, kernels = {}, 0
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _is_kernel(node):
                    kernels += 1
                elif (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(SRC)}:{node.lineno} {node.name}"] = n
    assert kernels >= 5  # the kernel test recognised the package's kernels
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
