"""Issue 33: a recycled tree (a spare updated in place, clone/tree.py) is byte for byte what a
fresh checkout of its commit writes whatever the attributes did between the two commits, and
`verify` compares what a fresh checkout would write (git/written.py), so it can no longer pass
a tree whose files another commit's attributes wrote.

git's `read-tree --reset -u` keeps an entry whose blob and stat did not change as the old
attributes wrote it. A file git wrote within the second its index was written is racily
clean and written again anyway, which would hide that in a small test: each spare here is
itself an updated spare (commit Z's tree updated into A a second later, so A's index is
newer than its kept files), as a real checkout taking more than a second is.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time

import pytest

from .helpers import git, only_repo, run_cli, wait_ready, wait_until
from .test_spares import evict_to_spare, spare_entries
from .test_submodules import served

pytestmark = pytest.mark.slow

# The unchanged files each kind of attribute covers, as the commits hold them (LF, UTF-8).
FILES = {
    "eol/a.txt": "line one\nline two\n",
    "eol/deep/b.txt": "deeper\nstill\n",
    "ident/k.c": "/* $Id$ */\nint k;\n",
    "enc/u.txt": "h\u00e9llo w\u00f6rld\n",
    "plain/n.txt": "no attributes here\n",
    "README.md": "# attributes\n",
}
COVERED = ["eol/a.txt", "eol/deep/b.txt", "ident/k.c", "enc/u.txt"]
# Per kind, per change: (the spare's commit's attribute lines, the target commit's); None: no line.
KINDS = {
    "eol": ("*.txt text eol=crlf", {"added": None, "removed": "*.txt text eol=crlf", "changed": "*.txt text eol=crlf"},
            {"added": "*.txt text eol=crlf", "removed": None, "changed": "*.txt text eol=lf"}),
    "ident": ("*.c ident", {"added": None, "removed": "*.c ident", "changed": "*.c ident"},
              {"added": "*.c ident", "removed": None, "changed": "*.c -ident"}),
    "enc": ("*.txt working-tree-encoding=UTF-16LE",
            {"added": None, "removed": "*.txt working-tree-encoding=UTF-16LE",
             "changed": "*.txt working-tree-encoding=UTF-16LE"},
            {"added": "*.txt working-tree-encoding=UTF-16LE", "removed": None,
             "changed": "*.txt working-tree-encoding=UTF-16BE"}),
}


def attribute_files(change: str, side: int, where: str) -> dict[str, str | None]:
    """The .gitattributes files of one side (1: the spare's commit, 2: the target) of a change:
    each kind's own directory's, or all in the top-level one (patterns then name the directory)."""
    lines = {kind: spec[side][change] for kind, spec in KINDS.items()}
    if where == "subdirectory":
        return {f"{kind}/.gitattributes": (line + "\n" if line else None) for kind, line in lines.items()}
    text = "".join(f"{kind}/**/{line}\n" for kind, line in lines.items() if line)
    return {".gitattributes": text or None}


def commit(repo_path: str, files: dict[str, str | None], message: str) -> str:
    """Commit exactly these paths (None: removed), nothing re-added: a file git would now convert
    otherwise (working-tree-encoding) keeps its blob."""
    for rel, text in files.items():
        full = os.path.join(repo_path, rel)
        if text is None:
            if os.path.exists(full):
                git("rm", "-q", "--cached", "--", rel, cwd=repo_path)
                os.unlink(full)
            continue
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as handle:
            handle.write(text)
        git("add", "--", rel, cwd=repo_path)
    git("commit", "-q", "--allow-empty", "-m", message, cwd=repo_path)
    return git("rev-parse", "HEAD", cwd=repo_path)


def plain_env(tmp: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update({"HOME": tmp, "GIT_CONFIG_NOSYSTEM": "1", "GIT_ATTR_NOSYSTEM": "1", "LC_ALL": "C"})
    return env


def fresh_clone(url: str, sha: str, where: str) -> str:
    """Plain git's own clone and checkout of the commit: the reference."""
    env = plain_env(os.path.dirname(where))
    subprocess.run(["git", "clone", "-q", "--no-checkout", url, where], check=True, env=env, capture_output=True)
    subprocess.run(["git", "-C", where, "-c", "advice.detachedHead=false", "checkout", "-q", "--detach", sha],
                   check=True, env=env, capture_output=True)
    return where


def tree_bytes(top: str) -> dict[str, tuple]:
    """Every entry beneath top but .git: its kind, executable bit and bytes (or link target)."""
    found = {}
    for directory, dirs, names in os.walk(top):
        if directory == top:
            dirs[:] = [d for d in dirs if d != ".git"]
        for name in names + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, top)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                found[rel] = ("link", os.readlink(path))
            else:
                with open(path, "rb") as handle:
                    found[rel] = ("file", bool(info.st_mode & 0o100), handle.read())
    assert found, f"nothing under {top}"
    return found


def settle_a_second(since: float) -> None:
    """Until the clock's second has moved past `since`: files written then are older, to
    git's whole-second stat, than an index written from now on."""
    wait_until(lambda: int(time.time()) > int(since), 5, "the next second")


def spare_of_an_updated_tree(root: str, url: str, z: str, a: str) -> str:
    """A's published tree made from Z's spare (its kept files older than its index), evicted
    into a spare in turn; A's checkout path (gone: it is the spare now)."""
    first = wait_ready(root, url, z)["path"]
    written = time.time()  # (Z's files were written before its ready answer)
    evict_to_spare(root, first)
    settle_a_second(written)
    answer = wait_ready(root, url, a)
    assert "updated the spare of" in open(only_repo(root).clone_log(a)).read()
    evict_to_spare(root, answer["path"])
    return answer["path"]


@pytest.mark.parametrize("where", ["subdirectory", "top"])
@pytest.mark.parametrize("change", ["added", "removed", "changed"])
def test_a_spare_is_exact_whatever_the_attributes_did(root, daemon, tmp_path, change, where):
    repo, url = served(daemon, f"attrs-{change}-{where[:3]}")
    z = commit(repo.path, {**FILES, **attribute_files(change, 1, where)}, "Z: the files, the spare's attributes")
    a = commit(repo.path, {"plain/other.txt": "A\n"}, "A: nothing the attributes cover")
    b = commit(repo.path, attribute_files(change, 2, where), f"B: the attributes {change}, the files unchanged")
    assert git("diff", "--name-only", a, b, cwd=repo.path).split() == sorted(attribute_files(change, 2, where))
    spare_of_an_updated_tree(root, url, z, a)
    (spare_entry,) = spare_entries(root)
    kept = os.lstat(os.path.join(only_repo(root).spare_entry(spare_entry), "tree", "plain", "n.txt")).st_ino

    answer = wait_ready(root, url, b)
    log = open(only_repo(root).clone_log(b)).read()
    expected = tree_bytes(fresh_clone(url, b, str(tmp_path / "fresh-b")))
    old = tree_bytes(fresh_clone(url, a, str(tmp_path / "fresh-a")))
    differing = sorted(rel for rel in COVERED if old[rel] != expected[rel])
    assert differing, "the two commits' attributes write the covered files otherwise"
    assert tree_bytes(answer["path"]) == expected
    if where == "top":
        # Every file may be written otherwise: the spare is left for another commit, not taken.
        assert "the top-level .gitattributes or .lfsconfig differs" in log and "updated the spare" not in log, log
        assert spare_entries(root) == [spare_entry]
    else:
        assert "updated the spare of" in log and "whose .gitattributes changed, written anew" in log, log
        # Only what the changed attributes cover is written again.
        assert os.lstat(os.path.join(answer["path"], "plain", "n.txt")).st_ino == kept
    assert git("--no-optional-locks", "status", "--porcelain", cwd=answer["path"]) == ""
    code, report, out = run_cli("verify", root=root)
    assert code == 0 and report["broken"] == 0, out

    # verify: the same tree with the spare's conversion of the covered files, by hand, with an
    # index that vouches for their stat (as read-tree left it): git's status is clean.
    for rel in differing:
        with open(os.path.join(answer["path"], rel), "wb") as handle:
            handle.write(old[rel][2])
    subprocess.run(["git", "-C", answer["path"], "update-index", "-q", "--refresh"], env=plain_env(str(tmp_path)),
                   capture_output=True)
    code, report, out = run_cli("verify", root=root)
    assert code != 0, out
    (result,) = [c for c in report["checkouts"] if c["commit"] == b]
    assert not result["ok"], result
    text = " ".join(result["problems"])
    assert "differ from what a fresh checkout of the commit writes" in text or "differ from the commit" in text, text
    shown = [rel for rel in differing if rel in text]
    assert shown, text


LFS_BIG = b"large object content " * 120


@pytest.mark.skipif(shutil.which("git-lfs") is None, reason="git-lfs is not installed")
@pytest.mark.parametrize("change", ["added", "removed", "changed"])
def test_a_spare_is_exact_whatever_filter_lfs_did(root, tmp_path, change):
    """A pointer file whose filter=lfs comes or goes (or moves to another pattern) between the
    spare's commit and the target: its bytes are the content where the target's attributes say
    LFS, the pointer text where they do not; verify tells the one from the other."""
    from .helpers.lfs import LfsUpstream, pointer

    up = LfsUpstream(str(tmp_path / "lfs-upstream"))
    up.put_object(LFS_BIG)
    lines = {"added": (None, "*.bin filter=lfs -text"), "removed": ("*.bin filter=lfs -text", None),
             "changed": ("*.bin filter=lfs -text", "*.dat filter=lfs -text")}[change]
    # store/ keeps an LFS file under attributes that never change: both commits' checkouts run
    # git-lfs (the spare fits by its LFS answer whichever way media/'s attributes went).
    files = {"media/big.bin": pointer(LFS_BIG), "media/keep.dat": pointer(LFS_BIG), "README.md": "lfs\n",
             "store/.gitattributes": "*.bin filter=lfs -text\n", "store/x.bin": pointer(LFS_BIG)}
    z = commit(up.path, {**files, "media/.gitattributes": lines[0] and lines[0] + "\n"}, "Z")
    a = commit(up.path, {"other.txt": "A\n"}, "A")
    b = commit(up.path, {"media/.gitattributes": lines[1] and lines[1] + "\n"}, "B")
    spare_of_an_updated_tree(root, up.path, z, a)
    answer = wait_ready(root, up.path, b)
    assert answer["lfs"] == "content"
    assert "updated the spare of" in open(only_repo(root).clone_log(b)).read()
    with open(os.path.join(answer["path"], "store", "x.bin"), "rb") as handle:
        assert handle.read() == LFS_BIG
    expect_big = LFS_BIG if change == "added" else pointer(LFS_BIG).encode()
    expect_dat = LFS_BIG if change == "changed" else pointer(LFS_BIG).encode()
    with open(os.path.join(answer["path"], "media", "big.bin"), "rb") as handle:
        assert handle.read() == expect_big
    with open(os.path.join(answer["path"], "media", "keep.dat"), "rb") as handle:
        assert handle.read() == expect_dat
    code, report, out = run_cli("verify", root=root)
    assert code == 0 and report["broken"] == 0, out
    # The other form of big.bin, by hand, its stat vouched for by the index: verify says which.
    wrong = pointer(LFS_BIG).encode() if change == "added" else LFS_BIG
    with open(os.path.join(answer["path"], "media", "big.bin"), "wb") as handle:
        handle.write(wrong)
    subprocess.run(["git", "-C", answer["path"], "update-index", "-q", "--refresh"], env=plain_env(str(tmp_path)),
                   capture_output=True)
    code, report, out = run_cli("verify", root=root)
    (result,) = [c for c in report["checkouts"] if c["commit"] == b]
    assert code != 0 and not result["ok"], out
    text = " ".join(result["problems"])
    assert "media/big.bin" in text, text
    if change == "added":
        assert "the LFS pointer where a fresh checkout writes the content" in text or "differ from the commit" in text


def test_the_machines_attributes_file_never_applies(root, daemon, tmp_path):
    """A machine's $(prefix)/etc/gitattributes (here one that says every file is CRLF) added
    between a spare's checkout and its update, or present on one machine of two: git read it for
    every checkout, so a fresh file of the update got CRLF beside the spare's LF ones. Neither
    checkout reads it now (git_env: GIT_ATTR_NOSYSTEM), and both trees are plain git's."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare for a private /etc")
    repo, url = served(daemon, "machine-attrs")
    z = commit(repo.path, FILES, "Z")
    a = commit(repo.path, {"plain/other.txt": "A\n"}, "A")
    b = commit(repo.path, {"plain/new.txt": "new in B\n", "eol/a.txt": "changed in B\n"}, "B")
    spare_of_an_updated_tree(root, url, z, a)
    upper = tmp_path / "etc-upper"
    script = (f"set -e; mount -t tmpfs tmpfs {upper}; mkdir {upper}/u {upper}/w; "
              f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper}/u,workdir={upper}/w /etc; "
              f"printf '* text eol=crlf\\n' > /etc/gitattributes; "
              f"exec {shutil.which('python') or 'python3'} -m checkoutcache --json ensure {url} {b} --wait 60")
    upper.mkdir()
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                          env={**os.environ, "CHECKOUTCACHE_ROOT": root})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert not os.path.exists("/etc/gitattributes"), "the file was only ever in the private mount"
    answer = wait_ready(root, url, b)
    assert "updated the spare of" in open(only_repo(root).clone_log(b)).read()
    assert tree_bytes(answer["path"]) == tree_bytes(fresh_clone(url, b, str(tmp_path / "fresh-b")))


def test_a_spare_written_under_another_sharing_mode_is_not_used(root, daemon, tmp_path, monkeypatch):
    """The sharing mode sets the umask files are written with (0644 one writer, 0664 peers): a
    spare of the one-writer mode updated in the group mode kept 0644 files beside 0664 new ones.
    Its conversion digest differs: the tree is made fresh, every file the mode's."""
    repo, url = served(daemon, "sharing-modes")
    z = commit(repo.path, FILES, "Z")
    a = commit(repo.path, {"plain/other.txt": "A\n"}, "A")
    b = commit(repo.path, {"plain/new.txt": "new in B\n"}, "B")
    spare_of_an_updated_tree(root, url, z, a)
    monkeypatch.setenv("CHECKOUTCACHE_SHARING", "group")
    answer = wait_ready(root, url, b)
    assert "updated the spare" not in open(only_repo(root).clone_log(b)).read()
    modes = {stat.S_IMODE(os.lstat(os.path.join(d, n)).st_mode) for d, _, names in os.walk(answer["path"])
             if "/.git" not in d + "/" for n in names}
    assert modes == {0o664}, modes
