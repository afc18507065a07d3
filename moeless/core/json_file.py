"""One JSON file read with the two ways it fails said in the caller's own error type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, error: type[Exception], missing: str) -> Any:
    """The parsed document at path; a missing file raises error("{path}: {missing}"), bad JSON
    error("{path}: not valid JSON (...)")."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except json.JSONDecodeError as err:
        raise error(f"{path}: not valid JSON ({err})") from err
