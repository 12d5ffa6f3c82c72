"""Parsing the human forms of durations, sizes and free-space targets.

Durations: `900` (seconds), `15m`, `1h`, `2d`, `1h30m`, `500ms`. Sizes, always
with their unit: `1024B`, `500M`, `20G`, `1.5T` (binary units: K = 1024; a bare
number is refused: `10` meant as 10 GiB would be 10 bytes). Free space: a size,
or `10%` of the filesystem. Bad forms raise CheckoutCacheError("BAD_ARGUMENT"), and so
does anything not finite (NaN, infinities, numbers too large for a float):
a NaN grace window compares false with everything and would evict at once.
"""

from __future__ import annotations

import datetime
import math
import re

from checkoutcache.errors import CheckoutCacheError

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _bad(what: str, value: object, forms: str) -> CheckoutCacheError:
    shown = repr(value)[:60]
    return CheckoutCacheError("BAD_ARGUMENT", what=f"{what} {shown} is not valid; use {forms}")


def parse_duration(value: str | float | int, what: str = "the duration") -> float:
    if isinstance(value, bool):
        raise _bad(what, value, "a number of seconds")
    if isinstance(value, (int, float)):
        if not _finite(value) or value < 0:
            raise _bad(what, value, "a finite, non-negative number of seconds")
        return float(value)
    text = str(value).strip().lower()
    if not text or len(text) > 32:
        raise _bad(what, value, "seconds or a form such as 900, 15m, 1h, 1h30m, 2d")
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
    elif _DURATION_PART.sub("", text) == "":
        seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(text))
    else:
        raise _bad(what, value, "seconds or a form such as 900, 15m, 1h, 1h30m, 2d")
    if not _finite(seconds):
        raise _bad(what, value, "a finite number of seconds")
    return seconds


def _finite(number: float | int) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int too large for a float
        return False


def parse_size(value: str | int, what: str = "the size") -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not _finite(value)):
        raise _bad(what, value, "a finite number of bytes")
    if isinstance(value, int):
        if value < 0 or value >= 1 << 63:
            raise _bad(what, value, "a non-negative number of bytes")
        return value
    text = str(value).strip()
    match = _SIZE.fullmatch(text) if len(text) <= 32 else None
    if match is None or (match.group(3) and match.group(3).lower() not in ("b", "ib")):
        raise _bad(what, value, "a size with its unit, such as 1024B, 500M, 20G, 1.5T")
    if not match.group(2) and not match.group(3):
        # A bare number is ambiguous (10 meant as 10 GiB is 10 bytes): a unit, always.
        raise _bad(what, value, "a size with its unit, such as 1024B, 500M, 20G, 1.5T (a bare number is ambiguous)")
    size = float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]
    if not _finite(size) or size >= 1 << 63:
        raise _bad(what, value, "a size below 8 EiB")
    return int(size)


class FreeTarget:
    """A minimum of free space: absolute bytes, or a percent of the filesystem. Immutable,
    equal by value. Not an attrs class: this module is on the CLI's hand-off path, where
    importing attrs cost 34 ms of a ~200 ms answer."""

    __slots__ = ("bytes", "percent")
    bytes: int | None
    percent: float | None

    def __init__(self, bytes: int | None = None, percent: float | None = None) -> None:
        object.__setattr__(self, "bytes", bytes)
        object.__setattr__(self, "percent", percent)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"FreeTarget is immutable: {name}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FreeTarget) and (self.bytes, self.percent) == (other.bytes, other.percent)

    def __hash__(self) -> int:
        return hash((self.bytes, self.percent))

    def __repr__(self) -> str:
        return f"FreeTarget(bytes={self.bytes!r}, percent={self.percent!r})"

    def bytes_of(self, total: int) -> int:
        if self.percent is not None:
            return int(total * self.percent / 100)
        return int(self.bytes or 0)

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else f"{self.bytes}B"


def parse_free(value: str | int, what: str = "the free-space target") -> FreeTarget:
    text = str(value).strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise _bad(what, value, "a percent such as 10% or a size such as 5G") from None
        if not _finite(percent) or not 0 <= percent < 100:
            raise _bad(what, value, "a percent from 0 to 99")
        return FreeTarget(percent=percent)
    return FreeTarget(bytes=parse_size(text, what))


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
    return f"{seconds // 86400}d"


def iso(ts: float | None) -> str | None:
    """A timestamp as answers show it: UTC, ISO 8601, seconds."""
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
