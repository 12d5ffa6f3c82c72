"""Shared fixtures: real git repositories made by the tests, a git daemon on
loopback (a realistic remote: a plain path hard-links and libgit2's file:// is
slow), and helpers to run the CLI and to compare a checkout with its commit."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from gitdaemon import GitDaemon, free_port  # noqa: E402,F401  (one helper for tests and benchmarks)

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Test", "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "Test", "GIT_COMMITTER_EMAIL": "test@example.invalid",
    "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent-home",
}


def git(*args: str, cwd: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_ENV)
    # safe.directory: checkouts made by another uid (tests/test_shared_uids.py) are inspected too.
    return subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


class Upstream:
    """A repository with a few commits: nested files, an executable, a symlink, a binary file."""

    def __init__(self, path: str):
        self.path = path
        self.shas: list[str] = []
        git("init", "-q", "-b", "main", path)

    def commit(self, files: dict[str, bytes | str], message: str = "change",
               symlinks: dict[str, str] | None = None, executable: tuple[str, ...] = ()) -> str:
        for name, data in files.items():
            full = os.path.join(self.path, name)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as handle:
                handle.write(data.encode() if isinstance(data, str) else data)
            os.chmod(full, 0o755 if name in executable else 0o644)
        for name, target in (symlinks or {}).items():
            full = os.path.join(self.path, name)
            if os.path.lexists(full):
                os.unlink(full)
            os.symlink(target, full)
        git("add", "-A", cwd=self.path)
        git("commit", "-q", "--allow-empty", "-m", message, cwd=self.path)
        sha = git("rev-parse", "HEAD", cwd=self.path)
        self.shas.append(sha)
        return sha

    def standard_history(self, count: int = 3) -> list[str]:
        for number in range(count):
            self.commit({
                "README.md": f"# project\nversion {number}\n",
                f"src/module_{number}.py": f"VALUE = {number}\n",
                "src/deep/nested/file.txt": "x" * (100 + number),
                "bin/tool.sh": "#!/bin/sh\necho tool\n",
                "data/blob.bin": bytes(range(256)) * (number + 1),
            }, message=f"commit {number}", symlinks={"link-to-readme": "README.md"},
                executable=("bin/tool.sh",))
        return list(self.shas)


@pytest.fixture
def upstream(tmp_path) -> Upstream:
    repo = Upstream(str(tmp_path / "upstream"))
    repo.standard_history()
    return repo


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    served = GitDaemon(str(tmp_path_factory.mktemp("served")))
    yield served
    served.stop()


@pytest.fixture
def served_upstream(daemon, request) -> tuple[Upstream, str]:
    name = f"repo-{request.node.name}".replace("[", "-").replace("]", "").replace("/", "-")[:80]
    repo = Upstream(os.path.join(daemon.base, name))
    repo.standard_history()
    return repo, daemon.url(name)


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "cache")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests see neither the developer's cache settings nor their git identity."""
    for name in list(os.environ):
        if name.startswith("CHECKOUTCACHE_") or name.startswith("GIT_"):
            monkeypatch.delenv(name)


def run_cli(*args: str, root: str | None = None, env: dict | None = None, timeout: float = 120,
            cwd: str | None = None) -> tuple[int, dict | None, str]:
    """Run the CLI as a user would (stdout not a TTY, so JSON); return (exit, json, stderr)."""
    cmd = [sys.executable, "-m", "checkoutcache"]
    if root is not None:
        cmd += ["--root", root]
    full_env = dict(os.environ)
    full_env.update(env or {})
    done = subprocess.run(cmd + list(args), capture_output=True, text=True, env=full_env, timeout=timeout,
                          cwd=cwd)
    try:
        parsed = json.loads(done.stdout) if done.stdout.strip() else None
    except ValueError:
        parsed = None
    return done.returncode, parsed, done.stderr + done.stdout


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def assert_checkout_matches(checkout: str, upstream_path: str, sha: str) -> None:
    """The work tree equals the commit's tree (paths, modes, symlinks, content) and git agrees."""
    listing = git("ls-tree", "-r", "-z", sha, cwd=upstream_path)
    expected = {}
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        mode, _type, oid = meta.split()
        expected[path] = (mode, oid)
    actual = {}
    for directory, dirs, files in os.walk(checkout):
        if directory == checkout:
            dirs[:] = [d for d in dirs if d != ".git"]
        for name in files + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, checkout)
            if os.path.islink(full):
                actual[rel] = ("120000", blob_id(os.readlink(full).encode()))
            else:
                with open(full, "rb") as handle:
                    data = handle.read()
                mode = "100755" if os.stat(full).st_mode & 0o100 else "100644"
                actual[rel] = (mode, blob_id(data))
    assert actual == expected
    assert git("status", "--porcelain", cwd=checkout) == ""
    assert git("rev-parse", "HEAD", cwd=checkout) == sha
    assert git("log", "-1", "--format=%H", cwd=checkout) == sha


def files_under(path: str) -> list[str]:
    found = []
    for directory, dirs, files in os.walk(path):
        found += [os.path.join(directory, n) for n in files + dirs]
    return found


def grep_tree(path: str, needle: bytes) -> list[str]:
    hits = []
    for directory, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(directory, name)
            if os.path.islink(full):
                continue
            with open(full, "rb") as handle:
                if needle in handle.read():
                    hits.append(full)
    return hits


def wait_ready(root: str, repo: str, sha: str, timeout: float = 60, **kw) -> dict:
    code, answer, err = run_cli("ensure", repo, sha, "--wait", str(timeout), root=root, **kw)
    assert code == 0, (code, answer, err)
    return answer


@pytest.fixture
def fake_git(tmp_path):
    """A directory to put first on PATH holding a `git` wrapper; returns a function
    that writes the wrapper's extra shell (run before exec'ing the real git)."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    real = shutil.which("git")

    def install(prelude: str) -> dict:
        wrapper = bindir / "git"
        wrapper.write_text(f"#!/bin/sh\n{prelude}\nexec {real} \"$@\"\n")
        wrapper.chmod(0o755)
        return {"PATH": f"{bindir}:{os.environ['PATH']}"}

    return install
