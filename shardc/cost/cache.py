"""A small on-disk JSON cache (one file per namespace) for measured costs.

Location: `$SHARDC_CACHE_DIR`, else `~/.cache/shardc`. Writes are atomic (temp file + rename), so
concurrent processes never read a half-written file; a corrupt file is treated as empty.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
from typing import Any

__all__ = ["cache_dir", "DiskCache"]


def cache_dir() -> str:
    d = os.environ.get("SHARDC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "shardc")
    os.makedirs(d, exist_ok=True)
    return d


class DiskCache:
    """str -> JSON value, persisted in `<cache_dir>/<name>.json`."""

    def __init__(self, name: str, directory: str | None = None) -> None:
        self.path = os.path.join(directory or cache_dir(), f"{name}.json")
        self._lock = threading.Lock()
        self._data: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._data is None:
            try:
                with open(self.path) as f:
                    self._data = json.load(f)
                if not isinstance(self._data, dict):
                    self._data = {}
            except (OSError, ValueError):
                self._data = {}
        return self._data

    def get(self, key: str) -> Any:
        return self._load().get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._load()

    def __len__(self) -> int:
        return len(self._load())

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            data = self._load()
            data[key] = value
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, sort_keys=True)
            os.replace(tmp, self.path)
