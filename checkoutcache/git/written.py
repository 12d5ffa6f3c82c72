"""What a fresh checkout of a commit writes, compared with a work tree file by file: the
deep check of `verify` (upkeep/verify.py) on the git CLI.

A fresh checkout (git/cli.py) writes each blob through the commit's own `.gitattributes`
(read from the index it makes of the commit: eol, text, ident, working-tree-encoding,
filter), our checkout config (CHECKOUT_CONFIG), and for LFS files git-lfs's smudge filter
when the marker says the checkout ran it. That is reproduced here without writing a tree:

- a private repository in the system's temporary directory, never in the store (a reader
  with a read-only mount may run verify), borrows the mirror's objects (alternates) and
  holds our checkout config alone;
- `git archive --format=tar` of the commit (of its cone) streams every file as git's
  convert_to_working_tree writes it, with the attributes of the commit's own tree (an
  archive reads them from an index made of the tree, as a checkout does), each compared
  chunk by chunk with the tree's file (memory: one chunk). The archive-only attributes
  (export-ignore, export-subst) are switched off in the private repository's
  info/attributes. Not `cat-file --batch --filters`: git 2.39 gives the unconverted size in
  its header, so its stream cannot be split;
- an LFS file (filter=lfs by the commit's attributes, its blob a pointer): where the
  checkout ran git-lfs, the tree's file must hash to the pointer's sha256 and size (no
  git-lfs is run, nothing of the LFS store is opened); else it must be the pointer text;
- symlinks: the target; directories and gitlinks: a directory; every file: its type and
  executable bit.

Nothing of the checkout's own .git is used (its config, attributes or index may be a
reader's), and every file of the tree is opened beneath it, never through a symlink.
Untracked files are not compared (a review's outputs are no damage); neither are the
submodules' trees (the caller's status check sees their commits).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile

from checkoutcache import cones
from checkoutcache.cones import Cone
from checkoutcache.git.backend import CHECKOUT_CONFIG, LFS_POINTER_MAX, parse_lfs_pointer, write_alternates
from checkoutcache.git.cli import make_work_repository, write_git_config
from checkoutcache.git.env import git_env
from checkoutcache.store.beneath import Escape, open_dir_beneath

CHUNK = 1 << 20
SHOWN = 5  # differing paths named in the problem line
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# What an archive applies and a checkout never does: off, above every .gitattributes.
ARCHIVE_ONLY_OFF = b"* -export-ignore -export-subst\n"


def differences(git: str, checkout_dir: str, mirror_objects: str, sha: str, cone: Cone = (),
                lfs_content: bool = False) -> list[str]:
    """Problems (empty: none) of checkout_dir against what a fresh checkout of sha writes there."""
    scratch = tempfile.mkdtemp(prefix="checkoutcache-verify-")
    try:
        return _differences(git, scratch, checkout_dir, mirror_objects, sha, cone, lfs_content)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _differences(git: str, scratch: str, checkout_dir: str, mirror_objects: str, sha: str, cone: Cone,
                 lfs_content: bool) -> list[str]:
    make_work_repository(scratch)
    write_alternates(scratch, mirror_objects)
    git_dir = os.path.join(scratch, ".git")
    write_git_config(git_dir, CHECKOUT_CONFIG)
    os.makedirs(os.path.join(git_dir, "info"), exist_ok=True)
    with open(os.path.join(git_dir, "info", "attributes"), "wb") as handle:
        handle.write(ARCHIVE_ONLY_OFF)
    env = git_env()

    def run(args: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess:
        return subprocess.run([git, "-C", scratch, *args], input=stdin, capture_output=True, env=env, cwd="/")

    found: list[tuple[bytes, str]] = []
    pointers: list[tuple[bytes, bytes, bool]] = []
    tree = Tree(checkout_dir)
    errors_path = os.path.join(scratch, "archive.err")
    try:
        with open(errors_path, "wb") as errors:
            proc = subprocess.Popen([git, "-C", scratch, "archive", "--format=tar", sha, "--",
                                     *(cones.pathspecs(cone) if cone else [])],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors, env=env,
                                    cwd="/")
        try:
            count = _compare_archive(proc.stdout, tree, found, pointers)
        finally:
            proc.stdout.close()
            code = proc.wait()
        if code != 0 or count is None:
            with open(errors_path, "rb") as handle:
                return ["the commit's files cannot be read (is the mirror damaged?): " + _last(handle.read())]
        if pointers:
            _compare_lfs(run, sha, tree, pointers, lfs_content, found)
    finally:
        tree.close()
    if not found:
        return []
    shown = "; ".join(f"{path.decode('utf-8', 'backslashreplace')[:200]!r}: {why}" for path, why in found[:SHOWN])
    return [f"{len(found)} tracked path(s) differ from what a fresh checkout of the commit writes, e.g. {shown}"]


def _compare_archive(stream, tree: "Tree", found: list[tuple[bytes, str]],
                     pointers: list[tuple[bytes, bytes, bool]]) -> int | None:
    """Every member of the archive against the tree; what could be an LFS file (its content a
    pointer) goes to pointers with whether the file equals that text. The members compared
    (None: the archive could not be read)."""
    count = 0
    try:
        archive = tarfile.open(fileobj=stream, mode="r|")
        for member in archive:
            if member.type == tarfile.XGLTYPE or member.name == "pax_global_header":
                continue
            path = os.fsencode(member.name).rstrip(b"/")
            count += 1
            info = tree.lstat(path)
            if member.isdir():
                if info is None or not stat.S_ISDIR(info.st_mode):
                    found.append((path, "missing" if info is None else f"{_kind(info)} where the commit has a "
                                                                        f"directory"))
            elif member.issym():
                if info is None or not stat.S_ISLNK(info.st_mode):
                    found.append((path, "missing" if info is None else f"{_kind(info)} where the commit has a "
                                                                        f"symlink"))
                elif tree.readlink(path) != member.linkname:
                    found.append((path, "a symlink to another target"))
            elif member.isfile():
                _compare_file(archive, member, path, info, tree, found, pointers)
    except (tarfile.TarError, OSError, EOFError):
        return None
    return count


def _compare_file(archive: tarfile.TarFile, member: tarfile.TarInfo, path: bytes, info: os.stat_result | None,
                  tree: "Tree", found: list[tuple[bytes, str]], pointers: list[tuple[bytes, bytes, bool]]) -> None:
    executable = bool(member.mode & 0o100)
    handle = tree.open_file(path, info, executable, found)
    content = archive.extractfile(member)
    small = member.size <= LFS_POINTER_MAX
    text = b""
    equal = handle is not None
    try:
        while chunk := content.read(CHUNK):
            if small:
                text += chunk
            if equal:
                equal = handle.read(len(chunk)) == chunk
        if handle is None:
            return  # (its problem is noted)
        equal = equal and not handle.read(1)  # nothing after what a checkout writes
    finally:
        if handle is not None:
            handle.close()
    if small and parse_lfs_pointer(text) is not None:
        pointers.append((path, text, equal))
    elif not equal:
        found.append((path, "its bytes are not what a checkout writes (line ends, ident, encoding or content)"))


def _compare_lfs(run, sha: str, tree: "Tree", pointers: list[tuple[bytes, bytes, bool]], lfs_content: bool,
                 found: list[tuple[bytes, str]]) -> None:
    """Files whose blob is an LFS pointer: content or the pointer, as the checkout was made."""
    run(["read-tree", sha])  # the commit's attributes, for check-attr --cached (the private index)
    listed = run(["check-attr", "--cached", "-z", "--stdin", "filter"], b"".join(p + b"\0" for p, _, _ in pointers))
    fields = listed.stdout.split(b"\0")
    lfs = {fields[i] for i in range(0, len(fields) - 2, 3) if fields[i + 2] == b"lfs"}
    for path, text, equal in pointers:
        if path not in lfs or not lfs_content:
            if not equal:
                found.append((path, "LFS content where a fresh checkout writes the pointer"
                              if path in lfs and tree.holds_object(path, text) else
                              "its bytes are not what a checkout writes"))
        elif not tree.holds_object(path, text):
            found.append((path, "the LFS pointer where a fresh checkout writes the content" if equal else
                          "not the LFS object's content"))


class Tree:
    """The checkout's files, each opened beneath it without following a symlink."""

    def __init__(self, top: str):
        self.fd = os.open(top, _DIR_FLAGS)
        self.dirs: dict[bytes, int | None] = {}

    def _parent(self, path: bytes) -> tuple[int | None, bytes]:
        parent, _, name = path.rpartition(b"/")
        if parent not in self.dirs:
            if len(self.dirs) >= 64:
                for fd in self.dirs.values():
                    if fd is not None:
                        os.close(fd)
                self.dirs.clear()
            try:
                self.dirs[parent] = open_dir_beneath(self.fd, parent) if parent else os.dup(self.fd)
            except (OSError, Escape):
                self.dirs[parent] = None  # missing, or a symlink or file on the way: its paths are missing
        return self.dirs[parent], name

    def lstat(self, path: bytes) -> os.stat_result | None:
        fd, name = self._parent(path)
        if fd is None:
            return None
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None

    def readlink(self, path: bytes) -> str:
        fd, name = self._parent(path)
        return os.readlink(os.fsdecode(name), dir_fd=fd)

    def open_file(self, path: bytes, info: os.stat_result | None, executable: bool,
                  found: list[tuple[bytes, str]]):
        """The tracked file, opened to read, or None (its problem noted) when it is none such."""
        if info is None:
            found.append((path, "missing"))
            return None
        if not stat.S_ISREG(info.st_mode):
            found.append((path, f"{_kind(info)} where the commit has a file"))
            return None
        if bool(info.st_mode & stat.S_IXUSR) != executable:
            found.append((path, f"mode {stat.S_IMODE(info.st_mode):o} where the commit's file is "
                                f"{'' if executable else 'not '}executable"))
            return None
        fd, name = self._parent(path)
        try:
            opened = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError as exc:
            found.append((path, f"cannot be read ({exc.strerror})"))
            return None
        return os.fdopen(opened, "rb")

    def holds_object(self, path: bytes, text: bytes) -> bool:
        """Whether the tracked file is the content the LFS pointer text names (sha256, size)."""
        oid, size = parse_lfs_pointer(text) or ("", -1)
        info = self.lstat(path)
        handle = self.open_file(path, info, bool(info and info.st_mode & stat.S_IXUSR), [])
        if handle is None:
            return False
        digest, seen = hashlib.sha256(), 0
        with handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
                seen += len(chunk)
        return seen == size and digest.hexdigest() == oid

    def close(self) -> None:
        for fd in self.dirs.values():
            if fd is not None:
                os.close(fd)
        os.close(self.fd)


def _kind(info: os.stat_result) -> str:
    mode = info.st_mode
    return ("a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else
            "a file" if stat.S_ISREG(mode) else "a special file")


def _last(stderr: bytes) -> str:
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return (lines or ["?"])[-1][:200]

