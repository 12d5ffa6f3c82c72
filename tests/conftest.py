"""Fixtures only: real git repositories made by the tests, a git daemon on
loopback, a store root, a fake git, the image and its containers (podman), and
an environment that keeps every test inside its own temporary directories.
Helpers live in tests/helpers/."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import warnings

import pytest

from .helpers import GitDaemon, Upstream
from .helpers.containers import Containers, build_image, podman_unusable


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
    # Cut to a length git daemon paths take, kept apart by a digest of the whole name
    # (parametrized tests share a long prefix).
    full = request.node.name
    name = f"repo-{full}".replace("[", "-").replace("]", "").replace("/", "-")[:72] + "-" + \
        hashlib.sha1(full.encode()).hexdigest()[:7]
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


@pytest.fixture(autouse=True)
def private_dirs(tmp_path, monkeypatch):
    """Nothing a test starts writes to /tmp, the user's home or their cache: TMPDIR,
    HOME and XDG_CACHE_HOME point into the test's own tmp_path (subprocesses inherit them)."""
    private = tmp_path / "private"
    for name, sub in (("TMPDIR", "tmp"), ("HOME", "home"), ("XDG_CACHE_HOME", "xdg-cache")):
        (private / sub).mkdir(parents=True)
        monkeypatch.setenv(name, str(private / sub))
    monkeypatch.setattr(tempfile, "tempdir", str(private / "tmp"))


SYSTEM_TMP_NAMES = ("checkoutcache", "cc-pwned", "pwned")


def _system_tmp_entries() -> set[str]:
    try:
        return {name for name in os.listdir("/tmp") if name.startswith(SYSTEM_TMP_NAMES)}
    except OSError:
        return set()


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            return int(next(line for line in handle if line.startswith("PPid:")).split()[1])
    except (OSError, StopIteration, ValueError):
        return None


def _session_head() -> int:
    """The process this session's pytest processes descend from: ours, or under pytest-xdist
    (a worker sets PYTEST_XDIST_WORKER) the controller that started us and our sibling workers."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return _parent_of(os.getpid()) or os.getpid()
    return os.getpid()


def _other_pytest_sessions() -> list[int]:
    """Other pytest processes on this machine (neither this session's, pytest-xdist workers
    included, nor their children): they may write to /tmp too."""
    head, found = _session_head(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (head, os.getpid()):
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except OSError:
            continue
        if b"pytest" not in cmdline:
            continue
        parent = _parent_of(int(name))
        if parent is None or parent in (head, os.getpid()) or _parent_of(parent) == head:
            continue  # a worker of this session, or a child of ours or of a worker
        found.append(int(name))
    return found


def _session_base(tmp_path_factory) -> str:
    """The directory every test of this session (all its xdist workers) keeps its files under."""
    base = str(tmp_path_factory.getbasetemp())
    return os.path.dirname(base) if os.environ.get("PYTEST_XDIST_WORKER") else base


def whose_view(path: str, session_base: str) -> str:
    """"ours", "theirs" or "unknown" for a private git view in /tmp (checkoutcache/git/view.py):
    its `objects` link names the mirror it showed, and every mirror of ours is under the
    session's base directory; another program's (a serve beside the suite) is elsewhere."""
    try:
        target = os.readlink(os.path.join(path, "objects"))
    except OSError:
        return "unknown"  # killed before it linked anything: nothing says whose it was
    inside = os.path.commonpath([os.path.realpath(session_base), os.path.realpath(target)])
    return "ours" if inside == os.path.realpath(session_base) else "theirs"


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_the_system_tmp(tmp_path_factory):
    """The session leaves no new checkoutcache (or "pwned") entry in /tmp. A private git view
    counts when it showed a mirror of this session's (another checkoutcache program's views
    are not ours to judge); another pytest session running on the same machine may create
    other entries itself: then this only warns."""
    from checkoutcache.git.view import VIEW_PREFIX

    before = _system_tmp_entries()
    others = set(_other_pytest_sessions())
    yield
    new = _system_tmp_entries() - before
    base = _session_base(tmp_path_factory)
    views = {name: whose_view(os.path.join("/tmp", name), base) for name in new if name.startswith(VIEW_PREFIX)}
    new -= {name for name, whose in views.items() if whose == "theirs"}
    unknown = sorted(name for name, whose in views.items() if whose == "unknown")
    if unknown:
        warnings.warn(f"private git views of unknown owners appeared in /tmp: {unknown}")
        new -= set(unknown)
    if not new:
        return
    others |= set(_other_pytest_sessions())
    message = f"tests wrote outside their temporary directories: {sorted(new)} in /tmp"
    if others:
        warnings.warn(f"{message} (or did another pytest session, pids {sorted(others)}?)")
    else:
        pytest.fail(message)


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


@pytest.fixture
def kill_log(tmp_path, monkeypatch):
    """Kill tests: a file where a process killed by CHECKOUTCACHE_TEST_KILL_AT logs "<step> <pid>"
    just before it dies (set for every subprocess the test starts)."""
    path = tmp_path / "kills.log"
    monkeypatch.setenv("CHECKOUTCACHE_TEST_KILL_LOG", str(path))
    return path


@pytest.fixture(scope="session")
def container_image(tmp_path_factory) -> str:
    """The project's image built from this tree (once per session, whatever the number of
    pytest-xdist workers); skips where podman cannot run it."""
    reason = podman_unusable()
    if reason is not None:
        pytest.skip(reason)
    base = tmp_path_factory.getbasetemp()
    # Every worker's base is a folder of the session's own (popen-gw0, ...): the lock goes there.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return build_image(once_in=str(shared))


@pytest.fixture
def containers(container_image):
    """Containers and volumes of the image for one test, removed afterwards even when it fails."""
    made = Containers(container_image)
    try:
        yield made
    finally:
        made.cleanup()
