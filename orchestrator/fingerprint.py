"""One short hash of JSON-able parts: the key of cached corpus chunks, of resumable pipeline stages and of
experiment arms. Changing it renames every committed corpus chunk: don't."""

from __future__ import annotations

import hashlib
import json


def fingerprint(*parts: object) -> str:
    """16 hex digits of sha256 over `parts` as sorted-key JSON (what JSON cannot hold, as `str`)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
