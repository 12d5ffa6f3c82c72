"""The coordinator in process (checkoutcache.clone.coordinator), driven
directly against a real repository in tmp_path, without the CLI: each branch
of step() from a store set up by hand (clone lock, clone record, failure
record), so each answer is deterministic."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from checkoutcache import Cache
from checkoutcache.answers import State
from checkoutcache.clone.coordinator import Coordinator
from checkoutcache.clone.decide import MAX_DEATHS
from checkoutcache.config import Config
from checkoutcache.clone.spawn import worker_starter
from checkoutcache.repospec import parse_repo
from checkoutcache.store import locks, records
from checkoutcache.store.layout import RootPaths
from checkoutcache.store.records import Failure, read_failure

from .helpers import assert_checkout_matches, files_under, only_repo, pid_alive


@pytest.fixture
def coordinator(root, upstream):
    """A coordinator for upstream's second commit, after first contact (the store exists, nothing else)."""
    def make(sha: str | None = None) -> Coordinator:
        return Coordinator(RootPaths(root), Config.from_env({}), parse_repo(upstream.path), sha or upstream.shas[1],
                           worker_starter())
    made = make()
    made.first_contact()
    assert os.path.isfile(made.paths.repo_json)
    made.make = make
    return made


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)
    return child.pid


def test_a_published_checkout_is_answered_ready(root, upstream, coordinator):
    sha = upstream.shas[1]
    assert Cache(root).ensure(upstream.path, sha, wait=60).state == "ready"
    answer = coordinator.step()
    assert answer.state == State.READY and answer.path == coordinator.paths.checkout(sha)
    assert answer.commit == sha and answer.repo == coordinator.spec.url
    assert_checkout_matches(answer.path, upstream.path, sha)


def test_a_clone_lock_held_by_someone_else_answers_cloning_with_its_owner(coordinator):
    paths, sha = coordinator.paths, coordinator.sha
    held = locks.try_lock(paths.clone_lock(sha))  # another open file: the coordinator's try fails
    assert held is not None
    try:
        started = time.time()
        records.write_json(paths.clone_record(sha), {"pid": os.getpid(), "started_at": started, "commit": sha,
                                                      "progress": {"phase": "fetching"}, "deaths": 0})
        answer = coordinator.step()
        assert answer.state == State.CLONING and answer.pid == os.getpid()
        assert answer.progress == {"phase": "fetching"} and answer.started_at.endswith("Z")
        assert answer.exit_code == 75
    finally:
        held.release()
    # Nothing was started and nothing recorded on the owner's behalf.
    assert records.read_json(paths.clone_record(sha))["pid"] == os.getpid()
    assert not os.path.exists(paths.failure_record(sha))
    assert files_under(paths.scratch_dir) == []


def test_a_recorded_failure_within_its_back_off_answers_failed_with_retry_after(coordinator):
    paths, sha = coordinator.paths, coordinator.sha
    now = time.time()
    failure = Failure(code="UNREACHABLE", message="could not reach it", next="check the network", attempts=2,
                      failed_at=now, retry_at=now + 100)
    records.write_json(paths.failure_record(sha), failure.to_record())
    answer = coordinator.step()
    assert answer.state == State.FAILED and answer.error == "UNREACHABLE"
    assert answer.message == "could not reach it" and answer.next == "check the network"
    assert 95 <= answer.retry_after <= 100
    assert answer.exit_code == 1
    # Backing off starts no clone: no clone record, no scratch, no lock left held.
    assert not os.path.exists(paths.clone_record(sha))
    assert files_under(paths.scratch_dir) == []
    assert not locks.is_locked(paths.clone_lock(sha))


def test_a_dead_owner_record_at_the_last_death_gives_worker_died(coordinator):
    paths, sha = coordinator.paths, coordinator.sha
    # The record a third worker in a row left when it died: the two before it died too.
    records.write_json(paths.clone_record(sha), {"pid": dead_pid(), "started_at": time.time() - 5, "commit": sha,
                                                  "progress": {"phase": "checking out"},
                                                  "deaths": MAX_DEATHS - 1})
    answer = coordinator.step()
    assert answer.state == State.FAILED and answer.error == "WORKER_DIED"
    assert f"{MAX_DEATHS} times" in answer.message
    backoff = coordinator.config.backoff
    assert backoff - 1 <= answer.retry_after <= backoff + 1
    # The dead owner's record is gone and the failure recorded, so the next look backs off.
    assert not os.path.exists(paths.clone_record(sha))
    recorded = read_failure(paths.failure_record(sha))
    assert recorded.code == "WORKER_DIED" and recorded.attempts == 1
    again = coordinator.step()
    assert again.state == State.FAILED and again.error == "WORKER_DIED"
    assert files_under(paths.scratch_dir) == []


def test_a_dead_owner_record_before_the_last_death_starts_a_clone_counting_it(coordinator, upstream):
    paths, sha = coordinator.paths, coordinator.sha
    records.write_json(paths.clone_record(sha), {"pid": dead_pid(), "started_at": time.time() - 5, "commit": sha,
                                                  "deaths": 0})
    answer = coordinator.step()
    assert answer.state == State.CLONING and answer.pid and answer.pid != os.getpid()
    assert records.read_json(paths.clone_record(sha))["deaths"] == 1
    ready = coordinator.run(wait=60)
    assert ready.state == State.READY
    assert_checkout_matches(ready.path, upstream.path, sha)


def test_a_waiter_wakes_on_the_state_directory_not_by_polling(tmp_path):
    """The watch returns as soon as a record appears or goes in state/, long before its timeout."""
    import threading
    import time

    from checkoutcache.store.watch import StateWatch

    state = tmp_path / "state"
    state.mkdir()
    with StateWatch(str(state)) as watch:
        assert watch.fd >= 0, "inotify is available on Linux"
        threading.Timer(0.1, lambda: os.replace(tmp_path / "x.tmp", state / "abc.failed.json")).start()
        (tmp_path / "x.tmp").write_text("{}")
        started = time.monotonic()
        watch.wait(30)
        assert time.monotonic() - started < 10, "woken by the rename, not by the timeout"


@pytest.mark.slow
def test_a_waiter_that_polls_first_sees_a_change_at_once_then_watches(tmp_path):
    """The CLI's wait polls its first second (a watch's close costs a kernel grace period at
    the end of every answer), then watches: a change is seen within a poll either way."""
    import threading
    import time

    from checkoutcache.store.watch import StateWatch

    state = tmp_path / "state"
    state.mkdir()
    created = time.monotonic()
    with StateWatch(str(state), poll_first=2.0) as watch:
        for _ in range(3):
            polling = time.monotonic() < created + 2.0
            started = time.monotonic()
            watch.wait(30)
            assert time.monotonic() - started < 10, "a poll is short, whatever the timeout"
            if polling and time.monotonic() < created + 2.0:
                assert watch.fd < 0, "no watch while polling"
        time.sleep(max(0.0, created + 2.0 - time.monotonic()))
        watch.wait(30)  # the first wait past the polling makes the watch, and returns for a look
        assert watch.fd >= 0, "watching after poll_first"
        threading.Timer(0.1, lambda: (state / "abc.failed.json").write_text("{}")).start()
        woke = time.monotonic()
        watch.wait(30)
        assert time.monotonic() - woke < 10, "woken by the change, not by the timeout"
    assert watch.fd < 0


def test_a_host_process_closes_its_watches_aside(tmp_path):
    """serve's waiters answer before their watch is closed (its close waits for a kernel grace
    period): a thread of the process closes it; a child forked from that process, which has
    no such thread, closes its own at once."""
    import time

    from checkoutcache.store.watch import StateWatch

    def is_open(fd: int) -> bool:
        try:
            os.fstat(fd)
            return True
        except OSError:
            return False

    watch = StateWatch(str(tmp_path), close_aside=True)
    fd = watch.fd
    assert fd >= 0 and is_open(fd)
    watch.close()
    assert watch.fd == -1
    deadline = time.monotonic() + 10
    while is_open(fd) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not is_open(fd), "closed by the closing thread"
    child = os.fork()
    if child == 0:  # a forked child: the closing thread did not come along
        code = 1
        try:
            inherited = StateWatch(str(tmp_path), close_aside=True)
            its_fd = inherited.fd
            inherited.close()
            code = 0 if its_fd >= 0 and not is_open(its_fd) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child closed its own watch at once"


def test_a_clone_lock_held_without_a_live_owner_never_answers_cloning_without_one(root, upstream):
    """gc holds a commit's clone lock for a moment with no clone record (or a dead
    owner's): an asker waits for the lock instead of answering `cloning` with no owner."""
    import threading
    import time

    from checkoutcache import Cache
    from checkoutcache.store import locks, records

    sha = upstream.shas[1]
    cache = Cache(root)
    assert cache.ensure(upstream.path, upstream.shas[0], wait=60).state == "ready"  # the store exists
    store = only_repo(root)
    records.write_json(store.clone_record(sha), {"pid": 999999, "pid_start": 1.0,
                                                 "pidns": os.readlink("/proc/self/ns/pid")})  # a dead owner's
    held = locks.clone_of(store, sha)
    assert held is not None
    threading.Timer(0.2, held.release).start()  # as gc's tidy does, briefly
    started = time.monotonic()
    answer = cache.ensure(upstream.path, sha)
    assert answer.state == "cloning" and answer.pid not in (None, 999999), answer
    assert time.monotonic() - started >= 0.15, "it waited for the lock to go free"
    assert cache.ensure(upstream.path, sha, wait=60).state == "ready"
