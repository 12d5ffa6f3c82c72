"""The private view network git runs in (checkoutcache/git/view.py), with real git:
what a fetch does through it lands in the mirror, a packed ref's deletion included."""

from __future__ import annotations

import os
import subprocess
import time

from checkoutcache.git.env import git_env
from checkoutcache.git.view import private_view

from .helpers import Upstream, git


def test_a_prune_through_the_view_deletes_a_packed_ref_in_the_mirror(tmp_path):
    upstream = Upstream(str(tmp_path / "upstream"))
    upstream.commit({"a.txt": "a\n"})
    git("branch", "doomed", cwd=upstream.path)
    mirror = str(tmp_path / "mirror.git")
    git("init", "-q", "--bare", mirror, cwd=str(tmp_path))
    git("fetch", "-q", upstream.path, "+refs/heads/*:refs/heads/*", cwd=mirror)
    git("pack-refs", "--all", cwd=mirror)  # as gc leaves them: no loose ref to delete
    assert "refs/heads/doomed" in open(os.path.join(mirror, "packed-refs")).read()
    git("branch", "-D", "doomed", cwd=upstream.path)
    new = upstream.commit({"b.txt": "b\n"})

    with private_view(mirror) as view:
        done = subprocess.run(["git", "-C", view, "fetch", "-q", "--prune", "--no-write-fetch-head", upstream.path,
                               "+refs/heads/*:refs/heads/*"], capture_output=True, text=True, env=git_env(), cwd="/")
        assert done.returncode == 0, done.stderr
    assert not os.path.exists(view)  # removed whatever happened
    refs = git("for-each-ref", "--format=%(refname) %(objectname)", cwd=mirror)
    assert "refs/heads/doomed" not in refs and new in refs, refs
    assert not os.path.exists(os.path.join(mirror, "packed-refs.lock"))
    assert git("cat-file", "-t", new, cwd=mirror) == "commit"  # the objects went to the mirror's store


def test_a_view_a_killed_process_left_is_removed_by_the_next(tmp_path):
    import tempfile

    dead = subprocess.Popen(["true"])
    dead.wait()
    left = os.path.join(tempfile.gettempdir(), f"checkoutcache-view-{dead.pid}-x")
    os.makedirs(os.path.join(left, "sub"))
    hours_ago = time.time() - 7 * 3600
    os.utime(left, (hours_ago, hours_ago))
    young = os.path.join(tempfile.gettempdir(), f"checkoutcache-view-{dead.pid}-z")  # another namespace's, maybe
    os.makedirs(young)
    mine = os.path.join(tempfile.gettempdir(), f"checkoutcache-view-{os.getpid()}-y")
    os.makedirs(mine)
    mirror = str(tmp_path / "mirror.git")
    git("init", "-q", "--bare", mirror, cwd=str(tmp_path))
    with private_view(mirror):
        pass
    assert not os.path.exists(left) and os.path.exists(mine)  # a live process's view stays
    assert os.path.exists(young)  # and a young one, whose pid may be another namespace's
    os.rmdir(mine)
    os.rmdir(young)



HOLD_A_VIEW = """
import sys, time
from checkoutcache.git.view import private_view
with private_view(sys.argv[1]) as view:
    print(view, flush=True)
    time.sleep(600)
"""


def test_a_killed_fetchs_view_is_removed_at_once_and_a_live_ones_stays(tmp_path):
    """Regression (issue 27): views killed fetches left stayed 6 h (20 of them in /tmp). The owner
    lock proves the owner gone however young the view is; a live owner's view is never taken."""
    import signal
    import sys

    mirror = str(tmp_path / "mirror.git")
    git("init", "-q", "--bare", mirror, cwd=str(tmp_path))
    holders = [subprocess.Popen([sys.executable, "-c", HOLD_A_VIEW, mirror], stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        killed_view, live_view = (holder.stdout.readline().strip() for holder in holders)
        assert os.path.isfile(os.path.join(killed_view, "owner.lock"))
        holders[0].send_signal(signal.SIGKILL)
        assert holders[0].wait() == -signal.SIGKILL  # the kill happened: its finally never ran
        assert os.path.isdir(killed_view)
        with private_view(mirror):
            pass
        assert not os.path.exists(killed_view)  # seconds old, and gone
        assert os.path.isdir(live_view) and os.path.isdir(os.path.join(live_view, "objects"))
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def test_the_suites_tmp_check_judges_its_own_views_only(tmp_path, tmp_path_factory):
    """Regression (issue 27): the session's check for leftovers in /tmp failed a newcomer's run on
    the views another checkoutcache program (a serve beside the suite) had left there. A view
    names the mirror it showed: one of this session's counts, another program's does not."""
    from .conftest import _session_base, whose_view

    mirror = str(tmp_path / "mirror.git")
    git("init", "-q", "--bare", mirror, cwd=str(tmp_path))
    base = _session_base(tmp_path_factory)
    with private_view(mirror) as view:
        assert whose_view(view, base) == "ours"
    theirs = tmp_path / "checkoutcache-view-1-theirs"
    theirs.mkdir()
    os.symlink("/var/lib/another-cache/repos/x/mirror.git/objects", theirs / "objects")
    assert whose_view(str(theirs), base) == "theirs"
    empty = tmp_path / "checkoutcache-view-2-empty"
    empty.mkdir()
    assert whose_view(str(empty), base) == "unknown"  # warned about, never failed on
