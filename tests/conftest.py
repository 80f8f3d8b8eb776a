"""Markers `gpu` / `multi_gpu` become skips where the hardware is absent; CPU runs use Triton's interpreter.

Hypothesis profiles: `ci` (the default) replays the same examples on every run (`derandomize`), so a
red CI is never a roll of the dice, and keeps no example database; `dev` (`HYPOTHESIS_PROFILE=dev`)
draws ten times as many examples at random and remembers failing ones in `.hypothesis/`. Neither
has a deadline: the property tests run their examples under their own watchdog
(`tests/fuzzing.py`), which fails a hang instead of timing a slow CI machine.
"""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

try:
    import torch

    _GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
except ImportError:
    _GPUS = 0

if _GPUS == 0:
    # Must be set before any @triton.jit decorator runs, so that kernels run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "multi_gpu" in item.keywords and _GPUS < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and _GPUS < 1:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return "cuda" if _GPUS else "cpu"
