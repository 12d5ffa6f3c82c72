"""No repository can make the cache write outside its root through a submodule
path (DESIGN invariant 12), and a commit's submodules are bounded (issue #19).

The hostile trees are written object by object (`git mktree`), as an attacker
would push them, and served by a real `git daemon`."""

from __future__ import annotations

import os
import subprocess

import pytest

from checkoutcache.store import beneath

from .helpers import Upstream, git, run_cli
from .helpers.repos import GIT_ENV


def raw_git(repo: str, *args: str, data: bytes = b"") -> bytes:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_ENV)
    return subprocess.run(["git", "-C", repo, *args], input=data, env=env, check=True,
                          capture_output=True).stdout.strip()


def blob(repo: str, data: bytes) -> str:
    return raw_git(repo, "hash-object", "-w", "--stdin", data=data).decode()


def tree(repo: str, entries: list[tuple[str, str, bytes]]) -> str:
    """A tree of (mode, oid, name) entries, written as they are: duplicates and odd names included."""
    kinds = {"100644": "blob", "120000": "blob", "160000": "commit", "040000": "tree"}
    text = b"".join(f"{mode} {kinds[mode]} {oid}\t".encode() + name + b"\0" for mode, oid, name in entries)
    return raw_git(repo, "mktree", "-z", "--missing", data=text).decode()


def literal_tree(repo: str, entries: list[tuple[str, str, bytes]]) -> str:
    """A tree with its entries in the order given (git sorts them; an attacker need not)."""
    data = b"".join(mode.lstrip("0").encode() + b" " + name + b"\0" + bytes.fromhex(oid) for mode, oid, name in entries)
    return raw_git(repo, "hash-object", "-w", "-t", "tree", "--literally", "--stdin", data=data).decode()


def commit_tree(repo: str, tree_id: str) -> str:
    sha = raw_git(repo, "commit-tree", tree_id, "-m", "hostile").decode()
    raw_git(repo, "update-ref", "refs/heads/main", sha)
    return sha


def gitmodules(repo: str, entries: list[tuple[bytes, str]]) -> str:
    text = b"".join(b'[submodule "s%d"]\n\tpath = ' % n + path + b"\n\turl = " + url.encode() + b"\n"
                    for n, (path, url) in enumerate(entries))
    return blob(repo, text)


def served(daemon, name: str) -> tuple[Upstream, str]:
    repo = Upstream(os.path.join(daemon.base, f"{name}-{os.urandom(3).hex()}"))
    return repo, daemon.url(os.path.basename(repo.path))


@pytest.fixture
def outside(tmp_path) -> str:
    """A directory outside the root that a hostile repository aims at; it must stay empty."""
    path = tmp_path / "outside"
    path.mkdir()
    return str(path)


def assert_nothing_written(outside: str) -> None:
    assert os.listdir(outside) == []


# Both layers: git's fsck refuses the malformed trees at the fetch (the default), and with it
# off (CHECKOUTCACHE_FSCK=off) our own path handling still writes nothing outside.
FSCK = pytest.mark.parametrize("fsck", ["on", "off"])


def expect_refused_or_safe(code: int, answer: dict, fsck: str) -> bool:
    """True when the commit was made (fsck off: then the caller checks the tree)."""
    if fsck == "on":
        assert code == 1 and "duplicateEntries" in answer["message"], answer
        return False
    if code != 0:
        assert answer["error"] == "SUBMODULE_FAILED", answer
    return code == 0


@FSCK
def test_a_submodule_path_through_another_submodules_symlink_writes_nothing_outside(root, daemon, outside, fsck):
    """The superproject names a gitlink `a` and a tree `a/` holding gitlink `a/b/c`; submodule
    `a` checks out a symlink `b` pointing outside. Once, `a/b/c` was written through it."""
    inner, inner_url = served(daemon, "inner")
    inner_sha = inner.commit({"f.txt": "hi\n"})
    linker, _ = served(daemon, "linker")
    linker_sha = linker.commit({}, symlinks={"b": outside})
    top, top_url = served(daemon, "top")
    b_tree = tree(top.path, [("160000", inner_sha, b"c")])
    a_tree = tree(top.path, [("040000", b_tree, b"b")])
    modules = gitmodules(top.path, [(b"a", f"../{os.path.basename(linker.path)}"),
                                    (b"a/b/c", f"../{os.path.basename(inner.path)}")])
    sha = commit_tree(top.path, tree(top.path, [("100644", modules, b".gitmodules"),
                                                ("160000", linker_sha, b"a"), ("040000", a_tree, b"a")]))
    code, answer, err = run_cli("ensure", top_url, sha, "--wait", "120", root=root, env={"CHECKOUTCACHE_FSCK": fsck})
    assert_nothing_written(outside)
    if expect_refused_or_safe(code, answer, fsck):  # git's index kept the tree `a/`: a plain directory
        assert answer["submodules"] == "included"
        assert open(os.path.join(answer["path"], "a", "b", "c", "f.txt")).read() == "hi\n"
        assert not os.path.islink(os.path.join(answer["path"], "a", "b"))


@FSCK
def test_a_nested_submodule_behind_a_symlink_of_its_parent_fails_the_commit(root, daemon, outside, fsck):
    """A submodule whose own tree holds a tree `b/` (with gitlink `b/c`) and then a symlink
    `b` pointing outside: git's index keeps the symlink, `ls-tree` also lists `b/c`. The
    superproject passes fsck; only the submodule, on the attacker's server, is malformed."""
    inner, _ = served(daemon, "inner")
    inner_sha = inner.commit({"f.txt": "hi\n"})
    middle, _ = served(daemon, "middle")
    link = blob(middle.path, outside.encode())
    modules = gitmodules(middle.path, [(b"b/c", f"../{os.path.basename(inner.path)}")])
    b_tree = tree(middle.path, [("160000", inner_sha, b"c")])
    middle_sha = commit_tree(middle.path, literal_tree(middle.path, [
        ("100644", modules, b".gitmodules"), ("040000", b_tree, b"b"), ("120000", link, b"b")]))
    top, top_url = served(daemon, "top")
    top_modules = gitmodules(top.path, [(b"m", f"../{os.path.basename(middle.path)}")])
    sha = commit_tree(top.path, tree(top.path, [("100644", top_modules, b".gitmodules"),
                                                ("160000", middle_sha, b"m")]))
    git("fsck", cwd=top.path)  # the superproject itself is well-formed
    code, answer, err = run_cli("ensure", top_url, sha, "--wait", "120", root=root, env={"CHECKOUTCACHE_FSCK": fsck})
    assert_nothing_written(outside)
    if expect_refused_or_safe(code, answer, fsck):  # the index of `m` holds the symlink only
        assert os.path.islink(os.path.join(answer["path"], "m", "b"))


def test_beneath_refuses_symlinks_dotdot_and_absolute_paths(tmp_path):
    top = tmp_path / "top"
    (top / "real" / "dir").mkdir(parents=True)
    (top / "link").symlink_to(tmp_path)
    (top / "file").write_text("x")
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for walk in (None, False):  # openat2 where the kernel has it, then the O_NOFOLLOW walk
            beneath.use_openat2(walk)
            inner = beneath.open_dir_beneath(fd, b"real/dir")
            os.close(inner)
            made = beneath.open_dir_beneath(fd, b"real/new/deeper", create=True)
            os.close(made)
            assert (top / "real" / "new" / "deeper").is_dir()
            for bad, why in ((b"link/x", "symlink"), (b"link", "symlink"), (b"file/x", "not a directory"),
                             (b"../x", "'..'"), (b"/etc", "absolute"), (b"a//b", "empty"), (b"a\0b", "NUL")):
                with pytest.raises(beneath.Escape, match=why):
                    beneath.open_dir_beneath(fd, bad, create=True)
            assert not (tmp_path / "x").exists()
    finally:
        beneath.use_openat2(None)
        os.close(fd)


@pytest.mark.slow
def test_a_submodule_path_that_is_not_utf8_is_checked_out_at_its_own_bytes(root, daemon):
    inner, _ = served(daemon, "inner")
    inner_sha = inner.commit({"f.txt": "content\n"})
    top, top_url = served(daemon, "top")
    name = b"lib-\xe9\x80"
    modules = gitmodules(top.path, [(name, f"../{os.path.basename(inner.path)}")])
    sha = commit_tree(top.path, tree(top.path, [("100644", modules, b".gitmodules"), ("160000", inner_sha, name)]))
    code, answer, err = run_cli("ensure", top_url, sha, "--wait", "120", root=root)
    assert code == 0, (answer, err)
    at = os.path.join(os.fsencode(answer["path"]), name)
    assert open(os.path.join(at, b"f.txt"), "rb").read() == b"content\n"
    assert [n for n in os.listdir(os.fsencode(answer["path"])) if n.startswith(b"lib-")] == [name]
    code, report, _ = run_cli("verify", top_url, sha, root=root)
    assert code == 0 and report["broken"] == 0
    # A .gitmodules git itself cannot parse (bytes 0xff 0xfe in a value): the commit fails, saying so.
    bad = blob(top.path, b'[submodule "s0"]\n\tpath = lib-\xff\xfe\n\turl = ../x\n')
    broken = commit_tree(top.path, tree(top.path, [("100644", bad, b".gitmodules"),
                                                   ("160000", inner_sha, b"lib-\xff\xfe")]))
    code, answer, _ = run_cli("ensure", top_url, broken, "--wait", "120", root=root)
    assert code == 1 and answer["error"] == "CLONE_FAILED" and ".gitmodules cannot be read" in answer["message"]


def fan_out(daemon, width: int, depth: int) -> tuple[str, str]:
    """A repository whose commit has `width` submodules at each of `depth` levels (all one leaf repository)."""
    leaf, _ = served(daemon, "leaf")
    below = leaf.commit({"leaf.txt": "x" * 1000})
    below_name = os.path.basename(leaf.path)
    for level in range(depth):
        repo, url = served(daemon, f"level{level}")
        modules = gitmodules(repo.path, [(f"s{n}".encode(), f"../{below_name}") for n in range(width)])
        below = commit_tree(repo.path, tree(repo.path, [("100644", modules, b".gitmodules")]
                                            + [("160000", below, f"s{n}".encode()) for n in range(width)]))
        below_name = os.path.basename(repo.path)
    return url, below


@pytest.mark.slow
def test_a_fan_out_of_submodules_is_bounded_per_commit(root, daemon):
    url, sha = fan_out(daemon, width=4, depth=2)  # 4 + 16 nested checkouts
    code, answer, _ = run_cli("ensure", url, sha, "--wait", "120", root=root + "-few",
                              env={"CHECKOUTCACHE_MAX_SUBMODULES": "10"})
    assert code == 1 and answer["error"] == "SUBMODULE_FAILED", answer
    assert "more than 10 submodule checkouts" in answer["message"] and "CHECKOUTCACHE_MAX_SUBMODULES" in answer["message"]
    code, answer, _ = run_cli("ensure", url, sha, "--wait", "120", root=root + "-small",
                              env={"CHECKOUTCACHE_MAX_SUBMODULE_BYTES": "20K"})
    assert code == 1 and "CHECKOUTCACHE_MAX_SUBMODULE_BYTES" in answer["message"], answer
    code, answer, err = run_cli("ensure", url, sha, "--wait", "120", root=root)
    assert code == 0, (answer, err)
    assert os.path.isfile(os.path.join(answer["path"], "s3", "s2", "leaf.txt"))


def test_submodule_commits_are_made_ready_in_the_superprojects_worker(root, daemon):
    """No Python start per submodule: the submodule's clone log names the superproject worker's pid."""
    url, sha = fan_out(daemon, width=2, depth=1)
    code, answer, err = run_cli("ensure", url, sha, "--wait", "120", root=root)
    assert code == 0, (answer, err)
    pids = set()
    for key in os.listdir(os.path.join(root, "repos")):
        logs = os.path.join(root, "repos", key, "logs")
        for name in os.listdir(logs):
            for line in open(os.path.join(logs, name)):
                if " clone of " in line:
                    pids.add(line.rsplit(" by pid ", 1)[1].split()[0])
    assert len(pids) == 1, pids  # the superproject's clone and the leaf's, in one process


@pytest.mark.slow
def test_a_chain_of_submodules_deeper_than_the_bound_fails(root, daemon):
    """Each level a distinct commit of one repository, whose submodule is the level below:
    bounded across the clones run inline, not only within one tree."""
    top, top_url = served(daemon, "chain")
    sha = top.commit({"README.md": "bottom\n"})
    for _level in range(10):
        modules = gitmodules(top.path, [(b"down", f"../{os.path.basename(top.path)}")])
        sha = commit_tree(top.path, tree(top.path, [("100644", modules, b".gitmodules"), ("160000", sha, b"down")]))
    code, answer, err = run_cli("ensure", top_url, sha, "--wait", "120", root=root)
    assert code == 1 and answer["error"] == "SUBMODULE_FAILED", (answer, err)
    assert "nested deeper than 8 levels" in answer["message"]
