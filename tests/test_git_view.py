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

