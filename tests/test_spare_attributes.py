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
