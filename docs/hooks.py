"""Build-time pages of the docs site: the CLI reference from the parser, the index of results folders.

mkdocs runs `on_page_markdown` for every page; a page holding a marker gets it replaced, so these
pages cannot drift from the parser or from `benchmarks/results/`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _parsers(parser: argparse.ArgumentParser, prefix: str):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prefix} {name}")


def cli_reference() -> str:
    from xstage.cli import build_parser

    parts = []
    for name, parser in _parsers(build_parser(), "xstage"):
        parser.prog = name
        parts.append(f"### `{name}`\n\n```\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def results_index() -> str:
    rows = ["| folder | what it holds |", "|---|---|"]
    for readme in sorted((ROOT / "benchmarks" / "results").glob("*/README.md")):
        title = next((line.lstrip("# ").strip() for line in readme.read_text().splitlines() if line.startswith("#")),
                     "")
        rows.append(f"| `benchmarks/results/{readme.parent.name}/` | {title.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if "<!-- cli-reference -->" in markdown:
        markdown = markdown.replace("<!-- cli-reference -->", cli_reference())
    if "<!-- results-index -->" in markdown:
        markdown = markdown.replace("<!-- results-index -->", results_index())
    return markdown
