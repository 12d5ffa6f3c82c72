"""Small real filesystems for the disk tests: a tmpfs of a given size (root
only; the test is skipped with the reason elsewhere), filled to a point."""

from __future__ import annotations

import contextlib
import os
import subprocess
from typing import Iterator

import pytest


def tmpfs_unavailable() -> str | None:
    """Why no tmpfs can be mounted here (None: one can)."""
    return None if os.geteuid() == 0 else "mounting a tmpfs needs root"


@contextlib.contextmanager
def small_filesystem(path: str, size: str) -> Iterator[str]:
    """A tmpfs of `size` (e.g. "24m") mounted at path for the block; unmounted after."""
    why = tmpfs_unavailable()
    if why:
        pytest.skip(why)
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path])


def free_bytes(path: str) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


def fill(path: str, leave: int) -> None:
    """Write a balloon file in path until only `leave` bytes are free."""
    with open(os.path.join(path, "balloon"), "ab") as balloon:
        balloon.write(b"\0" * max(0, free_bytes(path) - leave))
