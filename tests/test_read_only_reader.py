"""One writer (DESIGN invariant 16): a review that sees the root through a read-only
mount, or as a uid outside the store's group, gets ready answers, new commits,
holds, status and recorded uses, and writes nothing; the writer is a real
`serve` on loopback, the reader a real process in a mount namespace of its own
whose view of the root is read-only (`mount -o remount,bind,ro`, at the same
path, as a pod's readOnly volume is).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from checkoutcache.store.layout import RootPaths

from .helpers import TOKEN, Serve, run_cli, assert_checkout_matches, make_idle, marker, only_repo, settled, \
    store_snapshot, wait_until, walk, writers_only

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="a read-only view of the root needs root (CI runs as root) and unshare")


def reader(root: str, *args: str, env: dict | None = None, code: str | None = None,
           timeout: float = 120) -> tuple[int, dict | None, str]:
    """The CLI (or, with code, a Python snippet) in a mount namespace where root is read-only."""
    program = [sys.executable, "-c", code] if code else [sys.executable, "-m", "checkoutcache", "--root", root, *args]
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", root, *program]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKOUTCACHE_")}
    full_env.update(env or {})
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env)
    try:
        answer = json.loads(done.stdout) if done.stdout.strip().startswith("{") else None
    except ValueError:
        answer = None
    return done.returncode, answer, done.stderr + done.stdout


def snapshot_but_markers(root: str) -> dict:
    """Every entry under root but the markers' mtimes (the writer records uses there)."""
    # holds/: the writer registers the holds it makes for a reader (store/holds.py)
    return {path: (size, 0 if path.endswith("/checkoutcache-ready") else mtime, mode)
            for path, (size, mtime, mode) in store_snapshot(root).items()
            if not path[len(root):].lstrip("/").startswith("holds")}


@pytest.fixture
def writer(tmp_path, served_upstream):
    root = str(tmp_path / "cache")
    serve = Serve(root, tmp_path, env={"CHECKOUTCACHE_GC_INTERVAL": "1h", "CHECKOUTCACHE_LOG_FORMAT": "json"})
    yield serve
    serve.stop()


def through(serve: Serve) -> dict:
    return {"CHECKOUTCACHE_API_URL": f"http://127.0.0.1:{serve.port}", "CHECKOUTCACHE_API_TOKEN": TOKEN}


@pytest.mark.slow
def test_a_read_only_reader_gets_ready_answers_and_new_commits_through_the_writer(writer, served_upstream):
    """Regression: `ensure` of a ready checkout through a read-only mount answered ROOT_UNUSABLE
    (Read-only file system), and nothing could make a new commit there."""
    upstream, url = served_upstream
    first, second = upstream.shas[0], upstream.shas[1]
    status, body = writer.request("POST", "/v1/ensure", {"repo": url, "commit": first, "wait": 60})
    assert status == 200, body
    path = body["path"]
    make_idle(path, 3600)
    settled(writer.root)
    before = snapshot_but_markers(writer.root)
    code, answer, out = reader(writer.root, "ensure", url, first, env=through(writer))
    assert code == 0 and answer == {"state": "ready", "commit": first, "repo": url, "path": path,
                                    "history": "complete"}, out
    assert "not recorded" not in out, out
    assert time.time() - os.stat(marker(path)).st_mtime < 600, "the writer recorded the reader's use"
    assert snapshot_but_markers(writer.root) == before, "a ready answer wrote nothing but the writer's use"
    # A new commit: the writer clones it, the reader checks it on its own (read-only) view.
    code, answer, out = reader(writer.root, "ensure", url, second, "--wait", "60", env=through(writer))
    assert code == 0 and answer["state"] == "ready", out
    assert_checkout_matches(answer["path"], upstream.path, second)
    # The library, likewise.
    snippet = (f"import json; from checkoutcache import Cache; c = Cache({writer.root!r}); "
               f"a = c.ensure({url!r}, {upstream.shas[2]!r}, wait=60); print(json.dumps(a.to_json()))")
    code, answer, out = reader(writer.root, code=snippet, env=through(writer))
    assert code == 0 and answer["state"] == "ready", out
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[2])
    # status reads only.
    code, report, out = reader(writer.root, "status", env=through(writer))
    assert code == 0 and report["totals"]["checkouts"] == 3, out


@pytest.mark.slow
def test_a_read_only_readers_uses_order_eviction(writer, served_upstream):
    """Only read-only reviews ask: the LRU order still sees them. The checkout a reader asked
    for last survives a gc that keeps one."""
    upstream, url = served_upstream
    paths = {}
    for sha in upstream.shas[:2]:
        status, body = writer.request("POST", "/v1/ensure", {"repo": url, "commit": sha, "wait": 60})
        assert status == 200, body
        paths[sha] = body["path"]
        make_idle(body["path"], 7200)
    older, newer = upstream.shas[0], upstream.shas[1]
    make_idle(paths[older], 9000)  # by the writer's own record, `older` is the LRU one...
    code, answer, out = reader(writer.root, "ensure", url, older, env=through(writer))  # ...until a reader asks
    assert code == 0, out
    # cron's gc, the writer's uid (serve's own gc also protects what it answered lately, in memory)
    code, report, out = run_cli("gc", "--max-checkouts", "1", root=writer.root)
    assert code == 0, out
    assert [r["name"] for r in report["removed"]] == [newer], out
    assert os.path.isdir(paths[older])


@pytest.mark.slow
def test_exec_through_a_read_only_mount_holds_against_the_writers_gc(writer, served_upstream, tmp_path):
    upstream, url = served_upstream
    sha = upstream.shas[0]
    started, release = tmp_path / "started", tmp_path / "release"
    script = f"cat README.md > /dev/null && touch {started} && while [ ! -e {release} ]; do sleep 0.05; done"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKOUTCACHE_")}
    full_env.update(through(writer))
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"', "sh", writer.root,
               sys.executable, "-m", "checkoutcache", "--root", writer.root, "exec", url, sha, "--wait", "60", "--",
               "sh", "-c", script]
    proc = subprocess.Popen(command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: started.exists() or proc.poll() is not None, 90, "the command to start")
        assert started.exists(), proc.communicate()
        path = only_repo(writer.root).checkout(sha)
        settled(writer.root)  # the history's finish empties its scratch through trash/: not this test's
        make_idle(path, 7200)
        # cron's gc, the writer's uid: nothing but the reader's hold (a shared flock taken through
        # the read-only mount) keeps it (serve's gc would also remember answering it)
        code, report, out = run_cli("gc", "--max-checkouts", "0", root=writer.root)
        assert code == 0 and report["removed"] == [], out
        assert [(k["name"], k["why"]) for k in report["kept_over_limit"]] == [(sha, "held")], out
        assert os.path.isdir(path)
    finally:
        release.touch()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out, err)
    assert time.time() - os.stat(marker(path)).st_mtime < 600, "the end of the use was recorded by the writer"


def test_a_reader_without_a_writer_says_so_and_writes_nothing(writer, served_upstream):
    upstream, url = served_upstream
    status, body = writer.request("POST", "/v1/ensure", {"repo": url, "commit": upstream.shas[0], "wait": 60})
    assert status == 200, body
    settled(writer.root)
    before = store_snapshot(writer.root)
    # A ready checkout is still answered; the reader says its use went unrecorded.
    code, answer, out = reader(writer.root, "ensure", url, upstream.shas[0])
    assert code == 0 and answer["state"] == "ready", out
    assert "was not recorded" in out and "CHECKOUTCACHE_API_URL is not set" in out, out
    # A new commit cannot be made by a reader: NO_WRITER, what to do, nothing written.
    code, answer, out = reader(writer.root, "ensure", url, upstream.shas[1], "--wait", "5")
    assert code == 1 and answer["error"] == "NO_WRITER", out
    assert "CHECKOUTCACHE_API_URL" in answer["next"], answer
    assert store_snapshot(writer.root) == before


def test_published_checkouts_are_writable_by_the_writer_alone(writer, served_upstream):
    """Regression: a published checkout's content was group-writable (files 0664, directories
    2775): a review in the group could change what the next review is answered ready with."""
    upstream, url = served_upstream
    status, body = writer.request("POST", "/v1/ensure", {"repo": url, "commit": upstream.shas[0], "wait": 60})
    assert status == 200, body
    entries = [e for e in walk(writer.root) if not e.is_link]
    assert any(e.path.startswith(body["path"] + "/") and e.is_file for e in entries)
    writable = [e.path for e in entries if stat.S_IMODE(e.info.st_mode) & 0o022]
    # The sockets serve may listen on are the only exception (connecting takes write access).
    assert [p for p in writable if not stat.S_ISSOCK(os.lstat(p).st_mode)] == []


def _uid_outside_the_group() -> str:
    name = "ccreader"
    if subprocess.run(["id", name], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-M", "-N", "-s", "/bin/sh", name], capture_output=True)
    assert subprocess.run(["id", name], capture_output=True).returncode == 0
    return name


class Foreign:
    """A root under /tmp that another uid can reach (pytest's tmp_path is root's alone), and
    processes of that uid, outside the store's group, as a review's would be."""

    def __init__(self):
        self.base = tempfile.mkdtemp(prefix="ccwriter-", dir="/tmp")
        os.chmod(self.base, 0o755)
        self.root = os.path.join(self.base, "cache")
        self.user = _uid_outside_the_group()
        self.started: list[subprocess.Popen] = []

    def python(self, code: str, *args: str) -> subprocess.Popen:
        """python3 -c CODE ARGS as that uid: its stdin and stdout are pipes, and it is killed at
        the test's end."""
        proc = subprocess.Popen(["setpriv", f"--reuid={self.user}", "--regid=nogroup", "--clear-groups",
                                 sys.executable, "-c", code, *args],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.started:
            proc.kill()
            proc.wait()
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def foreign():
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is needed to run as another uid")
    made = Foreign()
    yield made
    made.close()


@pytest.mark.slow
def test_another_uid_outside_the_group_changes_nothing_in_the_store(served_upstream):
    """The writer's store (the default modes) against a review of another uid: it reads a
    checkout, may not change a file, add one, or replace a store directory with a symlink."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is needed to run as another uid")
    upstream, url = served_upstream
    base = tempfile.mkdtemp(prefix="ccwriter-", dir="/tmp")
    os.chmod(base, 0o755)
    root = os.path.join(base, "cache")
    try:
        done = subprocess.run([sys.executable, "-m", "checkoutcache", "--root", root, "ensure", url,
                               upstream.shas[0], "--wait", "60"], capture_output=True, text=True,
                              env={k: v for k, v in os.environ.items() if not k.startswith("CHECKOUTCACHE_")})
        assert done.returncode == 0, done.stderr + done.stdout
        path = json.loads(done.stdout)["path"]
        user = _uid_outside_the_group()
        paths = RootPaths(root).repo(os.path.basename(os.path.dirname(os.path.dirname(path))))
        attempts = [f"echo changed > {path}/README.md", f"touch {path}/planted", f"rm -f {path}/README.md",
                    f"chmod 0777 {path}", f"mv {paths.trash_dir} {paths.trash_dir}.x",
                    f"ln -s / {paths.base}/planted", f"touch {marker(path)}", f"touch {root}/planted"]
        settled(root)  # the worker's tidying and the history write the store after the answer
        before = store_snapshot(root)
        for attempt in attempts:
            done = subprocess.run(["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups", "sh", "-c",
                                   attempt], capture_output=True, text=True)
            assert done.returncode != 0, (attempt, done.stdout, done.stderr)
        assert store_snapshot(root) == before
        assert_checkout_matches(path, upstream.path, upstream.shas[0])
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_a_reader_keyed_otherwise_than_its_writer_is_told_so_once_and_never_loops(writer, served_upstream):
    """Issue 33: a reader whose CHECKOUTCACHE_LFS differs from the writer's (part of the store's
    key, not sent) was answered ready for a path it never found, and asked again at once:
    about 850 requests a second until --wait ended, the use never recorded."""
    repo, url = served_upstream
    env = {**through(writer), "CHECKOUTCACHE_LFS": "off"}
    asked = lambda: sum(1 for e in writer.json_lines() if e.get("endpoint") == "/v1/ensure")  # noqa: E731
    before = asked()
    code, answer, out = reader(writer.root, "--json", "ensure", url, repo.shas[0], "--wait", "30", env=env)
    assert code == 2 and answer["error"] == "SETTINGS_MISMATCH", out
    assert "CHECKOUTCACHE_LFS" in answer["message"] and answer["next"], answer
    wait_until(lambda: asked() > before, 10, "the writer's access line")
    assert asked() - before == 1, "asked once, not again and again"
    assert not os.path.isdir(os.path.join(writer.root, "repos")) or not os.listdir(os.path.join(writer.root, "repos"))


@pytest.mark.slow
def test_a_readers_exec_is_registered_with_the_writer_and_kept_past_the_bounds_on_readers(tmp_path, served_upstream):
    """Review finding: through a read-only mount an exec is a bare shared lock, which the bounds
    on readers' locks break (max-held 0 here). It registers its hold with the writer (a /v1/hold
    of serve's, renewed while it runs): serve's gc keeps it."""
    repo, url = served_upstream
    root = str(tmp_path / "cache")
    serve = Serve(root, tmp_path, env={"CHECKOUTCACHE_GC_INTERVAL": "1h", "CHECKOUTCACHE_MAX_HELD": "0",
                                       "CHECKOUTCACHE_MAX_SPARES": "0"})
    try:
        env = through(serve)
        code, answer, out = reader(root, "--json", "ensure", url, repo.shas[0], "--wait", "60", env=env)
        assert code == 0, out
        script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
        full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("CHECKOUTCACHE_")}, **env}
        exec_proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", root, sys.executable, "-m",
             "checkoutcache", "--root", root, "exec", url, repo.shas[0], "--", "sh", "-c", "echo running; sleep 600"],
            stdout=subprocess.PIPE, text=True, env=full_env, start_new_session=True)
        try:
            assert exec_proc.stdout.readline().strip() == "running"
            make_idle(answer["path"], 7200)
            status, report = serve.request("POST", "/v1/gc", {"max_checkouts": 0})
            assert status == 200, report
            assert [k["name"] for k in report["kept_over_limit"] if k["why"] == "held"] == [repo.shas[0]], report
            assert not [r for r in report["removed"] if r.get("broke_hold")], report
            assert os.path.isdir(answer["path"])
        finally:
            os.killpg(exec_proc.pid, signal.SIGKILL)
            exec_proc.wait()
    finally:
        serve.stop()


# A reader's attempt on every file it can open: flock each exclusive and keep it (as code under
# review may), print what it locked, then wait for stdin to close.
LOCK_WHAT_IT_CAN = r"""
import fcntl, json, os, sys
root, opened, locked, seen = sys.argv[1], [], [], 0
for directory, dirs, files in os.walk(root):
    for name in files:
        seen += 1
        relative = os.path.relpath(os.path.join(directory, name), root)
        try:  # an open descriptor is enough: a blocking flock on it waits for the holder's end
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            continue
        opened.append(relative)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked.append(relative)
        except OSError:
            pass
print(json.dumps({"seen": seen, "opened": opened, "locked": locked}), flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_reader_can_take_none_of_the_writers_locks(tmp_path, served_upstream, foreign):
    """Review of issue 33: flock needs no write access, and the writer's lock files were 0644, so
    a review of another uid took gc.lock (every gc "skipped: another gc is running" for as long
    as it liked), mirror.lock (every new commit of the repository waited out its timeout), a
    clone's lock (a `cloning` answer with no owner) or a dead holder's hold (its checkout kept
    past every bound). The writers-only directories are 0700 now, and gc gives an older
    store's directories that mode: shown here by first making them as an older version did."""
    upstream, url = served_upstream
    root = foreign.root
    serve = Serve(root, tmp_path, env={"CHECKOUTCACHE_GC_INTERVAL": "1h"})

    def lock_what_it_can() -> tuple[subprocess.Popen, dict]:
        holder = foreign.python(LOCK_WHAT_IT_CAN, root)
        return holder, json.loads(holder.stdout.readline())

    def gc(*args: str) -> dict:
        code, report, out = run_cli("gc", "--json", *args, root=root)
        assert code == 0, out
        return report

    try:
        for sha in upstream.shas[:2]:
            status, body = serve.request("POST", "/v1/ensure", {"repo": url, "commit": sha, "wait": 60})
            assert status == 200 and body["state"] == "ready", body
        status, held = serve.request("POST", "/v1/hold", {"repo": url, "commit": upstream.shas[0], "ttl": 600})
        assert status == 200, held
        settled(root)
        gc()  # its lock file is there
        paths = RootPaths(root)
        private = [*paths.private_dirs, *(d for key in paths.repo_keys() for d in paths.repo(key).private_dirs)]
        assert private and all(os.path.isdir(d) for d in private), private
        for directory in private:  # as an older version made them
            os.chmod(directory, 0o755)
        holder, before = lock_what_it_can()
        kinds = {p.split("/")[0] if not p.startswith("repos/") else p.split("/")[2] for p in before["opened"]
                 if writers_only(root, p)}
        assert kinds == {"locks", "holds", "serve"}, before  # the reader can do what the review found
        assert "locks/gc.lock" in before["locked"], before
        holder.communicate("")  # it lets go

        gc()  # the writer's next gc (or serve's start) makes them writers-only again
        assert {oct(stat.S_IMODE(os.stat(d).st_mode)) for d in private} == {oct(0o700)}
        _, after = lock_what_it_can()
        assert after["seen"] > 10, after
        assert [p for p in after["opened"] if writers_only(root, p)] == [], after
        # Holding all it could, the reader stops neither gc nor a new commit.
        report = gc("--max-checkouts", "0", "--grace", "0")
        assert report["skipped"] is None, report
        status, body = serve.request("POST", "/v1/ensure", {"repo": url, "commit": upstream.shas[2], "wait": 60})
        assert status == 200 and body["state"] == "ready", body
    finally:
        serve.stop()


HOLD_EXCLUSIVE = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # flock ignores the open mode
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_readers_exclusive_lock_on_a_marker_neither_stalls_ready_answers_nor_starts_clones(served_upstream, foreign):
    """Second review of issue 33 (finding 1): a review of another uid opened a ready checkout's
    marker read-only and took flock's exclusive lock (flock ignores the open mode): every ready
    answer of it waited out SHARED_LOCK_WAIT and answered not ready, so the writer started a
    clone worker every few seconds for a published commit, and another review's exec failed.
    The evictor's lock is also the description's write lock, which a read-only descriptor
    cannot take: a refused shared lock falls back to the description's read lock."""
    upstream, url = served_upstream
    root = foreign.root
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKOUTCACHE_")}
    sha = upstream.shas[0]
    code, answer, out = run_cli("ensure", url, sha, "--wait", "60", root=root)
    assert code == 0, out
    settled(root)
    path = answer["path"]
    log = only_repo(root).clone_log(sha)
    logged = open(log).read()
    holder = foreign.python(HOLD_EXCLUSIVE, marker(path))
    assert holder.stdout.readline().strip() == "held"
    for _ in range(3):
        code, again, out = run_cli("ensure", url, sha, "--wait", "0", root=root)
        assert code == 0 and again["state"] == "ready" and again["path"] == path, out
    from checkoutcache import Cache

    assert Cache(root).ensure(url, sha).state == "ready"
    code, _, out = run_cli("exec", url, sha, "--", "sh", "-c", "test -f README.md", root=root)
    assert code == 0, out
    assert open(log).read() == logged, "no clone was started for the published commit"
    # gc sees the reader's lock (a hold, bounded as every reader's is) and moves nothing
    # under it with its exclusive lock.
    code, report, out = run_cli("gc", "--grace", "0", "--max-checkouts", "0", root=root, env=env)
    assert code == 0 and [k["why"] for k in report["kept_over_limit"]] == ["held"], out


@pytest.mark.slow
def test_serve_makes_an_older_stores_writers_only_directories_so_at_its_start(tmp_path, served_upstream, foreign):
    """Second review of issue 33 (finding 3): the repositories' writers-only directories were made
    so only by gc, under gc.lock; a review holding an old descriptor of gc.lock (opened before
    the upgrade) kept every gc, and so that change, from happening, and went on opening the
    repositories' lock files. serve makes them so at its start, gc or no gc."""
    upstream, url = served_upstream
    root = foreign.root
    code, _, out = run_cli("ensure", url, upstream.shas[0], "--wait", "60", root=root)
    assert code == 0, out
    settled(root)
    assert run_cli("gc", root=root)[0] == 0
    paths = RootPaths(root)
    private = [*paths.private_dirs, *(d for key in paths.repo_keys() for d in paths.repo(key).private_dirs)]
    for directory in private:  # as an older version made them
        if os.path.isdir(directory):
            os.chmod(directory, 0o755)
    holder = foreign.python(HOLD_EXCLUSIVE, paths.gc_lock)
    assert holder.stdout.readline().strip() == "held"
    assert run_cli("gc", root=root)[1]["skipped"], "the old descriptor keeps gc from running"
    serve = Serve(root, tmp_path, env={"CHECKOUTCACHE_GC_INTERVAL": "1h"})
    try:
        modes = {d: oct(stat.S_IMODE(os.stat(d).st_mode)) for d in private if os.path.isdir(d)}
        assert len(modes) >= 3 and set(modes.values()) == {oct(0o700)}, modes
    finally:
        serve.stop()
