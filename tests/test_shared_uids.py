"""Several uids in one group share a root in the trusted-peers mode
(CHECKOUTCACHE_SHARING=group), with real users made by the test (useradd) and
processes run as them.

The second user gets CAP_DAC_READ_SEARCH only so it can run this machine's
Python under /root; every write it makes is still checked against the store's
modes, which is what these tests are about.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from checkoutcache.store.layout import RootPaths

from .helpers import assert_checkout_matches, settled, walk

USER, GROUP = "ccother", "ccshare"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="a second uid needs root (CI runs as root) and setpriv")


def made_once(exists: list[str], make: list[str]) -> None:
    """Run make unless exists succeeds. Another process (a pytest-xdist worker, another session)
    may make the same group or user at the same moment, or hold the lock on /etc/passwd: then
    ours fails, and what counts is that it exists afterwards."""
    for _ in range(100):
        if subprocess.run(exists, capture_output=True).returncode == 0:
            return
        if subprocess.run(make, capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"{make} did not make what {exists} looks for")


@pytest.fixture(scope="module")
def second_user():
    made_once(["getent", "group", GROUP], ["groupadd", GROUP])
    made_once(["id", USER], ["useradd", "-M", "-N", "-g", GROUP, "-s", "/bin/sh", USER])
    return USER


@pytest.fixture
def shared_root():
    """A root in a setgid directory of the shared group. pytest's own tmp dirs
    are private to root (0700), so this one is made beside them and removed."""
    # /tmp itself: pytest's tmp dirs (and TMPDIR) are private to root, and the other uid must get in.
    base = tempfile.mkdtemp(prefix="ccshared-", dir="/tmp")
    os.chown(base, 0, grp.getgrnam(GROUP).gr_gid)
    os.chmod(base, 0o2775)
    yield os.path.join(base, "cache")
    shutil.rmtree(base, ignore_errors=True)


def cli(root: str, *args: str, user: str | None = None, umask: str = "002",
        capless: bool = False) -> tuple[int, dict | None, str]:
    """The CLI as root, as the second user, or as root without any capability (capless: the
    file modes bind it as they bind any peer, so a peer's chmod can really keep it out)."""
    command = ["sh", "-c", f'umask {umask} && exec "$@"', "sh", sys.executable, "-m", "checkoutcache",
               "--root", root, *args]
    if capless:
        gid = str(grp.getgrnam(GROUP).gr_gid)
        command = ["setpriv", "--regid", gid, "--groups", gid, "--securebits", "+noroot,+noroot_locked",
                   "--bounding-set", "-all", "--inh-caps", "-all", *command]
    elif user is not None:
        command = ["setpriv", f"--reuid={user}", f"--regid={GROUP}", "--init-groups",
                   "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", *command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKOUTCACHE_")}
    env["HOME"] = "/nonexistent"
    env["CHECKOUTCACHE_SHARING"] = "group"  # the trusted-peers mode: every member writes the store
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    try:
        answer = json.loads(done.stdout) if done.stdout.strip().startswith("{") else None
    except ValueError:
        answer = None
    return done.returncode, answer, done.stderr + done.stdout


@pytest.mark.slow
def test_two_uids_in_one_group_ensure_exec_gc_and_status(second_user, shared_root, served_upstream):
    upstream, url = served_upstream
    first, second = upstream.shas[0], upstream.shas[1]
    code, answer, out = cli(shared_root, "ensure", url, first, "--wait", "60")
    assert code == 0, out
    settled(shared_root)  # its history complete: no trash of its own beside gc's at the end
    # The other uid: a ready answer that records its use (the marker's mtime moves).
    marker = RootPaths(shared_root).repo(os.path.basename(os.path.dirname(os.path.dirname(answer["path"])))) \
        .ready_marker(first)
    os.utime(marker, (1, 1))
    code, answer, out = cli(shared_root, "ensure", url, first, user=second_user)
    assert code == 0 and answer["state"] == "ready", out
    assert os.stat(marker).st_mtime > 1, "the other uid's use was recorded"
    # It starts a clone of its own in the shared store, and root can use it.
    code, answer, out = cli(shared_root, "ensure", url, second, "--wait", "60", user=second_user)
    assert code == 0, out
    assert_checkout_matches(answer["path"], upstream.path, second)
    code, _, out = cli(shared_root, "exec", url, second, "--", "sh", "-c", "cat README.md && echo used-by-root")
    assert code == 0 and "used-by-root" in out, out
    code, report, out = cli(shared_root, "status", user=second_user)
    assert code == 0 and report["totals"]["checkouts"] == 2, out
    # gc as the other uid evicts what root made too, and leaves nothing behind.
    code, report, out = cli(shared_root, "gc", "--max-checkouts", "0", "--grace", "0", user=second_user)
    assert code == 0, out
    assert sorted(r["name"] for r in report["removed"] if r["reason"] == "lru") == sorted([first, second])
    (key,) = RootPaths(shared_root).repo_keys()
    paths = RootPaths(shared_root).repo(key)
    assert os.listdir(paths.checkouts_dir) == [] and os.listdir(paths.trash_dir) == []


def test_a_use_that_cannot_be_recorded_is_still_a_ready_answer(second_user, shared_root, served_upstream):
    upstream, url = served_upstream
    sha = upstream.shas[0]
    # Root made the checkout with umask 022: the other uid may read but not write the marker.
    code, answer, out = cli(shared_root, "ensure", url, sha, "--wait", "60", umask="022")
    assert code == 0, out
    path = answer["path"]
    code, answer, out = cli(shared_root, "ensure", url, sha, user=second_user)
    assert code == 0 and answer == {"state": "ready", "commit": sha, "repo": url, "path": path,
                                    "history": answer.get("history")}, out
    assert answer["history"] in ("shallow", "complete")  # the other uid reads the mirror's boundary too


@pytest.mark.slow
def test_a_store_made_under_umask_022_is_shared_by_construction(second_user, shared_root, served_upstream):
    """Regression: a sidecar with no umask set (a container image's 022) wrote 0644 files and
    0755 directories; every `status` and `gc` of another uid of the group answered INTERNAL_ERROR
    (PermissionError opening a marker), and its clones of new commits failed on the lock files."""
    upstream, url = served_upstream
    first, second = upstream.shas[0], upstream.shas[1]
    code, answer, out = cli(shared_root, "ensure", url, first, "--wait", "60", umask="022")
    assert code == 0, out
    for entry in walk(shared_root):
        if entry.is_dir:
            assert stat.S_IMODE(entry.info.st_mode) & 0o070 == 0o070, entry.path
        elif entry.is_file and "/checkouts/" not in entry.path and "/objects/" not in entry.path:
            assert stat.S_IMODE(entry.info.st_mode) & 0o060 == 0o060, entry.path
    for args in (("status",), ("gc",), ("verify",), ("ensure", url, second, "--wait", "60")):
        code, report, out = cli(shared_root, *args, user=second_user, umask="022")
        assert code == 0, (args, out)
        assert "INTERNAL_ERROR" not in out
    # root (the sidecar) uses the other uid's clone
    code, answer, out = cli(shared_root, "ensure", url, second, umask="022")
    assert code == 0 and answer["state"] == "ready", out
    assert_checkout_matches(answer["path"], upstream.path, second)


@pytest.mark.slow
def test_an_entry_a_peer_made_unreadable_costs_that_entry_never_the_run(second_user, shared_root, served_upstream):
    """A peer's `chmod 600` of its marker and of a record, `chmod 000` of a checkout's .git, and
    a record that fits no schema: status and gc of another uid (here root without any
    capability: the modes bind it) list each, with its errno, and go on with the rest."""
    upstream, url = served_upstream
    shas = upstream.shas
    paths = {}
    for sha in shas:
        code, answer, out = cli(shared_root, "ensure", url, sha, "--wait", "60", user=second_user)
        assert code == 0, out
        paths[sha] = answer["path"]
    (key,) = RootPaths(shared_root).repo_keys()
    store = RootPaths(shared_root).repo(key)
    os.chmod(store.ready_marker(shas[0]), 0o600)
    os.chmod(store.size_record(shas[1]), 0o600)
    os.chmod(os.path.join(paths[shas[2]], ".git"), 0o000)
    with open(store.failure_record("f" * 40), "w") as handle:
        json.dump({"code": "NO_SUCH_CODE", "message": "x", "next": "x", "attempts": "many",
                   "failed_at": 1.0, "retry_at": 2.0}, handle)  # a record that fits no schema
    try:
        code, report, out = cli(shared_root, "status", capless=True)
        assert code == 0, out
        problems = {(p["path"].split("/")[-1], p["error"]) for p in report["repos"][0]["problems"]}
        assert ("checkoutcache-ready", "EACCES") in problems, problems
        assert (f"{shas[1]}.size.json", "EACCES") in problems, problems
        assert (f"{'f' * 40}.failed.json", "INVALID") in problems, problems
        assert report["repos"][0]["failures"] == []  # a bad record counts as absent
        # Asking for the commit whose marker it may not read: what and where, not a traceback.
        code, answer, out = cli(shared_root, "ensure", url, shas[0], capless=True)
        assert code == 1 and answer["error"] == "ROOT_UNUSABLE" and "checkoutcache-ready" in answer["message"], out
        code, report, out = cli(shared_root, "gc", "--max-checkouts", "0", "--grace", "0", capless=True)
        assert code == 0, out
        assert report["problems"], report
        # What it could not read it left where it was.
        assert os.path.isdir(paths[shas[2]]) and os.path.isdir(paths[shas[0]])
    finally:
        os.chmod(os.path.join(paths[shas[2]], ".git"), 0o2775)
