"""Who writes a store (CHECKOUTCACHE_SHARING): the one spelling of the setting,
read by config.py (its declaration, its errors) and by store/modes.py (the modes
it implies) alike. docs/security.md says what each mode trusts.

- `writer` (the default): the writer's uid alone writes the store; everyone else
  reads it (a read-only mount) and asks the writer for what needs a write.
- `group`: every member of the root's group writes it (peers that trust each other).
"""

from __future__ import annotations

import os

SHARING_VAR = "CHECKOUTCACHE_SHARING"
WRITER, GROUP = "writer", "group"


def parse_sharing(value: object) -> str:
    """writer or group; ValueError naming what is allowed."""
    text = str(value).strip().lower()
    if text not in (WRITER, GROUP):
        raise ValueError(f"{str(value)[:40]!r} is not writer or group")
    return text


def sharing() -> str:
    """The mode in force. A malformed value is reported by config.py before anything is
    written; here it falls back to the safer one-writer mode."""
    try:
        return parse_sharing(os.environ.get(SHARING_VAR) or WRITER)
    except ValueError:
        return WRITER
