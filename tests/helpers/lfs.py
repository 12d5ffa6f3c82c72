"""Git LFS upstreams for the tests, without git-lfs on the writing side: LFS files
are committed as pointer files (what `git lfs track` + `git add` would commit), and
their objects are put where a local upstream serves them from (.git/lfs/objects,
read by git-lfs's file:// transfer agent) and, when given, into an LFS server."""

from __future__ import annotations

import hashlib
import os

from .repos import Upstream

ATTRIBUTES = "*.bin filter=lfs diff=lfs merge=lfs -text\n"


def lfs_oid(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pointer(data: bytes) -> str:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{lfs_oid(data)}\nsize {len(data)}\n"


class LfsUpstream(Upstream):
    """An upstream whose *.bin files are LFS files."""

    def __init__(self, path: str, objects: dict[str, bytes] | None = None):
        super().__init__(path)
        self.objects = objects if objects is not None else {}  # oid -> content: what an LFS server holds

    def commit_lfs(self, lfs_files: dict[str, bytes], other: dict[str, str] | None = None,
                   message: str = "change", upload: bool = True) -> str:
        """Commit lfs_files (names ending in .bin) as LFS files; upload=False leaves
        their objects out of every upstream store (pushed without them)."""
        files: dict[str, bytes | str] = {".gitattributes": ATTRIBUTES, **(other or {})}
        for name, data in lfs_files.items():
            assert name.endswith(".bin")
            files[name] = pointer(data)
            if upload:
                self.put_object(data)
        return self.commit(files, message=message)

    def put_object(self, data: bytes) -> str:
        oid = lfs_oid(data)
        self.objects[oid] = data
        directory = os.path.join(self.path, ".git", "lfs", "objects", oid[:2], oid[2:4])
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, oid), "wb") as handle:
            handle.write(data)
        return oid
