"""Evicting by hand and dropping whole repositories (issue 27): `checkoutcache evict REPO
[COMMIT] [--force]` keeps gc's guarantees (never a held checkout or a running clone, even
with --force; one used within its grace window only with --force), and gc drops a whole
repository with nothing in it once unused past CHECKOUTCACHE_REPO_MAX_IDLE. Real
repositories, the real CLI, a real `exec` holding a checkout, a clone held at a gate."""

from __future__ import annotations

import os
import time

import pytest

from .helpers import make_idle, only_repo, run_cli, settled, wait_ready, wait_until
from .helpers.gate import GatedProxy
from .test_held_removal import Exec, execs  # noqa: F401  (the fixture)


def evict(root: str, *args: str) -> tuple[int, dict]:
    code, answer, out = run_cli("evict", *args, root=root)
    assert answer is not None, out
    return code, answer


@pytest.mark.slow
def test_evict_by_hand_never_takes_a_held_checkout_or_a_running_clone(root, served_upstream, tmp_path, execs):
    repo, _ = served_upstream
    held_sha, fresh_sha, idle_sha = repo.shas
    extra = repo.commit({"README.md": "four\n"}, message="four")
    proxy = GatedProxy(int(served_upstream[1].rsplit(":", 1)[1].split("/", 1)[0]))
    try:
        url = proxy.url(served_upstream[1].rsplit("/", 1)[1])
        paths = {sha: wait_ready(root, url, sha)["path"] for sha in (held_sha, fresh_sha, idle_sha)}
        make_idle(paths[held_sha], 3600)
        make_idle(paths[idle_sha], 3600)
        held = Exec(root, url, held_sha, tmp_path)
        execs.append(held)
        # Held: kept even with --force.
        code, answer = evict(root, url, held_sha, "--force")
        assert code == 1 and answer["error"] == "IN_USE" and answer["kept"] == [
            {"name": held_sha, "why": "held"}] and answer["removed"] == [], answer
        assert os.path.isdir(paths[held_sha])
        # Within its grace window: only with --force.
        code, answer = evict(root, url, fresh_sha)
        assert code == 1 and answer["kept"] == [{"name": fresh_sha, "why": "grace"}], answer
        assert os.path.isdir(paths[fresh_sha])
        code, answer = evict(root, url, fresh_sha, "--force")
        assert code == 0 and [r["name"] for r in answer["removed"]] == [fresh_sha] and answer["bytes_freed"] > 0
        assert not os.path.exists(paths[fresh_sha])
        # Unused: goes without --force.
        code, answer = evict(root, url, idle_sha)
        assert code == 0 and [r["name"] for r in answer["removed"]] == [idle_sha], answer
        # A clone under way (held at the gate in its fetch) is never stopped, even with --force.
        proxy.shut()
        code, cloning, out = run_cli("ensure", url, extra, root=root)
        assert code == 75 and cloning["state"] == "cloning", out
        wait_until(lambda: proxy.held >= 1, what="the clone's fetch at the gate")
        code, answer = evict(root, url, extra, "--force")
        assert code == 1 and answer["kept"] == [{"name": extra, "why": "cloning"}], answer
        # The whole repository: kept while the exec holds its checkout and the clone runs.
        code, answer = evict(root, url, "--force")
        assert code == 1 and answer["repository_removed"] is False, answer
        assert sorted((k["name"], k["why"]) for k in answer["kept"]) == sorted(
            [(held_sha, "held"), (extra, "cloning")]), answer
        proxy.open()
        wait_ready(root, url, extra)
        assert held.end()[0] == 0
        store = only_repo(root)
        code, answer = evict(root, url)  # the exec just used it, the clone just published: grace
        assert code == 1 and answer["repository_removed"] is False
        code, answer = evict(root, url, "--force")
        assert code == 0 and answer["repository_removed"] is True, answer
        assert not os.path.exists(store.base) and os.listdir(os.path.join(root, "repos")) == []
        # Asked again: cloned anew.
        assert wait_ready(root, url, held_sha)["state"] == "ready"
    finally:
        proxy.close()


def test_evict_of_a_repository_the_store_does_not_hold_says_so_and_writes_nothing(root, upstream):
    wait_ready(root, upstream.path, upstream.shas[0])
    other = upstream.path + "-elsewhere"
    os.makedirs(other)
    before = sorted(os.listdir(os.path.join(root, "repos")))
    code, answer = evict(root, other)
    assert code == 0 and answer["removed"] == [] and "nothing" in answer["note"], answer
    assert sorted(os.listdir(os.path.join(root, "repos"))) == before
    code, answer = evict(root, upstream.path, "not-a-commit")
    assert code == 2 and answer["error"] == "BAD_COMMIT"


@pytest.mark.slow
def test_gc_drops_a_repository_unused_past_its_limit_and_keeps_one_in_use(root, upstream, tmp_path, execs):
    from .helpers import Upstream

    second = Upstream(str(tmp_path / "second"))
    second.standard_history(1)
    old = wait_ready(root, upstream.path, upstream.shas[0])["path"]
    used = wait_ready(root, second.path, second.shas[0])["path"]
    settled(root)  # a repository whose history runs is not dropped
    old_key, used_key = old.split(os.sep)[-3], used.split(os.sep)[-3]
    make_idle(old, 3 * 86400)
    make_idle(used, 3 * 86400)
    held = Exec(root, second.path, second.shas[0], tmp_path)
    execs.append(held)
    # A removal a killed gc left half done.
    leftover = os.path.join(root, "repos", f".dropped-{old_key}-1-abcd")
    os.makedirs(os.path.join(leftover, "mirror.git"))
    code, report, out = run_cli("gc", "--max-age", "1d", "--repo-max-idle", "2d", root=root)
    assert code == 0, out
    assert sorted((r["reason"], r["repo"], r.get("limit")) for r in report["removed"]) == sorted([
        ("dropped-leftover", old_key, None), ("age", old_key, "max-age"),
        ("repository", old_key, "repo-max-idle")]), report["removed"]
    assert sorted(os.listdir(os.path.join(root, "repos"))) == [used_key]
    assert os.path.isdir(used)  # held (its repository too)
    held.end()


def test_a_wait_that_outlives_its_repository_begins_it_again(root, upstream, monkeypatch):
    """Regression: an `ensure --wait` that had looked at the store when gc (or `evict`)
    dropped the whole idle repository answered `cloning` with no owner until its wait ran
    out. The drop is made to fall exactly there: right after the first look."""
    from checkoutcache import Cache
    from checkoutcache.clone.coordinator import Coordinator

    first, second = upstream.shas[0], upstream.shas[1]
    assert Cache(root).ensure(upstream.path, first, wait=60).state == "ready"
    store = only_repo(root)
    dropped = []
    original = Coordinator.first_contact

    def then_dropped(self):
        answer = original(self)
        if not dropped:  # what gc's drop does: the repository renamed aside, then deleted
            aside = os.path.join(os.path.dirname(store.base), ".dropped-test")
            os.rename(store.base, aside)
            dropped.append(aside)
        return answer

    monkeypatch.setattr(Coordinator, "first_contact", then_dropped)
    answer = Cache(root).ensure(upstream.path, second, wait=60)
    assert dropped, "the repository was dropped between the looks"
    assert answer.state == "ready", answer
    assert os.path.isdir(answer.path) and answer.path.startswith(store.base)


def test_failures_are_no_use_a_repository_with_only_old_ones_is_dropped_past_its_idle_limit(root, upstream):
    """Regression (issue 33): failure records counted as uses, so asks for commits that do not
    exist kept a repository nothing else used from CHECKOUTCACHE_REPO_MAX_IDLE for good."""
    from .test_forget import age_failure, failed, missing_commit

    sha = missing_commit(5)
    failed(root, upstream.path, sha)
    store = only_repo(root)
    made = time.time() - 2 * 86400  # the store was made two days ago; no checkout since
    os.utime(store.repo_json, (made, made))
    age_failure(store.failure_record(sha), 1800, 1740)  # failed half an hour ago, its back-off over
    code, report, out = run_cli("gc", "--repo-max-idle", "1h", root=root)
    assert code == 0, out
    assert [(r["reason"], r["repo"], r["limit"]) for r in report["removed"]] == [
        ("repository", store.key, "repo-max-idle")], report["removed"]
    assert not os.path.exists(store.base)


@pytest.mark.slow
def test_gc_keeps_an_idle_repository_while_a_failure_backs_off_and_evict_by_hand_does_not(root, upstream):
    """Dropping a repository forgets its failures: within a back-off the next ask would clone
    at once instead of answering the failure. gc keeps it until the retry time; `evict
    REPO` by hand (an operator's way to forget a back-off) does not."""
    from .test_forget import age_failure, failed, missing_commit

    sha = missing_commit(6)
    failed(root, upstream.path, sha)
    store = only_repo(root)
    made = time.time() - 2 * 86400
    os.utime(store.repo_json, (made, made))
    age_failure(store.failure_record(sha), 7200, -3600)  # failed two hours ago, backing off another hour
    code, report, out = run_cli("gc", "--repo-max-idle", "1h", root=root)
    assert code == 0 and report["removed"] == [], report["removed"]
    code, answer, out = run_cli("ensure", upstream.path, sha, root=root)
    assert code == 1 and answer["error"] == "UNKNOWN_COMMIT" and answer["retry_after"] > 3000, out
    assert open(store.clone_log(sha)).read().count("clone of") == 1, "no new attempt within the back-off"
    code, answer = evict(root, upstream.path)
    assert code == 0 and answer["repository_removed"] is True, answer
