"""Real histories clone (DESIGN invariant 17): git's fsck, on for every fetch, refuses
what can harm a checkout or the store and lets through the harmless quirks that old
git versions and other tools wrote into long-lived public repositories (issue 27:
pallets/flask failed on `zeroPaddedFilemode`).

Each object is written byte by byte (`git hash-object --literally`), as the old tool
wrote it or as an attacker would push it, and served by a real `git daemon`."""

from __future__ import annotations

import os
import subprocess

import pytest

from checkoutcache.git.env import FSCK_CHOICES, FSCK_CONFIG

from .helpers import Upstream, only_repo, run_cli
from .helpers.repos import GIT_ENV

IDENT = b"Old Tool <old@example.invalid> 1112911993 -0700"


def raw_git(repo: str, *args: str, data: bytes = b"") -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_ENV)
    return subprocess.run(["git", "-C", repo, *args], input=data, env=env, check=True,
                          capture_output=True).stdout.decode().strip()


def literal(repo: str, kind: str, data: bytes) -> str:
    return raw_git(repo, "hash-object", "-w", "-t", kind, "--literally", "--stdin", data=data)


def entry(mode: bytes, name: bytes, oid: str) -> bytes:
    return mode + b" " + name + b"\0" + bytes.fromhex(oid)


def build(repo: str, quirk: str) -> str:
    """A commit on main, one quirk in it (a msg-id of git's fsck), else well-formed."""
    readme = literal(repo, "blob", b"# old project\n")
    code = literal(repo, "blob", b"print('hello')\n")
    sub = literal(repo, "tree", entry(b"100644", b"main.py", code))
    trees = {
        # git before 2.0 (and some converters) wrote "040000" for a tree's mode.
        "zeroPaddedFilemode": [entry(b"100644", b"README", readme), entry(b"040000", b"src", sub)],
        # git before 0.99 wrote group-writable modes; git checks them out as 100644.
        "badFilemode": [entry(b"100664", b"README", readme), entry(b"40000", b"src", sub)],
        # Hostile: each of these is what a checkout would be harmed by.
        "hasDotgit": [entry(b"40000", b".git", sub), entry(b"100644", b"README", readme)],
        "hasDotgit-ntfs": [entry(b"100644", b"README", readme), entry(b"40000", b"git~1", sub)],
        "hasDotdot": [entry(b"40000", b"..", sub), entry(b"100644", b"README", readme)],
        "hasDot": [entry(b"40000", b".", sub), entry(b"100644", b"README", readme)],
        "fullPathname": [entry(b"100644", b"README", readme), entry(b"100644", b"src/main.py", code)],
        "duplicateEntries": [entry(b"100644", b"README", readme), entry(b"100644", b"README", code)],
        "treeNotSorted": [entry(b"100644", b"zz", readme), entry(b"100644", b"README", code)],
        "gitmodulesSymlink": [entry(b"120000", b".gitmodules", literal(repo, "blob", b"/etc/passwd")),
                              entry(b"100644", b"README", readme)],
        "gitmodulesUrl": [entry(b"100644", b".gitmodules", literal(
            repo, "blob", b'[submodule "x"]\n\tpath = x\n\turl = -uupload-pack=touch /tmp/cc-pwned\n')),
            entry(b"100644", b"README", readme)],
        # The same .gitmodules with an executable mode: git reads it all the same.
        "gitmodulesUrl-exec": [entry(b"100755", b".gitmodules", literal(
            repo, "blob", b'[submodule "x"]\n\tpath = x\n\turl = -uupload-pack=touch /tmp/cc-pwned\n')),
            entry(b"100644", b"README", readme)],
        "hasDotgit-case": [entry(b"40000", b".GIT", sub), entry(b"100644", b"README", readme)],
        "hasDotgit-hfs": [entry(b"40000", ".git\u200c".encode(), sub), entry(b"100644", b"README", readme)],
        "gitmodulesPath": [entry(b"100644", b".gitmodules", literal(
            repo, "blob", b'[submodule "x"]\n\tpath = -x\n\turl = https://example.invalid/x\n')),
            entry(b"100644", b"README", readme)],
        "gitmodulesName": [entry(b"100644", b".gitmodules", literal(
            repo, "blob", b'[submodule "../../modules/evil"]\n\tpath = x\n\turl = https://example.invalid/x\n')),
            entry(b"100644", b"README", readme)],
    }
    tree = literal(repo, "tree", b"".join(trees.get(quirk, trees["zeroPaddedFilemode"][:1] +
                                                    [entry(b"40000", b"src", sub)])))
    author = {
        "badTimezone": b"author Old Tool <old@example.invalid> 1112911993 -07",
        "badDate": b"author Old Tool <old@example.invalid> yesterday -0700",
        "badDateOverflow": b"author Old Tool <old@example.invalid> 99999999999999999999 -0700",
        "zeroPaddedDate": b"author Old Tool <old@example.invalid> 01112911993 -0700",
        "missingSpaceBeforeDate": b"author Old Tool <old@example.invalid>1112911993 -0700",
        "missingEmail": b"author Old Tool 1112911993 -0700",
        "badEmail": b"author Old Tool <old@example.invalid 1112911993 -0700",
        "missingNameBeforeEmail": b"author <old@example.invalid> 1112911993 -0700",
        "missingSpaceBeforeEmail": b"author Old Tool<old@example.invalid> 1112911993 -0700",
        "badName": b"author Old> Tool <old@example.invalid> 1112911993 -0700",
        "multipleAuthors": b"author " + IDENT + b"\nauthor " + IDENT,
        "missingAuthor": b"",
    }.get(quirk, b"author " + IDENT)
    committer = b"committer " + IDENT if quirk != "missingCommitter" else b""
    message = b"an old commit\n" + (b"\0binary junk a converter left\n" if quirk == "nulInCommit" else b"")
    headers = [b"tree " + tree.encode(), author, committer]
    sha = literal(repo, "commit", b"\n".join(h for h in headers if h) + b"\n\n" + message)
    raw_git(repo, "update-ref", "refs/heads/main", sha)
    return sha


HARMLESS = ["zeroPaddedFilemode", "badFilemode", "badTimezone", "badDate", "badDateOverflow", "zeroPaddedDate",
            "missingSpaceBeforeDate", "missingEmail", "badEmail", "missingNameBeforeEmail",
            "missingSpaceBeforeEmail", "badName", "multipleAuthors", "missingAuthor", "missingCommitter",
            "nulInCommit"]
# (emptyName and nullSha1 are kept as errors too, but no git server can send them: its
# pack-objects fails on such a tree.)
HOSTILE = ["hasDotgit", "hasDotgit-ntfs", "hasDotdot", "hasDot", "fullPathname", "duplicateEntries",
           "treeNotSorted", "gitmodulesSymlink", "gitmodulesUrl", "gitmodulesPath", "gitmodulesName",
           "gitmodulesUrl-exec", "hasDotgit-case", "hasDotgit-hfs"]


def served_quirk(daemon, quirk: str) -> tuple[str, str]:
    repo = Upstream(os.path.join(daemon.base, f"quirk-{quirk}-{os.urandom(3).hex()}"))
    raw_git(repo.path, "config", "uploadpack.allowFilter", "true")
    return build(repo.path, quirk), daemon.url(os.path.basename(repo.path))


# A full mirror, and a partial one: git before 2.44 does not hand a partial fetch our
# choices, so there the fetch is checked after it, in quarantine (git/quarantine.py).
MIRRORS = pytest.mark.parametrize("mirror", ["full", "partial"])
ENV = {"full": {}, "partial": {"CHECKOUTCACHE_FILTER": "blob:none"}}


@MIRRORS
@pytest.mark.parametrize("quirk", HARMLESS)
def test_a_history_with_a_harmless_quirk_clones(root, daemon, quirk, mirror):
    sha, url = served_quirk(daemon, quirk)
    code, answer, err = run_cli("ensure", url, sha, "--wait", "60", root=root, env=ENV[mirror])
    assert code == 0 and answer["state"] == "ready", (quirk, err)
    assert os.path.isfile(os.path.join(answer["path"], "README"))
    log = subprocess.run(["git", "-C", answer["path"], "log", "--format=%H"], capture_output=True, text=True)
    assert log.returncode == 0 and log.stdout.split() == [sha]


@MIRRORS
@pytest.mark.parametrize("quirk", HOSTILE)
def test_a_tree_that_can_harm_a_checkout_is_still_refused(root, daemon, quirk, mirror):
    sha, url = served_quirk(daemon, quirk)
    code, answer, err = run_cli("ensure", url, sha, "--wait", "60", root=root, env=ENV[mirror])
    assert code != 0 and answer["state"] == "failed" and answer["error"] == "CLONE_FAILED", (quirk, err)
    assert f"{quirk.split('-')[0]}:" in answer["message"]  # refused by git's fsck, for this reason
    store = only_repo(root)
    assert not os.path.exists(store.checkout(sha))
    assert not os.path.exists("/tmp/cc-pwned")


def test_every_fsck_choice_is_written_down_with_its_reason():
    """Each msg-id we relax is git's, says why, and docs/security.md lists it."""
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "security.md")) as handle:
        doc = handle.read()
    assert FSCK_CHOICES
    for msg_id, (level, reason) in FSCK_CHOICES.items():
        assert level in ("ignore", "warn") and len(reason) > 20
        assert FSCK_CONFIG[f"fetch.fsck.{msg_id}"] == level
        assert f"`{msg_id}`" in doc, msg_id
    for kept in ("hasDotgit", "hasDotdot", "gitmodulesSymlink", "gitmodulesUrl", "treeNotSorted",
                 "duplicateEntries"):
        assert f"fetch.fsck.{kept}" not in FSCK_CONFIG
