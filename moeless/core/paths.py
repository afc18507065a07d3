"""Where moeless keeps what it builds: the user cache directory (override with MOELESS_CACHE)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$MOELESS_CACHE, else $XDG_CACHE_HOME/moeless, else ~/.cache/moeless (created)."""
    root = os.environ.get("MOELESS_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(base) / "moeless")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
