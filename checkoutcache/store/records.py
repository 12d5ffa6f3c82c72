"""Small JSON records on disk: always written whole (temp file in the same
directory, then os.replace), validated when read; and the record a failed
clone leaves (`Failure`, state/<sha>.failed.json).

A reader never sees half a record: a process killed mid-write leaves at most
a stray temp file (`.<name>.<pid>.<random>.tmp`). Temp names are unique per
write, not per process: threads share a pid.

Every record comes from a peer (another uid of the group, another version of
this tool, or whoever can write the root), so reading one checks it against
its kind's schema below (types, finite numbers, known codes): a record that
fails is read as absent (None), and `Reader` collects it with why, for status
and gc to list. A missing record is None; one that cannot be read (EACCES,
EIO) raises OSError: the caller decides what that entry costs.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
from typing import Any, Callable

import attrs

from checkoutcache.errors import CODES
from checkoutcache.store import tree
from checkoutcache.store.modes import open_created
from checkoutcache.store.ready import MAX_RECORD_BYTES

TMP_SUFFIX = ".tmp"


def write_json(path: str, value: dict) -> None:
    """Write a record whole: a temp file and the rename, both relative to one descriptor of
    its directory, resolved beneath the root (store/tree.py): never through a symlink."""
    with tree.parent_of(path) as (dir_fd, name):
        tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}{TMP_SUFFIX}"
        fd = open_created(tmp, os.O_WRONLY | os.O_TRUNC | os.O_EXCL | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(value, handle, sort_keys=True)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            raise


def load_json(path: str) -> Any:
    """The parsed content; None when the file is missing or is not JSON. OSError otherwise
    (tree.NotBeneath for a record reached through a symlink, tree.NotAFile for a FIFO, socket
    or device where it should be: neither is ever read)."""
    try:
        fd = tree.open_file(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except tree.NotAFile as exc:
        if exc.kind == "a directory":
            return None  # not a record, and opening it waited for nothing
        raise  # a FIFO, a socket, a device: never read (it could block), counted by the caller
    except tree.NotBeneath:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None  # the record itself is a symlink: not a record, never followed
        raise
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(MAX_RECORD_BYTES + 1)
    if len(data) > MAX_RECORD_BYTES:
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def remove_quietly(path: str) -> None:
    tree.unlink(path)


# ------------------------------------------------------------------ schemas
# A schema maps each field to a check; `None` in a check's name means the field
# may be absent or null. A record may carry fields a newer version added.

Check = Callable[[Any], bool]


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def text(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= 1 << 16


def sha(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{40}([0-9a-f]{24})?", value) is not None


def key(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{32}", value) is not None


def code(value: Any) -> bool:
    return isinstance(value, str) and value in CODES


def one_of(*allowed: Any) -> Check:
    return lambda value: value in allowed


def list_of(item: Check) -> Check:
    return lambda value: isinstance(value, list) and len(value) <= 100_000 and all(item(v) for v in value)


def pair(first: Check, second: Check) -> Check:
    return lambda value: isinstance(value, list) and len(value) == 2 and first(value[0]) and second(value[1])


def mapping(value: Any) -> bool:
    return isinstance(value, dict)


def optional(check: Check) -> Check:
    return lambda value: value is None or check(value)


Schema = dict[str, tuple[Check, bool]]  # field -> (check, required)


def schema(required: dict[str, Check], optional_fields: dict[str, Check] | None = None) -> Schema:
    fields = {name: (check, True) for name, check in required.items()}
    fields.update({name: (optional(check), False) for name, check in (optional_fields or {}).items()})
    return fields


MARKER = schema({"commit": sha, "top": list_of(text)},
                {"published_at": finite, "pid": count, "lfs": one_of("content", "pointers", "off"),
                 "lfs_why": text, "submodules": one_of("included", "none"), "borrows": list_of(pair(key, sha)),
                 "sparse": list_of(text), "lfs_filter": one_of(True, False), "conversion": text})
CLONE = schema({"started_at": finite, "commit": sha},
               {"pid": count, "pid_start": finite, "pidns": text, "progress": mapping, "deaths": count,
                "transport": text, "borrows": list_of(pair(key, sha)), "queue": mapping})
FAILURE = schema({"code": code, "message": text, "next": text, "attempts": count, "failed_at": finite,
                  "retry_at": finite}, {"repo": text, "scope": text})
DEATHS = schema({"deaths": count, "at": finite}, {"commit": sha})
SIZE = schema({"bytes": count}, {"use_at_measure": finite, "index": list_of(count)})
# A spare (spares/<name>.<nonce>/spare.json): what a worker needs to know to update it in place.
SPARE = schema({"commit": sha, "name": text, "bytes": count, "index": list_of(count), "spared_at": finite},
               {"lfs": one_of("content", "pointers", "off"), "submodules": one_of("included", "none"),
                "submodules_setting": one_of("recursive", "none"), "sparse": list_of(text), "conversion": text})
LAST_USE = schema({"at": finite})
REPO = schema({"url": text, "scope": text}, {"is_local": one_of(True, False), "layout_version": count,
                                              "created_at": finite, "lfs": one_of("on", "off"),
                                              "submodules": one_of("recursive", "none")})
OWNER = schema({"pid": count, "start_time": finite}, {"pidns": text, "commit": text, "created_at": finite})
# How a mirror was made when CHECKOUTCACHE_FILTER asked for a partial one (state/mirror-filter.json).
MIRROR_FILTER = schema({"filter": text, "partial": one_of(True, False)}, {"note": text, "at": finite})
MIRROR_GC = schema({"at": finite}, {"pending": one_of(True, False), "lfs_pending": one_of(True, False)})
SEED = schema({"seeded": one_of(True, False)},
              {"bundles": list_of(text), "why": text, "reason": text, "store": text, "bundle_bytes": count,
               "seconds": finite, "at": finite, "upstream": mapping, "bundle_refs_dropped": one_of(True, False)})
# The background history of a mirror (state/history.json, clone/history.py): its owner and
# progress while locks/history.lock is held; once done, when (completed_at) and how.
HISTORY = schema({"started_at": finite},
                 {"pid": count, "pid_start": finite, "pidns": text, "progress": mapping, "rounds": count,
                  "completed_at": finite, "seconds": finite, "seeded": one_of(True, False), "note": text})
# A merge base a review asked for (state/<name>.bases.json, clone/history.py): base -> merge base;
# version: the search's (an older version's merge bases are not read).
BASES = schema({"bases": mapping}, {"at": finite, "version": count})
LIMITS = schema({"limits": mapping, "writer": one_of("serve", "gc"), "at": finite},
                {"pid": count, "version": text})
UNREMOVABLE = schema({"entries": list_of(mapping)}, {"checked_at": finite})
# state/held.json: since when gc has seen each held checkout held (upkeep/gc.py note_held).
HELD = schema({"since": mapping})


def invalid(value: Any, kind: Schema) -> str | None:
    """Why a parsed record does not fit its schema (None: it fits)."""
    if not isinstance(value, dict):
        return "not a JSON object"
    for name, (check, required) in kind.items():
        if name not in value:
            if required:
                return f"no {name!r}"
            continue
        if not check(value[name]):
            return f"{name!r} is {str(value[name])[:40]!r}"
    return None


def read_json(path: str, kind: Schema | None = None) -> dict | None:
    """A record that fits its kind (any JSON object without one); None when it is
    missing or does not fit. OSError when it cannot be read."""
    value = load_json(path)
    if value is None:
        return None
    return value if invalid(value, kind or {}) is None else None


@attrs.define
class Reader:
    """Reads records of a root for status and gc, collecting those that cannot be
    read or do not fit their schema: each costs its entry, never the run."""

    root: str
    problems: list[dict] = attrs.Factory(list)

    def note(self, path: str, error: str, why: str = "") -> None:
        self.problems.append({"path": os.path.relpath(path, self.root), "error": error, "why": why[:200]})

    def read(self, path: str, kind: Schema) -> dict | None:
        try:
            value = load_json(path)
        except OSError as exc:
            self.note(path, errno_name(exc), exc.strerror or "")
            return None
        if value is None:
            if tree.lexists(path):
                self.note(path, "INVALID", "not JSON")
            return None
        why = invalid(value, kind)
        if why is not None:
            self.note(path, "INVALID", why)
            return None
        return value


def errno_name(exc: OSError) -> str:
    """What a report calls an entry's error: NOT_A_FILE (layout.NotAFile), else the errno's name."""
    return getattr(exc, "code", None) or errno.errorcode.get(exc.errno or 0, type(exc).__name__)


@attrs.frozen
class Failure:
    """The last failure of a commit's clone: what to answer, and until when."""

    code: str
    message: str
    next: str
    attempts: int
    failed_at: float
    retry_at: float

    @classmethod
    def from_record(cls, record: dict | None) -> "Failure | None":
        if not record or invalid(record, FAILURE) is not None:
            return None
        return cls(code=record["code"], message=record["message"], next=record["next"],
                   attempts=int(record["attempts"]), failed_at=float(record["failed_at"]),
                   retry_at=float(record["retry_at"]))

    def to_record(self) -> dict:
        return attrs.asdict(self)


def read_failure(path: str) -> Failure | None:
    return Failure.from_record(read_json(path, FAILURE))
