"""Where exl-backends keeps a user's files, by the XDG base directories: the cache (the quickstart's model, the
tokenizer classes AutoTokenizer picked) and the configuration (the server's API key). Nothing here imports torch, so
the commands can find their files before their clocks start."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/exl-backends, else ~/.cache/exl-backends."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "exl-backends"


def config_dir() -> Path:
    """$XDG_CONFIG_HOME/exl-backends, else ~/.config/exl-backends."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "exl-backends"
