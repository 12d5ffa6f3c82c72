"""Recycled trees (clone/tree.py, store/spares.py): an evicted checkout kept as a spare and
updated in place into a later commit's checkout is exact (DESIGN invariant 1) whatever a
reader did to it, and a SIGKILL at any step of the update or of gc's sparing leaves a store
that recovers by itself."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from checkoutcache.store.layout import RepoPaths

from .helpers import (
    Upstream,
    assert_checkout_matches,
    git,
    make_idle,
    only_repo,
    pid_alive,
    run_cli,
    settled,
    wait_ready,
    wait_until,
)
from .helpers.store import checkout_tree


@pytest.fixture
def project(tmp_path) -> Upstream:
    """Two commits A, B: B changes one file, adds one, deletes one; the rest is shared."""
    repo = Upstream(str(tmp_path / "project"))
    files = {f"pkg/m{i}/f{j}.txt": f"file {i}/{j}\n" for i in range(6) for j in range(5)}
    repo.commit({**files, ".gitignore": "*.log\nbuild/\n", "README.md": "# project\n", "old.txt": "old\n",
                 "bin/run.sh": "#!/bin/sh\necho run\n", "doc/guide.md": "guide\n"},
                symlinks={"link": "README.md", "dirlink": "pkg"}, executable=("bin/run.sh",), message="A")
    os.unlink(os.path.join(repo.path, "old.txt"))
    repo.commit({"pkg/m0/f0.txt": "changed in B\n", "new.txt": "new in B\n"}, message="B")
    return repo


def spare_entries(root: str) -> list[str]:
    store = only_repo(root)
    return [entry for entry, _ in store.spare_entries()]


def evict_to_spare(root: str, checkout: str) -> str:
    """gc evicts the checkout (max-checkouts 0) and keeps its tree as a spare; its path."""
    make_idle(checkout, 3600)
    code, report, out = run_cli("gc", "--max-checkouts", "0", root=root)
    assert code == 0, out
    assert [r for r in report["removed"] if r["spare"]], report
    assert not os.path.exists(checkout)
    (entry,) = spare_entries(root)
    return RepoPaths.spare_tree(only_repo(root).spare_entry(entry))


def assert_recycled(root: str, project: Upstream, sha: str) -> dict:
    """The next commit is made from the spare (its log says so) and is exact."""
    answer = wait_ready(root, project.path, sha)
    assert_checkout_matches(answer["path"], project.path, sha)
    log = open(only_repo(root).clone_log(sha)).read()
    assert "updated the spare of" in log, log
    assert spare_entries(root) == []
    return answer


def test_a_new_commit_is_made_from_a_spare(root, project):
    a, b = project.shas
    first = wait_ready(root, project.path, a)["path"]
    evict_to_spare(root, first)
    code, status, _ = run_cli("status", root=root)
    (repo,) = status["repos"]
    assert [s["commit"] for s in repo["spares"]] == [a]
    # The spare's commit keeps its history in the mirror (a nearby commit needs little fetched).
    store = only_repo(root)
    assert git("for-each-ref", "--format=%(refname)", "refs/spares/", cwd=store.mirror) == f"refs/spares/{a}"
    answer = assert_recycled(root, project, b)
    assert answer["path"] != first
    run_cli("gc", root=root)  # the spare is gone (it became b's checkout): so is its ref
    assert git("for-each-ref", "--format=%(refname)", "refs/spares/", cwd=store.mirror) == ""


def test_max_spares_zero_deletes_evicted_trees(root, project):
    first = wait_ready(root, project.path, project.shas[0])["path"]
    make_idle(first, 3600)
    code, report, _ = run_cli("gc", "--max-checkouts", "0", "--max-spares", "0", root=root)
    assert code == 0 and report["removed"] and not any(r["spare"] for r in report["removed"])
    assert spare_entries(root) == []


def test_spares_go_first_when_space_is_short(root, project):
    checkouts = [wait_ready(root, project.path, sha)["path"] for sha in project.shas]
    for checkout in checkouts:
        make_idle(checkout, 3600)
    code, report, out = run_cli("gc", "--max-checkouts", "0", root=root)
    assert code == 0 and len(spare_entries(root)) == 2, out
    code, status, _ = run_cli("status", root=root)
    assert status["totals"]["spares"] == 2 and status["totals"]["spare_bytes"] > 0
    # Room for one spare's bytes only: the oldest goes first, and the report says why.
    allowed = status["totals"]["spare_bytes"] - 1
    code, report, out = run_cli("gc", "--max-bytes", f"{allowed}B", root=root)
    assert code == 0, out
    assert [(r["reason"], r["limit"]) for r in report["removed"]] == [("spare", "max-bytes")], report
    assert len(spare_entries(root)) == 1
    # A new checkout that needs the room: the last spare goes before it would be kept.
    code, report, out = run_cli("gc", "--max-bytes", "1B", root=root)
    assert code == 0 and spare_entries(root) == [], out


def tamper_modified(tree, outside):
    with open(os.path.join(tree, "pkg/m1/f1.txt"), "w") as handle:
        handle.write("a reader's edit\n")


def tamper_same_size_and_mtime(tree, outside):
    path = os.path.join(tree, "pkg/m1/f2.txt")
    before = os.stat(path)
    with open(path, "r+") as handle:
        handle.write("F")  # same size: "file 1/2\n" -> "File 1/2\n"
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def tamper_added_ignored_untracked(tree, outside):
    for rel in ("notes.txt", "pkg/m2/extra.txt", "build/out.o", "debug.log", "newdir/deep/x"):
        os.makedirs(os.path.dirname(os.path.join(tree, rel)), exist_ok=True)
        with open(os.path.join(tree, rel), "w") as handle:
            handle.write("junk\n")
    # Empty directories: git's status never shows one, a fresh checkout never has one.
    os.makedirs(os.path.join(tree, "emptydir", "inner"))
    os.mkdir(os.path.join(tree, "pkg", "m2", "empty"))


def tamper_deleted(tree, outside):
    os.unlink(os.path.join(tree, "pkg/m2/f3.txt"))
    shutil.rmtree(os.path.join(tree, "pkg/m3"))  # (a top-level name gone makes it damaged: gc deletes it)


def tamper_modes(tree, outside):
    os.chmod(os.path.join(tree, "pkg/m4/f4.txt"), 0o755)
    os.chmod(os.path.join(tree, "bin/run.sh"), 0o644)
    os.chmod(os.path.join(tree, "pkg/m5"), 0o700)


def tamper_symlinks_swapped(tree, outside):
    link = os.path.join(tree, "link")
    os.unlink(link)
    with open(link, "w") as handle:
        handle.write("README.md")  # a file holding the link's own target text
    readme = os.path.join(tree, "README.md")
    os.unlink(readme)
    os.symlink(os.path.join(outside, "victim.txt"), readme)


def tamper_directory_swapped_for_symlink(tree, outside):
    shutil.rmtree(os.path.join(tree, "pkg/m2"))
    os.symlink(outside, os.path.join(tree, "pkg/m2"))


def tamper_nested_git(tree, outside):
    nested = os.path.join(tree, "pkg/m1/.git")
    os.makedirs(nested)
    with open(os.path.join(nested, "config"), "w") as handle:
        handle.write(f"[core]\n\tfsmonitor = touch {outside}/pwned\n")


def tamper_git_dir(tree, outside):
    with open(os.path.join(tree, ".git/config"), "a") as handle:
        handle.write(f"[core]\n\tfsmonitor = touch {outside}/pwned\n\ttrustctime = false\n")
    with open(os.path.join(tree, ".git/info/exclude") if os.path.isdir(os.path.join(tree, ".git/info"))
              else os.path.join(tree, ".git/exclude-planted"), "w") as handle:
        handle.write("*.txt\n")
    hooks = os.path.join(tree, ".git/hooks")
    os.makedirs(hooks, exist_ok=True)
    with open(os.path.join(hooks, "post-checkout"), "w") as handle:
        handle.write(f"#!/bin/sh\ntouch {outside}/pwned\n")
    os.chmod(os.path.join(hooks, "post-checkout"), 0o755)


def tamper_index(tree, outside):
    # A reader's own `git add` rewrites the index: its stat data would vouch for the edit.
    with open(os.path.join(tree, "pkg/m0/f1.txt"), "w") as handle:
        handle.write("staged by a reader\n")
    git("add", "pkg/m0/f1.txt", cwd=tree)


def tamper_symlink_where_the_next_commit_adds_a_file(tree, outside):
    # B adds new.txt: git must replace the link, never write through it (nothing deletes it first).
    os.symlink(os.path.join(outside, "victim.txt"), os.path.join(tree, "new.txt"))


def tamper_directory_where_the_next_commit_adds_a_file(tree, outside):
    os.makedirs(os.path.join(tree, "new.txt", "deep"))
    with open(os.path.join(tree, "new.txt", "deep", "x.log"), "w") as handle:
        handle.write("ignored, in the way\n")


def tamper_tracked_directory_moved_and_symlinked(tree, outside):
    # Its files keep their inode and ctime through the rename: read-tree's lstat through the
    # link finds every stat as indexed, so only deleting the (untracked) link first saves it.
    os.rename(os.path.join(tree, "pkg/m1"), os.path.join(tree, ".hidden"))
    os.symlink("../.hidden", os.path.join(tree, "pkg/m1"))
    elsewhere = os.path.join(os.path.dirname(outside), "elsewhere")
    os.rename(os.path.join(tree, "pkg/m2"), elsewhere)  # out of the tree, on the same file system
    os.symlink(elsewhere, os.path.join(tree, "pkg/m2"))


def tamper_gitattributes_planted(tree, outside):
    # git reads a .gitattributes its index lacks from the work tree: every file the update
    # writes would get CRLF line ends, and the planted files then deleted.
    for where in ("", "pkg/m2", "pkg/m0"):
        with open(os.path.join(tree, where, ".gitattributes"), "w") as handle:
            handle.write("* text eol=crlf\n")
    os.utime(os.path.join(tree, "pkg/m2/f1.txt"))  # a stat that differs: written again


def tamper_fifo_and_socket(tree, outside):
    os.mkfifo(os.path.join(tree, "pkg/m0/fifo"))  # a later reader's open would block on it
    os.mknod(os.path.join(tree, "pkg/m0/sock"), stat.S_IFSOCK | 0o644)


def tamper_nested_repository_whose_head_is_a_fifo(tree, outside):
    # git reads a nested repository's HEAD to tell it is one: a fifo there blocked the listing
    # (and the worker) until the clone timeout.
    os.makedirs(os.path.join(tree, "junk", ".git"))
    os.mkfifo(os.path.join(tree, "junk", ".git", "HEAD"))
    elsewhere = os.path.join(os.path.dirname(outside), "gitdir")
    os.makedirs(elsewhere)
    os.mkfifo(os.path.join(elsewhere, "HEAD"))
    os.makedirs(os.path.join(tree, "junk2"))
    with open(os.path.join(tree, "junk2", ".git"), "w") as handle:
        handle.write(f"gitdir: {elsewhere}\n")


def tamper_mode_and_hard_link_at_once(tree, outside):
    # Right after the checkout, within its second: git's stat compares ctime to the second, so
    # its check alone took both files as unchanged (a world-writable file; one whose inode a
    # file outside the tree shares).
    os.chmod(os.path.join(tree, "pkg/m3/f1.txt"), 0o666)
    os.link(os.path.join(tree, "pkg/m3/f2.txt"), os.path.join(os.path.dirname(outside), "linked"))


def tamper_default_acl(tree, outside):
    # A default ACL granting everyone rwx: every file git then writes there would be 0666,
    # whatever the umask; the directory's mode bits do not change.
    import struct

    undefined = 0xFFFFFFFF
    acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, 7, undefined) for tag in (0x01, 0x04, 0x20))
    for where in ("pkg/m0", "pkg"):
        os.setxattr(os.path.join(tree, where), "system.posix_acl_default", acl)
    os.utime(os.path.join(tree, "pkg/m0/f2.txt"))  # written again by the update, in that directory


TAMPERING = [tamper_modified, tamper_same_size_and_mtime, tamper_added_ignored_untracked, tamper_deleted,
             tamper_modes, tamper_symlinks_swapped, tamper_directory_swapped_for_symlink, tamper_nested_git,
             tamper_git_dir, tamper_index, tamper_symlink_where_the_next_commit_adds_a_file,
             tamper_directory_where_the_next_commit_adds_a_file, tamper_tracked_directory_moved_and_symlinked,
             tamper_gitattributes_planted, tamper_fifo_and_socket, tamper_nested_repository_whose_head_is_a_fifo,
             tamper_mode_and_hard_link_at_once, tamper_default_acl]


@pytest.mark.slow
@pytest.mark.parametrize("tamper", TAMPERING, ids=lambda t: t.__name__[len("tamper_"):])
def test_a_recycled_tree_is_exact_whatever_a_reader_did(root, project, tamper, tmp_path):
    a, b = project.shas
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("outside the store\n")
    checkout = wait_ready(root, project.path, a)["path"]
    tamper(checkout, str(outside))  # a reader of A, before gc evicts it
    evict_to_spare(root, checkout)
    answer = wait_ready(root, project.path, b)
    assert_checkout_matches(answer["path"], project.path, b)
    log = open(only_repo(root).clone_log(b)).read()
    if tamper is tamper_index:
        assert "its index changed since it was published" in log and "updated the spare" not in log, log
    else:
        assert "updated the spare of" in log, log
    # Directory modes as a fresh checkout has them; nothing outside touched; no nested .git.
    modes = {stat.S_IMODE(os.lstat(os.path.join(d, "")).st_mode) for d, _, _ in os.walk(answer["path"])
             if "/.git" not in d + "/"}
    assert len(modes) == 1, modes
    assert sorted(os.listdir(outside)) == ["victim.txt"]
    assert (outside / "victim.txt").read_text() == "outside the store\n"
    assert git("--no-optional-locks", "status", "--porcelain", "--ignored", "--untracked-files=all",
               cwd=answer["path"]) == ""
    # What status never shows: an empty directory (a fresh checkout has none), a fifo, a socket.
    empty = [d for d, dirs, files in os.walk(answer["path"])
             if not dirs and not files and "/.git/" not in d + "/"]
    assert empty == [], empty
    odd = [os.path.join(d, n) for d, dirs, files in os.walk(answer["path"]) for n in files
           if not (stat.S_ISREG(os.lstat(os.path.join(d, n)).st_mode) or os.path.islink(os.path.join(d, n)))]
    assert odd == [], odd
    with open(os.path.join(answer["path"], "new.txt"), "rb") as handle:
        assert b"\r" not in handle.read(), "written as the commit holds it"
    # Every file as a fresh checkout writes it: its mode under the umask, an inode of its own.
    files = [os.path.join(d, n) for d, _, names in os.walk(answer["path"]) if "/.git" not in d + "/"
             for n in names if stat.S_ISREG(os.lstat(os.path.join(d, n)).st_mode)]
    assert len(files) > 30
    assert {stat.S_IMODE(os.lstat(f).st_mode) for f in files} <= {0o644, 0o755}, "modes as the umask makes them"
    assert {os.lstat(f).st_nlink for f in files} == {1}, "no file shares its inode"
    assert spare_entries(root) == []


SPARE_STEPS = ["spare-taken", "spare-old-git-removed", "spare-after-git-dir", "spare-after-leftovers",
               "spare-after-checkout", "after-rename"]


@pytest.mark.slow
@pytest.mark.parametrize("step", SPARE_STEPS)
def test_a_worker_killed_at_each_step_of_an_update(root, project, step, kill_log):
    a, b = project.shas
    checkout = wait_ready(root, project.path, a)["path"]
    tamper_modified(checkout, "")
    evict_to_spare(root, checkout)
    code, answer, out = run_cli("ensure", project.path, b, root=root, env={"CHECKOUTCACHE_TEST_KILL_AT": step})
    assert code in (0, 75) and answer["state"] in ("cloning", "ready"), out
    wait_until(lambda: os.path.exists(kill_log) and open(kill_log).read().endswith("\n"), 60,
               "the worker to reach the step")  # (the file exists before its line is written)
    (line,) = open(kill_log).read().splitlines()
    killed_step, pid = line.split()
    assert killed_step == step
    wait_until(lambda: not pid_alive(int(pid)), 10, "the killed worker to be gone")
    store = only_repo(root)
    assert spare_entries(root) == [], "the spare was taken into the worker's scratch"
    if step != "after-rename":
        assert not os.path.exists(store.ready_marker(b)), "never published"
    # gc reaps the dead worker's scratch (with the spare in it); the next ask makes B exact.
    code, report, _ = run_cli("gc", root=root)
    assert code == 0 and any(r["reason"] == "dead-scratch" for r in report["removed"]), report
    assert os.listdir(store.scratch_dir) == []
    answer = wait_ready(root, project.path, b)
    assert_checkout_matches(answer["path"], project.path, b)
    assert run_cli("verify", root=root)[0] == 0


@pytest.mark.slow
def test_gc_killed_while_making_a_spare(root, project, kill_log):
    a, b = project.shas
    checkout = wait_ready(root, project.path, a)["path"]
    settled(root)  # its history ends: no trash of its own beside gc's
    make_idle(checkout, 3600)
    code, _, _ = run_cli("gc", "--max-checkouts", "0", root=root,
                         env={"CHECKOUTCACHE_TEST_KILL_AT": "gc-after-spare-rename"})
    assert code == -9 and not os.path.exists(checkout)
    assert open(kill_log).read().split()[0] == "gc-after-spare-rename"
    store = only_repo(root)
    assert spare_entries(root) == [] and len(store.spares_in_making()) == 1, "killed before its last rename"
    code, report, _ = run_cli("gc", root=root)
    assert code == 0 and store.spares_in_making() == [] and os.listdir(store.trash_dir) == []
    answer = wait_ready(root, project.path, b)
    assert_checkout_matches(answer["path"], project.path, b)
    assert "updated the spare" not in open(store.clone_log(b)).read()


@pytest.mark.slow
def test_lfs_content_swapped_for_its_pointer_is_written_again(root, tmp_path):
    """A reader that replaced an LFS file's content with its pointer text (what git's clean
    filter would call unchanged) and one that edited another: both hold their content again."""
    from .helpers.lfs import LfsUpstream, pointer

    big, other, newer = b"large content " * 100, b"other content " * 50, b"newer content " * 70
    up = LfsUpstream(str(tmp_path / "lfs-upstream"))
    a = up.commit_lfs({"big.bin": big, "other.bin": other}, {"README": "a\n"})
    b = up.commit_lfs({"big.bin": big, "other.bin": other, "third.bin": newer}, {"README": "b\n"})
    checkout = wait_ready(root, up.path, a)["path"]
    assert open(os.path.join(checkout, "big.bin"), "rb").read() == big
    with open(os.path.join(checkout, "big.bin"), "w") as handle:
        handle.write(pointer(big))
    with open(os.path.join(checkout, "other.bin"), "wb") as handle:
        handle.write(b"edited")
    evict_to_spare(root, checkout)
    answer = wait_ready(root, up.path, b)
    assert answer["lfs"] == "content"
    assert "updated the spare of" in open(only_repo(root).clone_log(b)).read()
    for name, data in (("big.bin", big), ("other.bin", other), ("third.bin", newer)):
        assert open(os.path.join(answer["path"], name), "rb").read() == data, name
    assert git("--no-optional-locks", "status", "--porcelain", "--ignored", cwd=answer["path"]) == ""


@pytest.mark.slow
def test_a_spare_with_a_tampered_submodule_gets_it_anew(root, daemon):
    from .test_submodules import served, with_submodule

    sub, sub_url = served(daemon, "sub")
    sub_sha = sub.commit({"lib.txt": "library v1\n"})
    top, top_url = served(daemon, "top")
    top.commit({"README.md": "top\n"})
    a = with_submodule(top, "vendor/lib", f"../{os.path.basename(sub.path)}", sub_sha)
    with open(os.path.join(top.path, "README.md"), "w") as handle:
        handle.write("top, later\n")
    git("commit", "-q", "-m", "B", "README.md", cwd=top.path)  # (add -A would drop the gitlink)
    b = git("rev-parse", "HEAD", cwd=top.path)
    checkout = wait_ready(root, top_url, a, timeout=120)["path"]
    lib = os.path.join(checkout, "vendor", "lib")
    with open(os.path.join(lib, "lib.txt"), "w") as handle:
        handle.write("tampered\n")
    with open(os.path.join(lib, "planted.txt"), "w") as handle:
        handle.write("planted\n")
    keys = os.listdir(os.path.join(root, "repos"))
    store = next(RepoPaths(os.path.join(root, "repos", k)) for k in keys
                 if os.path.exists(RepoPaths(os.path.join(root, "repos", k)).checkout(a)))
    make_idle(checkout, 3600)
    for key in keys:  # the submodule's own checkout is idle too
        paths = RepoPaths(os.path.join(root, "repos", key))
        for name in paths.checkout_names():
            make_idle(paths.checkout(name), 3600)
    code, report, out = run_cli("gc", "--max-checkouts", "0", root=root)
    assert code == 0 and any(r["spare"] and r["name"] == a for r in report["removed"]), out
    answer = wait_ready(root, top_url, b, timeout=120)
    assert answer["submodules"] == "included"
    assert "updated the spare of" in open(store.clone_log(b)).read()
    lib = os.path.join(answer["path"], "vendor", "lib")
    assert sorted(n for n in os.listdir(lib) if n != ".git") == ["lib.txt"]
    assert open(os.path.join(lib, "lib.txt")).read() == "library v1\n"
    assert git("rev-parse", "HEAD", cwd=lib) == sub_sha
    assert git("--no-optional-locks", "status", "--porcelain", "--ignored", cwd=answer["path"]) == ""


@pytest.mark.slow
def test_a_sparse_checkout_is_made_from_a_spare_of_the_same_cone_only(root, project):
    a, b = project.shas
    whole = wait_ready(root, project.path, a)["path"]
    cone = wait_ready(root, project.path, a, extra=("--sparse", "pkg/m1"))["path"]
    tamper_added_ignored_untracked(cone, "")
    with open(os.path.join(cone, "pkg", "m3"), "w") as handle:  # a file where the index has a sparse directory
        handle.write("junk\n")
    make_idle(whole, 3600)
    make_idle(cone, 3600)
    code, report, out = run_cli("gc", "--max-checkouts", "0", root=root)
    assert code == 0 and len(spare_entries(root)) == 2, out
    answer = wait_ready(root, project.path, b, extra=("--sparse", "pkg/m1"))
    log = open(only_repo(root).clone_log(os.path.basename(answer["path"]))).read()
    assert f"updated the spare of {os.path.basename(cone)}" in log, log
    assert sorted(os.listdir(answer["path"])) == sorted([".git", ".gitignore", "README.md", "dirlink", "link",
                                                         "new.txt", "pkg"])
    assert sorted(os.listdir(os.path.join(answer["path"], "pkg"))) == ["m1"]
    assert git("--no-optional-locks", "status", "--porcelain", "--ignored", "--untracked-files=all",
               cwd=answer["path"]) == ""
    (left,) = only_repo(root).spare_entries()
    assert left[1] == a, "the whole tree's spare is kept for a whole checkout"
    assert_recycled(root, project, b)


@pytest.mark.slow
@pytest.mark.parametrize("sharing", ["writer", "group"])
def test_a_recycled_tree_is_exact_in_either_sharing_mode(root, project, sharing, monkeypatch, tmp_path):
    """One writer (nothing group-writable: only the writer's uid could have changed the tree) or
    trusted peers (group-writable: a peer could have): the proof rests on neither."""
    monkeypatch.setenv("CHECKOUTCACHE_SHARING", sharing)
    a, b = project.shas
    checkout = wait_ready(root, project.path, a)["path"]
    for tamper in (tamper_modified, tamper_modes, tamper_added_ignored_untracked, tamper_nested_git,
                   tamper_symlinks_swapped):
        tamper(checkout, str(tmp_path))
    evict_to_spare(root, checkout)
    answer = assert_recycled(root, project, b)
    fresh = wait_ready(root, project.path, a)["path"]  # made fresh: no spare is left
    modes = {stat.S_IMODE(os.lstat(d).st_mode) for top in (answer["path"], fresh)
             for d, _, _ in os.walk(top) if "/.git" not in d + "/"}
    assert len(modes) == 1, f"a recycled tree's directories have a fresh one's mode: {modes}"
    group_writable = bool(modes.pop() & 0o020)
    assert group_writable == (sharing == "group")


@pytest.mark.slow
def test_gitlinks_of_either_commit_hold_nothing_a_reader_planted(root, tmp_path):
    """Gitlinks without a .gitmodules (git lists nothing inside one as untracked): a file planted
    in the spare's gitlink directory, and a directory planted where the next commit adds a
    gitlink, are gone; each gitlink is an empty directory, as a fresh checkout makes it."""
    repo = Upstream(str(tmp_path / "project"))
    base = repo.commit({f"src/f{i}.txt": f"file {i}\n" for i in range(20)}, message="files")
    git("update-index", "--add", "--cacheinfo", f"160000,{base},sub", cwd=repo.path)
    git("commit", "-qm", "A: a gitlink, no .gitmodules", cwd=repo.path)
    a = git("rev-parse", "HEAD", cwd=repo.path)
    with open(os.path.join(repo.path, "src/f0.txt"), "w") as handle:
        handle.write("changed in B\n")
    git("add", "src/f0.txt", cwd=repo.path)
    git("update-index", "--add", "--cacheinfo", f"160000,{base},vendor/lib", cwd=repo.path)
    git("commit", "-qm", "B: another gitlink", cwd=repo.path)
    b = git("rev-parse", "HEAD", cwd=repo.path)
    checkout = wait_ready(root, repo.path, a)["path"]
    os.makedirs(os.path.join(checkout, "sub", "deep"))
    with open(os.path.join(checkout, "sub", "deep", "planted.txt"), "w") as handle:
        handle.write("in the spare's gitlink\n")
    os.makedirs(os.path.join(checkout, "vendor", "lib", "deep"))
    with open(os.path.join(checkout, "vendor", "lib", "deep", "planted.txt"), "w") as handle:
        handle.write("where B adds a gitlink\n")
    evict_to_spare(root, checkout)
    answer = wait_ready(root, repo.path, b)
    log = open(only_repo(root).clone_log(b)).read()
    assert "updated the spare of" in log, log
    listing = git("ls-tree", "-r", "-z", b, cwd=repo.path)
    expected = {}
    gitlinks = []
    for item in filter(None, listing.split("\0")):
        meta, path = item.split("\t", 1)
        mode, _kind, oid = meta.split()
        if mode == "160000":
            gitlinks.append(path)
        else:
            expected[path] = (mode, oid)
    assert sorted(gitlinks) == ["sub", "vendor/lib"] and len(expected) == 20
    assert checkout_tree(answer["path"]) == expected
    for path in gitlinks:
        assert os.listdir(os.path.join(answer["path"], path)) == [], path
    assert git("--no-optional-locks", "status", "--porcelain", "--ignored", "--untracked-files=all",
               cwd=answer["path"]) == ""


@pytest.mark.slow
def test_a_spare_whose_tree_cannot_be_emptied_never_leaves_it_in_a_fresh_checkout(root, project, tmp_path):
    """An untracked file no one may delete (immutable; in the group mode a peer's directory): the
    spare is not used, and what could not be deleted is set aside, never left in the tree the
    fresh checkout is made into."""
    a, b = project.shas
    checkout = wait_ready(root, project.path, a)["path"]
    stuck = os.path.join(checkout, "pkg", "peerdir", "x")
    os.makedirs(os.path.dirname(stuck))
    with open(stuck, "w") as handle:
        handle.write("cannot be deleted\n")
    subprocess.run(["chattr", "+i", stuck], check=True)
    try:
        evict_to_spare(root, checkout)
        answer = wait_ready(root, project.path, b)
        assert_checkout_matches(answer["path"], project.path, b)
        assert not os.path.exists(os.path.join(answer["path"], "pkg", "peerdir"))
        log = open(only_repo(root).clone_log(b)).read()
        assert "not used" in log and "could not be emptied" in log and "updated the spare" not in log, log
    finally:  # wherever it went (scratch, trash), pytest may delete it again
        subprocess.run(["chattr", "-R", "-i", root], capture_output=True)



@pytest.mark.slow
def test_a_tree_a_process_still_works_in_is_never_made_a_spare(root, project, tmp_path):
    """A process left in an evicted checkout (its working directory there, a file open): had the
    tree become a spare, what it wrote later would land in the next commit's published tree.
    gc deletes such a tree instead; the process's later writes go nowhere."""
    a, b = project.shas
    checkout = wait_ready(root, project.path, a)["path"]
    go = tmp_path / "go"
    script = ("import os, sys, time\n"
              "os.chdir(os.path.join(sys.argv[1], 'pkg', 'm1'))\n"
              "held = open('f1.txt', 'r+')\n"
              "print('in', flush=True)\n"
              f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
              "try:\n"
              "    open('late.log', 'w').write('written after the eviction\\n')\n"
              "    held.seek(0); held.write('XXXX'); held.flush()\n"
              "except OSError as exc:\n"
              "    print('refused', exc.errno, flush=True)\n"
              "print('done', flush=True)\n")
    worker = subprocess.Popen([sys.executable, "-c", script, checkout], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "in"
        make_idle(checkout, 3600)
        code, report, out = run_cli("gc", "--max-checkouts", "0", root=root)
        assert code == 0, out
        assert [r["spare"] for r in report["removed"] if r["name"] == a] == [False], report
        assert spare_entries(root) == [] and not os.path.exists(checkout)
        answer = wait_ready(root, project.path, b)
        go.write_text("")
        assert worker.stdout.read().strip().splitlines()[-1] == "done"
        assert worker.wait(30) == 0
        log = open(only_repo(root).clone_log(b)).read()
        assert "updated the spare" not in log, log
        assert_checkout_matches(answer["path"], project.path, b)  # nothing the process wrote is in it
        assert not os.path.exists(os.path.join(answer["path"], "pkg", "m1", "late.log"))
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cwd", "open-file"])
def test_a_process_that_reaches_a_tree_by_another_path_keeps_it_from_being_a_spare(root, project, tmp_path, how):
    """Regression (issue 33): gc looked for processes in a tree by the path strings /proc
    shows, which are the paths as the process sees them. One in another mount namespace that
    sees the root elsewhere (a container that mounts the volume at another path; a bind
    mount) was not seen: its tree became a spare, and what it wrote later would have landed
    in the next commit's tree. gc now compares identities (st_dev, st_ino, walking up `..`)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a mount namespace")
    a, b = project.shas
    checkout = wait_ready(root, project.path, a)["path"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    seen_as = os.path.join(str(elsewhere), os.path.relpath(checkout, root))
    go = tmp_path / "go"
    script = ("import os, sys, time\n"
              "tree = sys.argv[1]\n"
              "held = open(os.path.join(tree, 'pkg', 'm1', 'f1.txt'), 'r+')\n"
              f"os.chdir(os.path.join(tree, 'pkg', 'm1') if {how == 'cwd'!r} else '/')\n"
              "print('in', os.path.realpath(held.name), flush=True)\n"
              f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
              "print('done', flush=True)\n")
    worker = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               'mount --bind "$1" "$2" && exec "$3" -c "$4" "$5"', "sh", root, str(elsewhere),
                               sys.executable, script, seen_as], stdout=subprocess.PIPE, text=True)
    try:
        line = worker.stdout.readline().split()
        assert line[:1] == ["in"] and line[1].startswith(str(elsewhere)), line  # it sees the tree elsewhere
        # /proc shows its paths as it sees them: none of them is a path of the store.
        shown = [os.readlink(f"/proc/{worker.pid}/cwd")] + [
            os.readlink(f"/proc/{worker.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{worker.pid}/fd")]
        assert [p for p in shown if p.startswith(str(elsewhere))], shown
        assert not [p for p in shown if p.startswith(root)], shown
        make_idle(checkout, 3600)
        code, report, out = run_cli("gc", "--max-checkouts", "0", root=root)
        assert code == 0, out
        assert [r["spare"] for r in report["removed"] if r["name"] == a] == [False], report
        assert spare_entries(root) == [] and not os.path.exists(checkout)
        go.write_text("")
        assert worker.stdout.read().strip().splitlines()[-1] == "done"
        assert worker.wait(30) == 0
    finally:
        worker.kill()
        worker.wait()
    answer = wait_ready(root, project.path, b)
    assert "updated the spare" not in open(only_repo(root).clone_log(b)).read()
    assert_checkout_matches(answer["path"], project.path, b)
