"""Several uids in one group share a root (a sidecar and review containers),
with real users made by the test (useradd) and processes run as them.

The second user gets CAP_DAC_READ_SEARCH only so it can run this machine's
Python under /root; every write it makes is still checked against the store's
modes, which is what these tests are about.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from checkoutcache.store.layout import RootPaths

from .helpers import assert_checkout_matches

USER, GROUP = "ccother", "ccshare"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="a second uid needs root (CI runs as root) and setpriv")


@pytest.fixture(scope="module")
def second_user():
    if subprocess.run(["getent", "group", GROUP], capture_output=True).returncode != 0:
        subprocess.run(["groupadd", GROUP], check=True)
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-M", "-N", "-g", GROUP, "-s", "/bin/sh", USER], check=True)
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


def cli(root: str, *args: str, user: str | None = None, umask: str = "002") -> tuple[int, dict | None, str]:
    command = ["sh", "-c", f'umask {umask} && exec "$@"', "sh", sys.executable, "-m", "checkoutcache",
               "--root", root, *args]
    if user is not None:
        command = ["setpriv", f"--reuid={user}", f"--regid={GROUP}", "--init-groups",
                   "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", *command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKOUTCACHE_")}
    env["HOME"] = "/nonexistent"
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    try:
        answer = json.loads(done.stdout) if done.stdout.strip().startswith("{") else None
    except ValueError:
        answer = None
    return done.returncode, answer, done.stderr + done.stdout


def test_two_uids_in_one_group_ensure_exec_gc_and_status(second_user, shared_root, served_upstream):
    upstream, url = served_upstream
    first, second = upstream.shas[0], upstream.shas[1]
    code, answer, out = cli(shared_root, "ensure", url, first, "--wait", "60")
    assert code == 0, out
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
    assert code == 0 and answer == {"state": "ready", "commit": sha, "repo": url, "path": path}, out
