"""Compile kernels for sm_90 on a machine without a GPU: the interpreter runs code the GPU compiler may
refuse (a loop that changes a variable's shape, say), so the tests that change kernels compile them
here too."""

import os
import subprocess
import sys

import pytest


def assert_compiles_for_hopper(script: str) -> None:
    """Run `script` (which compiles with `triton.compile` for `GPUTarget("cuda", 90, 32)` and prints
    "compiled") outside the interpreter, in a fresh process."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
