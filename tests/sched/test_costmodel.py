"""The cost-model object and the docs' cost-model page list the same terms, and every term points at
code, data, experiments and results that exist."""

import importlib
import re
from pathlib import Path

import pytest

from xstage.sched.costmodel import EXCHANGE_TERMS, MOE_TERMS

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "cost-model.md").read_text()


def _page_terms(section: str) -> list[str]:
    body = PAGE.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| ([^|]+?) \| ", body, re.M)][1:]  # the header row is first


@pytest.mark.parametrize("section,terms", [("A fused MoE task", MOE_TERMS), ("A Ulysses exchange", EXCHANGE_TERMS)])
def test_the_page_lists_the_objects_terms_in_order(section, terms):
    assert _page_terms(section) == [t.name for t in terms]


@pytest.mark.parametrize("term", [*MOE_TERMS, *EXCHANGE_TERMS], ids=lambda t: t.name)
def test_each_term_points_at_what_exists(term):
    module, _, attr = term.applied_in.split(" ")[0].rpartition(".")
    try:
        owner = importlib.import_module(module)
    except ModuleNotFoundError:  # a method: module.Class.method
        module, _, cls = module.rpartition(".")
        owner = getattr(importlib.import_module(module), cls)
    assert hasattr(owner, attr), term.applied_in
    for name in term.data:
        assert (ROOT / "src" / "xstage" / "data" / name).is_file(), name
    for folder in term.results:
        assert (ROOT / "benchmarks" / "results" / folder).is_dir(), folder
    for script in re.findall(r"benchmarks/experiments/\S+\.py", term.experiment):
        assert (ROOT / script).is_file(), script
    assert term.experiment.startswith(("xstage ", "benchmarks/experiments/"))
