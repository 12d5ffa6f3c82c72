"""gc, status and exec through the CLI against real repositories (invariants
3, 4, 7 and the limits gc enforces)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from checkoutcache import Cache
from checkoutcache.store.layout import RootPaths
from checkoutcache.store.liveness import own_identity

from .helpers import (
    Upstream,
    assert_checkout_matches,
    git,
    make_idle,
    marker,
    only_repo,
    pid_alive,
    run_cli,
    settled,
    store_snapshot,
    wait_ready,
    wait_until,
)


def gc(root: str, *args: str, env: dict | None = None) -> dict:
    code, report, err = run_cli("gc", *args, root=root, env=env)
    assert code == 0, err
    return report


@pytest.fixture
def three_ready(root, upstream):
    paths = [wait_ready(root, upstream.path, sha)["path"] for sha in upstream.shas]
    settled(root)  # gc's mirror maintenance is judged on the mirror the history finished (clone/history.py)
    return upstream, paths


@pytest.fixture(scope="module")
def three_idle_shared(tmp_path_factory):
    """A store with three idle checkouts, shared by tests that must leave it unchanged."""
    base = tmp_path_factory.mktemp("three-idle")
    upstream = Upstream(str(base / "upstream"))
    upstream.standard_history()
    root = str(base / "cache")
    for sha in upstream.shas:
        make_idle(wait_ready(root, upstream.path, sha)["path"], 3600)
    settled(root)  # the store the tests snapshot is the one the clones finished with
    return root


@pytest.mark.slow
def test_lru_order_follows_the_sequence_of_ensures(root, three_ready):
    upstream, paths = three_ready
    for index, path in enumerate(paths):
        make_idle(path, 3600 - index * 60)  # shas[0] oldest ... shas[2] newest
    run_cli("ensure", upstream.path, upstream.shas[0], root=root)  # a use makes it the newest
    make_idle(paths[0], 1000)
    report = gc(root, "--max-checkouts", "1", "--grace", "5m", "--max-spares", "1")
    removed = [r["name"] for r in report["removed"] if r["reason"] == "lru"]
    assert removed == [upstream.shas[1], upstream.shas[2]]
    assert os.path.isdir(paths[0]) and not os.path.exists(paths[1]) and not os.path.exists(paths[2])
    # One tree is kept as a spare (the newest evicted), the other deleted.
    assert [(r["name"], r["reason"]) for r in report["removed"] if r["reason"] == "spare"] == [(upstream.shas[1],
                                                                                                "spare")]
    assert [name for _, name in only_repo(root).spare_entries()] == [upstream.shas[2]]
    assert report["bytes_freed"] > 0


@pytest.mark.slow
def test_a_checkout_used_a_moment_ago_survives_max_checkouts_zero(root, three_ready):
    upstream, paths = three_ready
    for path in paths[1:]:
        make_idle(path, 3600)
    report = gc(root, "--max-checkouts", "0")  # default grace: 15 minutes
    assert os.path.isdir(paths[0])
    kept = {k["commit"]: k["why"] for k in report["kept_over_limit"]}
    assert kept == {upstream.shas[0]: "grace"}
    (unmet,) = report["unmet"]
    assert {k: unmet[k] for k in ("limit", "target", "actual", "short", "kept")} == {
        "limit": "max-checkouts", "target": 0, "actual": 1, "short": 1, "kept": {"grace": 1}}
    assert "grace" in unmet["why"] and "evict" in unmet["next"]  # what an operator needs (issue 27)


@pytest.mark.slow
def test_dry_run_changes_nothing(root, three_ready):
    upstream, paths = three_ready
    for path in paths:
        make_idle(path, 3600)
    before = sorted(os.listdir(only_repo(root).checkouts_dir))
    report = gc(root, "--max-checkouts", "0", "--dry-run")
    assert report["dry_run"] and len([r for r in report["removed"] if r["reason"] == "lru"]) == 3
    assert sorted(os.listdir(only_repo(root).checkouts_dir)) == before
    refs = git("for-each-ref", "--format=%(refname)", "refs/keep/", cwd=only_repo(root).mirror)
    assert len(refs.split()) == 3


@pytest.mark.slow
def test_an_exec_held_checkout_survives_until_the_command_ends(root, three_ready, tmp_path):
    upstream, paths = three_ready
    flag, release = tmp_path / "started", tmp_path / "release"
    # The command runs until the test releases it (bounded: 30 s), not for a fixed time.
    command = f"touch {flag}; i=0; while [ ! -e {release} ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; " \
              "cat README.md"
    proc = subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", root, "exec", upstream.path,
                             upstream.shas[0], "--", "sh", "-c", command], stdout=subprocess.PIPE, text=True)
    wait_until(flag.exists, 30, "the exec'd command to start")
    make_idle(paths[0], 10 * 24 * 3600)
    report = gc(root, "--max-checkouts", "0", "--grace", "0")
    assert {k["commit"]: k["why"] for k in report["kept_over_limit"]} == {upstream.shas[0]: "held"}
    assert os.path.isdir(paths[0])
    assert proc.poll() is None, "the command was still running during gc"
    release.touch()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "version 0" in out
    status = run_cli("status", root=root)[1]
    assert status["repos"][0]["checkouts"][0]["held"] is False
    make_idle(paths[0], 3600)
    gc(root, "--max-checkouts", "0", "--grace", "0")
    assert not os.path.exists(paths[0])


def test_exec_passes_exit_status_and_runs_in_the_checkout(root, upstream):
    code, _, out = run_cli("exec", upstream.path, upstream.shas[1], "--", "sh", "-c", "git log -1 --format=%H; exit 7",
                           root=root)
    assert code == 7 and upstream.shas[1] in out
    code, _, out = run_cli("exec", upstream.path, "nothex", "--", "true", root=root)
    assert code == 125 and "BAD_COMMIT" in out


@pytest.mark.slow
def test_a_killed_gc_leaves_trash_that_the_next_gc_finishes(root, three_ready, kill_log):
    upstream, paths = three_ready
    make_idle(paths[0], 3600)
    # (no spares: the eviction into trash/ is what is killed; tests/test_spares.py kills gc's sparing)
    code, _, _ = run_cli("gc", "--max-checkouts", "2", "--max-spares", "0", root=root,
                         env={"CHECKOUTCACHE_TEST_KILL_AT": "gc-after-evict-rename"})
    assert code == -9
    (line,) = kill_log.read_text().splitlines()  # it died at that step, not anywhere else
    assert line.split()[0] == "gc-after-evict-rename" and not pid_alive(int(line.split()[1]))
    trash = os.listdir(only_repo(root).trash_dir)
    assert len(trash) == 1 and upstream.shas[0] in trash[0]
    assert not os.path.exists(paths[0])  # renamed away first: no reader sees half of it
    report = gc(root)
    assert [r["reason"] for r in report["removed"]] == ["trash"]
    assert os.listdir(only_repo(root).trash_dir) == []
    # The pruned checkout is simply absent: the next ensure clones it again.
    answer = wait_ready(root, upstream.path, upstream.shas[0])
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[0])


def test_a_pruned_checkout_is_cloned_again(root, upstream):
    sha = upstream.shas[1]
    path = wait_ready(root, upstream.path, sha)["path"]
    settled(root)  # the worker's tail holds the clone lock, which keeps gc from forgetting the commit
    make_idle(path, 3600)
    gc(root, "--max-checkouts", "0", "--grace", "1m")
    assert not os.path.exists(path)
    store = only_repo(root)
    assert not os.path.exists(store.clone_lock(sha))
    assert not os.path.exists(store.clone_log(sha))
    code, answer, _ = run_cli("ensure", upstream.path, sha, root=root)
    assert code == 75 and answer["state"] == "cloning"  # without a wait, the clone has only just started
    answer = wait_ready(root, upstream.path, sha)
    assert answer["path"] == path
    assert_checkout_matches(path, upstream.path, sha)


HOLDER = """
import sys, time
from checkoutcache.store.layout import RootPaths
from checkoutcache.store.scratch import create_scratch
scratch = create_scratch(RootPaths(sys.argv[1]).repo(sys.argv[2]), "live")
print(scratch.path, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_dead_scratch_is_reaped_and_live_scratch_kept(root, upstream):
    wait_ready(root, upstream.path, upstream.shas[0])
    store = only_repo(root)
    key = store.key
    live = subprocess.Popen([sys.executable, "-c", HOLDER, root, key], stdout=subprocess.PIPE, text=True)
    live_path = live.stdout.readline().strip()
    dead = subprocess.Popen([sys.executable, "-c", HOLDER, root, key], stdout=subprocess.PIPE, text=True)
    dead_path = dead.stdout.readline().strip()
    dead.kill()
    dead.wait()
    # A pid reused by an unrelated live process: our own pid, with another start time.
    pid, start = own_identity()
    reused = store.scratch_dir_for(pid, "0ld0wner")
    os.makedirs(reused)
    json.dump({"pid": pid, "start_time": start - 1000, "pidns": os.readlink("/proc/self/ns/pid"), "commit": "x"},
              open(store.scratch_owner_json(reused), "w"))
    # An old live clone is never touched, however old.
    os.utime(live_path, (0, 0))
    try:
        report = gc(root)
        reaped = sorted(r["name"] for r in report["removed"] if r["reason"] == "dead-scratch")
        assert reaped == sorted([os.path.basename(dead_path), os.path.basename(reused)])
        assert os.path.isdir(live_path) and not os.path.exists(dead_path) and not os.path.exists(reused)
        status = run_cli("status", root=root)[1]
        assert [s["owner_alive"] for s in status["repos"][0]["scratch"]] == [True]
    finally:
        live.kill()
        live.wait()
    report = gc(root)
    assert [r["name"] for r in report["removed"] if r["reason"] == "dead-scratch"] == [os.path.basename(live_path)]


@pytest.mark.slow
def test_mirror_maintenance_drops_refs_and_never_breaks_a_checkout(root, three_ready):
    upstream, paths = three_ready
    for path in paths[:2]:
        make_idle(path, 3600)
    mirror = only_repo(root).mirror
    stale = os.path.join(mirror, "shallow.lock")
    open(stale, "w").close()
    os.utime(stale, (0, 0))
    report = gc(root, "--max-checkouts", "1", "--grace", "1m")
    assert report["mirrors"][0]["refs_dropped"] == 2 and report["mirrors"][0]["repacked"]
    assert report["mirrors"][0]["stale_locks"] == ["shallow.lock"]
    refs = git("for-each-ref", "--format=%(refname)", cwd=mirror).split()
    assert [r for r in refs if not r.startswith("refs/spares/")] == [f"refs/keep/{upstream.shas[2]}"]
    # The evicted trees are spares (store/spares.py): their commits keep their history by refs/spares/.
    assert sorted(r for r in refs if r.startswith("refs/spares/")) == sorted(f"refs/spares/{sha}"
                                                                             for sha in upstream.shas[:2])
    assert_checkout_matches(paths[2], upstream.path, upstream.shas[2])
    assert git("fsck", "--connectivity-only", cwd=paths[2]) == ""


@pytest.mark.slow
def test_a_repack_stays_due_after_refs_were_dropped_by_an_earlier_run(root, three_ready):
    """Keep-refs dropped by a gc that was not yet due to repack leave the repack pending: a later
    gc repacks once the interval has passed, though it drops nothing itself. (The old rule
    repacked only when the same run dropped refs, so the objects stayed until some later
    eviction happened to coincide with the interval.)"""
    upstream, paths = three_ready
    for index, path in enumerate(paths):
        make_idle(path, 3600 - index * 60)  # shas[0] oldest
    store = only_repo(root)

    def stamp() -> dict:
        with open(store.mirror_gc_stamp) as handle:
            return json.load(handle)

    # gc #0: drops shas[0]'s keep-ref and repacks (nothing repacked yet): the interval starts now.
    report = gc(root, "--max-checkouts", "2", "--grace", "1m", "--mirror-gc-interval", "0")
    assert [r["name"] for r in report["removed"]] == [upstream.shas[0]], report
    assert report["mirrors"][0]["refs_dropped"] == 1 and report["mirrors"][0]["repacked"] is True, report
    repacked_at = stamp()["at"]

    # gc #1: drops shas[1]'s keep-ref, but a repack is not due for an hour: pending.
    report = gc(root, "--max-checkouts", "1", "--grace", "1m", "--mirror-gc-interval", "1h")
    assert [r["name"] for r in report["removed"]] == [upstream.shas[1]], report
    (entry,) = report["mirrors"]
    assert entry["refs_dropped"] == 1 and entry["repacked"] is False and "skipped" not in entry, entry
    assert stamp() == {"at": repacked_at, "pending": True}

    # gc #2: nothing new to drop; the interval (0) has passed: the pending repack is done.
    report = gc(root, "--mirror-gc-interval", "0")
    assert report["removed"] == [], report
    (entry,) = report["mirrors"]
    assert entry["refs_dropped"] == 0 and entry["repacked"] is True, entry
    after = stamp()
    assert after["pending"] is False and after["at"] > repacked_at, after
    refs = git("for-each-ref", "--format=%(refname)", cwd=store.mirror).split()
    assert [r for r in refs if not r.startswith("refs/spares/")] == [f"refs/keep/{upstream.shas[2]}"]
    assert_checkout_matches(paths[2], upstream.path, upstream.shas[2])

    # Nothing pending any more: another gc does not repack again.
    (entry,) = gc(root, "--mirror-gc-interval", "0")["mirrors"]
    assert entry["refs_dropped"] == 0 and entry["repacked"] is False, entry


@pytest.mark.slow
def test_overlapping_gcs_never_run_together(root, three_ready):
    from checkoutcache.store import locks

    with locks.try_lock(RootPaths(root).gc_lock):
        report = gc(root, "--max-checkouts", "0", "--grace", "0")
    assert report["skipped"] == "another gc is running" and report["removed"] == []


@pytest.mark.slow
def test_status_lists_checkouts_clones_failures_and_totals(root, upstream, tmp_path):
    wait_ready(root, upstream.path, upstream.shas[0])
    missing = "2" * 40
    run_cli("ensure", upstream.path, missing, "--wait", "30", root=root)
    code, status, _ = run_cli("status", upstream.path, root=root, env={"CHECKOUTCACHE_MAX_CHECKOUTS": "5"})
    assert code == 0
    (repo,) = status["repos"]
    assert repo["repo"] == upstream.path and repo["scope"] == "default"
    (checkout,) = repo["checkouts"]
    assert checkout["commit"] == upstream.shas[0] and checkout["size"] > 0 and checkout["protected"] == "grace"
    assert checkout["last_used"].endswith("Z") and checkout["held"] is False
    (failure,) = repo["failures"]
    assert failure["commit"] == missing and failure["error"] == "UNKNOWN_COMMIT" and failure["log"]
    assert status["totals"]["checkouts"] == 1 and status["totals"]["max_checkouts"] == 5
    assert status["totals"]["disk"]["total"] > 0
    done = subprocess.run(["script", "-qec", f"{sys.executable} -m checkoutcache --root {root} status", "/dev/null"],
                          capture_output=True, text=True, timeout=60)
    assert upstream.shas[0][:12] in done.stdout and "UNKNOWN_COMMIT" in done.stdout and "{" not in done.stdout
    code, other, _ = run_cli("status", str(tmp_path), root=root)
    assert code == 0 and other["repos"] == []


def test_gc_and_status_on_an_empty_root_write_nothing(tmp_path):
    """An empty root directory is an empty store (a missing one is ROOT_UNUSABLE: test_terminal.py)."""
    root = tmp_path / "empty"
    root.mkdir()
    assert gc(str(root))["removed"] == []
    assert run_cli("status", root=str(root))[1]["repos"] == []
    assert os.listdir(root) == []


@pytest.mark.parametrize("args", [["--max-checkouts", "-1"], ["--max-bytes", "lots"], ["--grace", "soon"],
                                  ["--min-free", "150%"], ["--max-age", "1y"]])
@pytest.mark.slow
def test_gc_bad_limits_are_bad_input(three_idle_shared, args):
    root = three_idle_shared
    before = store_snapshot(root)
    code, answer, _ = run_cli("gc", *args, root=root)
    assert code == 2 and answer["error"] == "BAD_ARGUMENT"
    assert len(only_repo(root).checkout_names()) == 3 and store_snapshot(root) == before


@pytest.mark.slow
def test_limits_come_from_the_environment(root, three_ready):
    upstream, paths = three_ready
    for path in paths:
        make_idle(path, 3600)
    report = gc(root, env={"CHECKOUTCACHE_MAX_CHECKOUTS": "2", "CHECKOUTCACHE_GRACE": "10m"})
    assert [r["name"] for r in report["removed"] if r["reason"] == "lru"] == [upstream.shas[0]]


@pytest.mark.slow
def test_cron_script_runs_gc_with_the_environments_limits(root, three_ready, tmp_path):
    upstream, paths = three_ready
    for path in paths:
        make_idle(path, 3600)
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "checkoutcache-gc-cron")
    log = tmp_path / "gc.log"
    env = dict(os.environ, CHECKOUTCACHE_ROOT=root, CHECKOUTCACHE_MAX_CHECKOUTS="1", CHECKOUTCACHE_GRACE="1m",
               CHECKOUTCACHE_GC_LOG=str(log), CHECKOUTCACHE=f"{sys.executable} -m checkoutcache")
    done = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(os.listdir(only_repo(root).checkouts_dir)) == 1
    assert '"removed"' in log.read_text()


@pytest.mark.slow
def test_concurrent_ensure_during_gc_never_answers_a_missing_path(root, upstream, tmp_path):
    """Counted, not timed: asks go on until gc has evicted and ensure re-cloned at least
    twice and 30 answers were checked, however slow the machine (it asserted how many
    answers fitted in 8 s). A commit is asked again within 2 s at most while others idle
    past the grace window, so gc keeps evicting while answers keep coming."""
    import random

    shas = upstream.shas + [upstream.commit({"extra.txt": f"{n}\n"}, message=f"extra {n}") for n in range(3)]
    for sha in shas:
        wait_ready(root, upstream.path, sha)
    stop = tmp_path / "stop-gc"
    gcs = subprocess.Popen(["bash", "-c", f"while [ ! -e {stop} ]; do {sys.executable} -m checkoutcache --root {root} "
                                          f"gc --max-checkouts 0 --grace 2 >/dev/null; done"])
    cache = Cache(root)
    rng = random.Random(7)
    answers = 0
    publications = set()  # (commit, published_at): a re-clone publishes anew
    give_up = time.monotonic() + 600  # a bound for a broken store, never reached by a slow one
    try:
        while answers < 30 or len(publications) < len(shas) + 2:
            assert time.monotonic() < give_up, (answers, len(publications))
            sha = rng.choice(shas[:2]) if rng.random() < 0.6 else rng.choice(shas)
            answer = cache.ensure(upstream.path, sha, wait=60)
            assert answer.state == "ready", answer
            assert os.path.isfile(os.path.join(answer.path, "README.md")), "ready path vanished"
            answers += 1
            try:
                publications.add((sha, json.load(open(marker(answer.path)))["published_at"]))
            except FileNotFoundError:
                pass  # evicted right after our use: allowed once the answer is given
            time.sleep(rng.uniform(0, 0.3))
    finally:
        stop.touch()
        gcs.wait(60)
    assert answers >= 30 and len(publications) >= len(shas) + 2, "gc evicted and ensure re-cloned during the run"


def test_gc_removes_an_older_version_s_serve_journal_untouched_for_a_day(root, upstream):
    """An older version's <pid>.journal has no lock to ask: its age decides."""
    from checkoutcache.store.layout import RootPaths

    wait_ready(root, upstream.path, upstream.shas[0])
    paths = RootPaths(root)
    os.makedirs(paths.serve_dir, exist_ok=True)
    old, fresh = os.path.join(paths.serve_dir, "111.journal"), os.path.join(paths.serve_dir, "222.journal")
    for journal in (old, fresh):
        with open(journal, "w") as handle:
            handle.write('{"event": "published"}\n')
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    assert run_cli("gc", root=root)[0] == 0
    assert not os.path.exists(old) and os.path.exists(fresh)


def test_gc_removes_a_serve_journal_by_its_lock_not_its_age(root, upstream):
    """Issue 27: a journal whose lock nobody holds is a dead serve's, however recent; one held
    is a running serve's, however old."""
    from checkoutcache.store import locks
    from checkoutcache.store.layout import RootPaths

    wait_ready(root, upstream.path, upstream.shas[0])
    paths = RootPaths(root)
    os.makedirs(paths.serve_dir, exist_ok=True)
    dead, live = paths.serve_journal(6, "a" * 16), paths.serve_journal(6, "b" * 16)
    held = locks.serve_journal_owned(live)
    try:
        with open(dead, "w") as handle:
            handle.write('{"event": "published"}\n')
        os.utime(live, (time.time() - 3 * 86400,) * 2)
        assert run_cli("gc", root=root)[0] == 0
        assert not os.path.exists(dead) and os.path.exists(live)
        assert sorted(paths.serve_journals()) == [live]
    finally:
        held.release()
