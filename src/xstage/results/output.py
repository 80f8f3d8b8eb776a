"""What a command prints: text for people, or JSON for scripts (`--json`)."""

from __future__ import annotations

import json


def emit(payload, as_json: bool, text: str) -> None:
    """Print `text` for people or `payload` as JSON for scripts."""
    print(json.dumps(payload, indent=2, default=str) if as_json else text)
