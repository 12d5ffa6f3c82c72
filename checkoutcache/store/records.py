"""Small JSON records on disk: always written whole (temp file in the same
directory, then os.replace), read as None when missing or unreadable; and the
record a failed clone leaves (`Failure`, state/<sha>.failed.json).

A reader never sees half a record: a process killed mid-write leaves at most
a stray temp file (`.<name>.<pid>.<random>.tmp`). Temp names are unique per
write, not per process: threads share a pid.
"""

from __future__ import annotations

import json
import os

import attrs

from checkoutcache.store.layout import FILE_MODE

TMP_SUFFIX = ".tmp"


def write_json(path: str, value: dict) -> None:
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{os.urandom(4).hex()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(value, handle, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def read_json(path: str) -> dict | None:
    try:
        with open(path) as handle:
            value = json.load(handle)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
        if not record:
            return None
        try:
            return cls(code=str(record["code"]), message=str(record["message"]),
                       next=str(record["next"]), attempts=int(record["attempts"]),
                       failed_at=float(record["failed_at"]), retry_at=float(record["retry_at"]))
        except (KeyError, TypeError, ValueError):
            return None

    def to_record(self) -> dict:
        return attrs.asdict(self)


def read_failure(path: str) -> Failure | None:
    return Failure.from_record(read_json(path))
