"""Hostile repositories and what reviews leave in their checkouts: whatever a
tree holds, gc removes it (or says precisely what it could not remove and
why) and goes on with the rest of its run."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from checkoutcache.store.checkouts import remove_tree

from .helpers import GIT_ENV, git, run_cli, wait_ready

pytestmark = pytest.mark.faults


@pytest.fixture(autouse=True)
def leave_no_deep_tree(tmp_path):
    """pytest's own cleanup recurses: whatever a failing run leaves is removed here."""
    yield
    remove_tree(str(tmp_path))

DEPTH = 1200
MANY = 100_000


def fast_import(path: str, files: list[str], message: str = "hostile") -> str:
    """A commit on main holding `files` (all one small blob), made by git fast-import."""
    git("init", "-q", "-b", "main", path)
    lines = [b"blob", b"mark :1", b"data 2", b"x\n", b"commit refs/heads/main", b"mark :2",
             b"committer Test <test@example.invalid> 0 +0000", b"data %d" % len(message), message.encode()]
    lines += [b"M 100644 :1 " + name.encode() for name in files]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_ENV)
    subprocess.run(["git", "fast-import", "--quiet"], input=b"\n".join(lines) + b"\n", cwd=path, env=env,
                   check=True, capture_output=True)
    return git("rev-parse", "main", cwd=path)


def age(checkout: str, seconds_ago: float) -> None:
    then = os.stat(checkout).st_mtime - seconds_ago
    os.utime(os.path.join(checkout, ".git", "checkoutcache-ready"), (then, then))


def without_dac_override() -> list[str]:
    """As root, drop the capabilities that ignore file modes, so read-only directories bite as they
    do for a gc running as an ordinary user."""
    if os.geteuid() == 0 and shutil.which("setpriv"):
        return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
    return []


def gc(root: str, *args: str) -> tuple[int, dict | None, str]:
    cmd = without_dac_override() + [sys.executable, "-m", "checkoutcache", "--root", root, "gc", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        return done.returncode, json.loads(done.stdout), done.stderr
    except ValueError:
        return done.returncode, None, done.stderr + done.stdout


def review_writes_hostile_things(checkout: str, deep: bool) -> None:
    """What a review (a Go build, a test suite, an attacker) may leave in a checkout."""
    os.makedirs(os.path.join(checkout, "gomod", "pkg@v1", "sub"))
    with open(os.path.join(checkout, "gomod", "pkg@v1", "sub", "go.mod"), "w") as handle:
        handle.write("module x\n")
    os.chmod(os.path.join(checkout, "gomod", "pkg@v1", "sub", "go.mod"), 0o444)
    for directory in ("gomod/pkg@v1/sub", "gomod/pkg@v1", "gomod"):
        os.chmod(os.path.join(checkout, directory), 0o555)
    os.makedirs(os.path.join(checkout, "sealed", "inner"))
    os.chmod(os.path.join(checkout, "sealed"), 0o000)
    if deep:
        os.chmod(os.path.join(checkout, *["a"] * 600), 0o555)  # read-only in the middle of the deep chain
    os.mkfifo(os.path.join(checkout, "fifo"))
    here = os.getcwd()
    os.chdir(checkout)
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind("sock")
        sock.close()
    finally:
        os.chdir(here)
    os.symlink("loop", os.path.join(checkout, "loop"))
    os.symlink("loop-b", os.path.join(checkout, "loop-a"))
    os.symlink("loop-a", os.path.join(checkout, "loop-b"))
    os.symlink("/etc", os.path.join(checkout, "outside"))
    with open(os.path.join(checkout, "new\nline"), "w") as handle:
        handle.write("n")
    with open(os.fsencode(checkout) + b"/not-utf8-\xff\xfe", "w") as handle:
        handle.write("b")


def trash_of(root: str) -> dict[str, list[str]]:
    repos = os.path.join(root, "repos")
    return {key: os.listdir(os.path.join(repos, key, "trash")) for key in os.listdir(repos)}


@pytest.mark.parametrize("deep", [True, False], ids=["deep-and-many", "read-only-only"])
@pytest.mark.slow
def test_gc_removes_any_tree_and_goes_on(root, tmp_path, upstream, deep):
    hostile = str(tmp_path / "hostile")
    files = ["top.txt"]
    if deep:
        files += ["/".join(["a"] * DEPTH) + "/deep.txt"]
        files += [f"many/d{n // 1000:03d}/f{n % 1000:03d}" for n in range(MANY)]
    sha = fast_import(hostile, files)
    victim = wait_ready(root, hostile, sha, timeout=300)["path"]
    other = wait_ready(root, upstream.path, upstream.shas[0])["path"]
    review_writes_hostile_things(victim, deep)
    age(victim, 7200)
    age(other, 3600)  # evicted after the hostile one, in the same run

    # (no spares: the trees are deleted, what this test is about)
    code, report, err = gc(root, "--max-checkouts", "0", "--grace", "0", "--max-spares", "0")
    assert code == 0, err
    removed = {r["name"]: r for r in report["removed"]}
    assert sha in removed and upstream.shas[0] in removed, report
    assert report["unremovable"] == []
    assert not os.path.lexists(victim) and not os.path.lexists(other)
    assert all(names == [] for names in trash_of(root).values()), trash_of(root)
    if deep:
        assert removed[sha]["bytes"] > MANY * 512  # what was really freed
    assert os.path.isdir("/etc")
    # The store goes on working: the commit is made again and gc runs clean.
    assert wait_ready(root, upstream.path, upstream.shas[0])["path"] == other
    assert gc(root)[0] == 0


@pytest.mark.slow
def test_what_gc_cannot_remove_is_reported_retried_and_does_not_stop_it(root, tmp_path, upstream):
    victim = wait_ready(root, upstream.path, upstream.shas[1])["path"]
    age(victim, 3600)
    base = os.path.dirname(os.path.dirname(victim))
    key = os.path.basename(base)
    source = tmp_path / "mounted-elsewhere"
    source.mkdir()
    (source / "precious").write_text("not ours")
    point = os.path.join(base, "trash", "evicted-stuck", "mnt")
    os.makedirs(point)
    mounted = subprocess.run(["mount", "--bind", str(source), point], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"bind mounts are not permitted here ({mounted.stderr.strip()}): the EBUSY case is untested")
    try:
        code, report, err = gc(root, "--max-checkouts", "0", "--grace", "0")
        assert code == 0, err
        assert report["unremovable"] == [{"repo": key, "path": f"repos/{key}/trash/evicted-stuck/mnt",
                                          "error": "EBUSY", "entry": "evicted-stuck"}]
        assert (source / "precious").read_text() == "not ours"  # never deleted through the mount
        assert upstream.shas[1] in [r["name"] for r in report["removed"]]  # the rest of the run went on
        assert not os.path.lexists(victim)
        code, status, _ = run_cli("status", root=root)
        (repo,) = status["repos"]
        assert [(s["path"], s["error"]) for s in repo["stuck_in_trash"]] == \
            [(f"repos/{key}/trash/evicted-stuck/mnt", "EBUSY")]
        assert gc(root)[1]["unremovable"][0]["error"] == "EBUSY"  # retried, still stuck
    finally:
        subprocess.run(["umount", point], check=False)
    code, report, _ = gc(root)
    assert code == 0 and report["unremovable"] == []
    assert trash_of(root) == {key: []}
    assert run_cli("status", root=root)[1]["repos"][0]["stuck_in_trash"] == []


@pytest.mark.slow
def test_a_checkout_that_cannot_be_moved_does_not_stop_gc(root, tmp_path, upstream):
    stuck = wait_ready(root, upstream.path, upstream.shas[0])["path"]
    other_repo = tmp_path / "other"
    other_repo.mkdir()
    git("init", "-q", "-b", "main", str(other_repo))
    (other_repo / "f").write_text("x")
    git("add", "-A", cwd=str(other_repo))
    git("-c", "user.name=T", "-c", "user.email=t@e.invalid", "commit", "-q", "-m", "one", cwd=str(other_repo))
    other_sha = git("rev-parse", "HEAD", cwd=str(other_repo))
    other = wait_ready(root, str(other_repo), other_sha)["path"]
    age(stuck, 7200)
    age(other, 3600)
    mounted = subprocess.run(["mount", "--bind", stuck, stuck], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"bind mounts are not permitted here ({mounted.stderr.strip()}): the EBUSY case is untested")
    try:
        code, report, err = gc(root, "--max-checkouts", "0", "--grace", "0")
        assert code == 0, err
        assert [(u["path"], u["error"]) for u in report["unremovable"]] == \
            [(os.path.relpath(stuck, root), "EBUSY")]
        assert [r["name"] for r in report["removed"]] == [other_sha]  # the rest of the run went on
        assert os.path.isdir(stuck) and not os.path.exists(other)
        os.unlink(os.path.join(stuck, "README.md"))  # now damaged: gc's tidying moves it aside, or tries to
        code, report, err = gc(root)
        assert code == 0, err
        assert [(u["path"], u["error"]) for u in report["unremovable"]] == \
            [(os.path.relpath(stuck, root), "EBUSY")]
    finally:
        subprocess.run(["umount", stuck], check=False)
    code, report, _ = gc(root, "--max-checkouts", "0", "--grace", "0")
    assert code == 0 and [(r["name"], r["reason"]) for r in report["removed"]] == [(upstream.shas[0], "damaged")]


def test_a_tree_of_awkward_names_is_checked_out_whole(root, tmp_path):
    """The check that every path git listed is on disk (git/cli.py) reads names as
    bytes: a name that is not UTF-8, has a newline or a tab, or a dangling symlink is
    no reason to fail a clone."""
    path = str(tmp_path / "awkward")
    git("init", "-q", "-b", "main", path)
    names = [b'"new\\nline"', b'"tab\\there"', b"not-utf8-\xff\xfe", b"quote\"d", b"sp ace/inner file"]
    lines = [b"blob", b"mark :1", b"data 2", b"x\n", b"blob", b"mark :2", b"data 7", b"missing",
             b"commit refs/heads/main", b"mark :3", b"committer Test <test@example.invalid> 0 +0000", b"data 7",
             b"awkward"]
    lines += [b"M 100644 :1 " + name for name in names]
    lines += [b"M 120000 :2 dangling-link"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_ENV)
    subprocess.run(["git", "fast-import", "--quiet"], input=b"\n".join(lines) + b"\n", cwd=path, env=env,
                   check=True, capture_output=True)
    sha = git("rev-parse", "main", cwd=path)
    for transport in ("cli", "pygit2"):
        answer = wait_ready(os.path.join(root, transport), path, sha, env={"CHECKOUTCACHE_TRANSPORT": transport})
        on_disk = set(os.listdir(os.fsencode(answer["path"])))
        assert {b"new\nline", b"tab\there", b"not-utf8-\xff\xfe", b'quote"d', b"sp ace", b"dangling-link"} <= on_disk
        assert os.readlink(os.path.join(answer["path"], "dangling-link")) == "missing"


def test_a_path_near_path_max_is_checked_out(root, tmp_path):
    """Regression (found by review): the completeness check tested the absolute path, over
    PATH_MAX for a file git had written fine relative to the tree: the clone failed."""
    path = str(tmp_path / "long")
    long_name = "/".join(["d" * 250] * 15 + ["f" * 200])  # 3965 bytes relative, > 4096 absolute
    sha = fast_import(path, [long_name])
    answer = wait_ready(root, path, sha)
    assert len(os.fsencode(answer["path"])) + 1 + len(long_name) > 4096
    assert git("ls-files", "--deleted", cwd=answer["path"]) == ""
    assert git("ls-files", cwd=answer["path"]) == long_name
