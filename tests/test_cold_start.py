"""A cold node answers at the cost of one commit (issue 34): the first answer comes from a
depth-1 fetch of the commit alone, the mirror's history follows in the background (killed
at any step, it resumes), and every checkout has its whole history once it arrives, the
published tree unchanged. Answers say which history they have; `--history full` waits for
it; `--base` answers the merge base, deepening only as far as the two commits need.

Every test runs against a real `git daemon` (fetch by id, as the forges allow), through the
CLI, the library or the HTTP API; the history's progress is held by a lock the test takes
(the history waits while clones of its repository run), never by a sleep."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from checkoutcache.cache import Cache
from checkoutcache.store import locks

from .helpers import (
    Serve,
    Upstream,
    assert_checkout_matches,
    git,
    only_repo,
    run_cli,
    settled,
    wait_ready,
    wait_until,
    walk,
)

KILL_AT = "CHECKOUTCACHE_TEST_KILL_AT"


def grow(repo: Upstream, count: int, tag: str = "c") -> list[str]:
    """count more commits, each changing a file of its own and a shared one."""
    for number in range(count):
        repo.commit({f"{tag}/file_{number % 5}.txt": f"{tag} {number}\n" * (3 + number % 7),
                     "CHANGES": f"{tag} {number}\n"}, message=f"{tag} {number}")
    return repo.shas[-count:]


def commits_in(path: str, sha: str = "HEAD") -> int:
    done = subprocess.run(["git", "-C", path, "rev-list", "--count", sha], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # `git log` works, shallow or not
    return int(done.stdout)


def kill_history_at_start(root: str, url: str, sha: str, kill_log) -> dict:
    """The first answer, its history killed as it starts: the mirror stays shallow."""
    answer = wait_ready(root, url, sha, env={KILL_AT: "history-start"})
    wait_until(lambda: os.path.exists(kill_log) and "history-start " in open(kill_log).read(),
               what="the history's kill")
    wait_until(lambda: not locks.history_running(only_repo(root)), what="the killed history's lock freed")
    return answer


def full_history(root: str, url: str, sha: str, wait: str = "120") -> dict:
    code, answer, out = run_cli("ensure", url, sha, "--history", "full", "--wait", wait, root=root)
    assert code == 0 and answer["history"] == "complete", out
    return answer


def tree_state(path: str) -> dict:
    """Every entry of a published checkout: what it is, its size, mode, inode and mtime (its
    marker's mtime aside: the last use)."""
    return {e.rel: (e.info.st_mode, e.info.st_size, e.info.st_ino, e.info.st_mtime_ns)
            for e in walk(path) if not e.rel.endswith("checkoutcache-ready")}


@pytest.fixture
def deep(served_upstream):
    """An upstream of 40 commits on main (the standard three first)."""
    repo, url = served_upstream
    grow(repo, 37)
    return repo, url


# ---------------------------------------------------------------- the first answer

def test_the_first_answer_is_the_commit_alone_and_its_history_follows_untouched(root, deep, kill_log):
    repo, url = deep
    head = repo.shas[-1]
    answer = kill_history_at_start(root, url, head, kill_log)
    assert answer["history"] == "shallow" and answer["state"] == "ready"
    path = answer["path"]
    assert_checkout_matches(path, repo.path, head)
    store = only_repo(root)
    # Depth 1: the mirror holds the commit and its tree, nothing older; its boundary is the commit.
    with open(store.mirror_shallow) as handle:
        assert handle.read().split() == [head]
    have = set(git("cat-file", "--batch-all-objects", "--batch-check=%(objectname)", cwd=store.mirror).split())
    one_commit = {line.split()[0] for line in git("rev-list", "--objects", "--no-walk", head,
                                                  cwd=repo.path).splitlines()}
    assert have == one_commit, (len(have), len(one_commit))
    # The checkout is a working repository: log (one commit), status clean, its boundary the mirror's.
    assert commits_in(path) == 1
    assert git("--no-optional-locks", "status", "--porcelain", cwd=path) == ""  # (writes no index)
    assert os.readlink(os.path.join(path, ".git", "shallow")) == store.mirror_shallow
    before = tree_state(path)
    answer = full_history(root, url, head)  # the history starts again (it died), and completes
    assert answer["path"] == path
    assert commits_in(path) == len(repo.shas)  # git log reaches the root commit
    assert git("rev-list", "--max-parents=0", "HEAD", cwd=path) == repo.shas[0]
    assert git("merge-base", repo.shas[3], head, cwd=path) == repo.shas[3]
    assert git("blame", "--porcelain", "CHANGES", cwd=path)
    assert git("--no-optional-locks", "status", "--porcelain", cwd=path) == ""
    assert tree_state(path) == before, "no published tree changes when its history arrives"
    assert not os.path.exists(store.mirror_shallow) and not os.path.exists(store.history_repo)
    git("fsck", "--connectivity-only", "--no-dangling", cwd=store.mirror)


def test_the_history_follows_by_itself_and_every_checkout_gets_it(root, deep):
    repo, url = deep
    first = wait_ready(root, url, repo.shas[-1])
    second = wait_ready(root, url, repo.shas[10])
    settled(root)  # the background history ran to its end: no ask for it
    status = run_cli("status", root=root)[1]
    history = status["repos"][0]["history"]
    assert history["state"] == "complete" and not history["running"] and history["completed_at"], history
    for answer, sha in ((first, repo.shas[-1]), (second, repo.shas[10])):
        assert commits_in(answer["path"]) == repo.shas.index(sha) + 1
        code, again, out = run_cli("ensure", url, sha, root=root)
        assert code == 0 and again["history"] == "complete", out
    assert [c["history"] for c in status["repos"][0]["checkouts"]] == ["complete", "complete"]


def test_history_full_waits_answering_cloning_with_the_historys_progress(root, deep, tmp_path):
    """The history yields to the repository's clones (one the test holds): meanwhile a request
    for the full history answers cloning, naming the history's live process and its progress,
    through the library, the CLI and the HTTP API; released, it completes."""
    repo, url = deep
    head = repo.shas[-1]
    cache = Cache(root)
    run_cli("ensure", url, repo.shas[0], "--wait", "60", root=root, env={KILL_AT: "history-start"})
    store = only_repo(root)  # the store exists (its first clone's history killed): the gate can be held
    settled(root)  # (the history starts after the answer: its lock alone may be free before it runs)
    gate = locks.try_lock(store.clone_lock("f" * 40))  # a clone of the repository, as the history sees it
    assert gate is not None
    try:
        first = cache.ensure(url, head, wait=60)
        assert first.state == "ready" and first.history == "shallow"
        seen = []

        def waiting() -> bool:
            answer = cache.ensure(url, head, wait=0, history="full")
            seen.append(answer)
            return answer.state == "cloning" and (answer.progress or {}).get("phase") == "waiting for clones"

        wait_until(waiting, 60, "the history waiting for clones")
        answer = seen[-1]
        assert answer.history == "shallow" and answer.pid and os.path.exists(f"/proc/{answer.pid}")
        assert answer.exit_code == 75
        code, cli_answer, out = run_cli("ensure", url, head, "--history", "full", root=root)
        assert code == 75 and cli_answer["state"] == "cloning" and cli_answer["history"] == "shallow", out
        assert cli_answer["pid"] == answer.pid
        server = Serve(root, tmp_path)
        try:
            api = server.client().ensure(url, head, history="full")
            assert api.state == "cloning" and api.history == "shallow" and api.pid == answer.pid, api
            status, body = server.request("GET", "/v1/status")
            assert body["repos"][0]["history"]["running"] and body["repos"][0]["history"]["pid"] == answer.pid
            assert cache.ensure(url, head).history == "shallow"  # any history: ready at once
        finally:
            server.stop()
    finally:
        gate.release()
    done = cache.ensure(url, head, wait=120, history="full")
    assert done.state == "ready" and done.history == "complete", done
    assert commits_in(done.path) == len(repo.shas)
    assert commits_in(store.checkout(repo.shas[0])) == 1


def test_history_full_through_the_api_and_a_bad_value_is_bad_input(root, deep, tmp_path):
    repo, url = deep
    server = Serve(root, tmp_path)
    try:
        client = server.client()
        answer = client.ensure(url, repo.shas[-1], wait=120, history="full")
        assert answer.state == "ready" and answer.history == "complete", answer
        assert commits_in(answer.path) == len(repo.shas)
        status, body = server.request("POST", "/v1/ensure", {"repo": url, "commit": repo.shas[-1],
                                                             "history": "deep"})
        assert status == 400 and body["error"] == "BAD_ARGUMENT", body
    finally:
        server.stop()
    code, answer, out = run_cli("ensure", url, repo.shas[-1], "--history", "deep", root=root)
    assert code == 2 and answer["error"] == "BAD_ARGUMENT", out


def test_a_new_commit_while_the_history_is_incomplete_is_fetched_at_depth_one(root, deep, kill_log):
    repo, url = deep
    kill_history_at_start(root, url, repo.shas[20], kill_log)
    store = only_repo(root)
    answer = wait_ready(root, url, repo.shas[-1], env={KILL_AT: "history-start"})
    assert answer["history"] == "shallow" and commits_in(answer["path"]) == 1
    log = open(store.clone_log(repo.shas[-1])).read()
    assert "--depth=1" in log and "(privately)" in log, log
    # What changed, not a new tree: negotiated against what the mirror has.
    sent = [int(line.split("Total ")[1].split()[0]) for line in log.splitlines() if "remote: Total" in line]
    whole = len(git("rev-list", "--objects", "--no-walk", repo.shas[-1], cwd=repo.path).splitlines())
    assert sent and sent[0] < whole, (sent, whole)
    with open(store.mirror_shallow) as handle:
        assert sorted(handle.read().split()) == sorted([repo.shas[20], repo.shas[-1]])
    full_history(root, url, repo.shas[-1])
    assert commits_in(answer["path"]) == len(repo.shas)
    assert commits_in(store.checkout(repo.shas[20])) == 21


# ---------------------------------------------------------------- the merge base

@pytest.fixture
def review(served_upstream):
    """main: 40 commits; a pull request of 4 commits branched 6 commits before main's tip."""
    repo, url = served_upstream
    grow(repo, 37)
    fork = repo.shas[-7]
    git("checkout", "-q", "-b", "feature", fork, cwd=repo.path)
    head = grow(repo, 4, "feature")[-1]
    git("checkout", "-q", "main", cwd=repo.path)
    return repo, url, head, repo.shas[-5], fork  # base: main's tip


def test_base_answers_the_merge_base_deepening_only_as_far_as_needed(root, review, kill_log):
    repo, url, head, base, fork = review
    kill_history_at_start(root, url, head, kill_log)
    assert git("merge-base", head, base, cwd=repo.path) == fork
    code, answer, out = run_cli("ensure", url, head, "--base", base, "--wait", "60", root=root)
    assert code == 0 and answer["merge_base"] == fork and answer["base"] == base, out
    assert answer["history"] == "shallow"
    path = answer["path"]
    # The checkout reaches the merge base: the review diffs what the pull request changed.
    git("merge-base", "--is-ancestor", fork, "HEAD", cwd=path)
    changed = git("diff", "--name-only", fork, "HEAD", cwd=path).split()
    assert changed and all(name.startswith("feature/") or name == "CHANGES" for name in changed), changed
    assert commits_in(path) < len(repo.shas) - 4, "deepened as far as the two need, not the whole history"
    assert_checkout_matches(path, repo.path, head)
    # Known now: answered on the ready path, by the library too.
    again = Cache(root).ensure(url, head, base=base)
    assert again.state == "ready" and again.merge_base == fork
    code, again, out = run_cli("ensure", url, head, "--base", base, root=root)
    assert code == 0 and again["merge_base"] == fork, out


def test_base_with_a_complete_history_and_through_the_api(root, review, tmp_path):
    repo, url, head, base, fork = review
    full_history(root, url, head)
    server = Serve(root, tmp_path)
    try:
        answer = server.client().ensure(url, head, wait=60, base=base)
        assert answer.state == "ready" and answer.merge_base == fork and answer.history == "complete", answer
        status, body = server.request("POST", "/v1/ensure", {"repo": url, "commit": head, "base": "main"})
        assert status == 400 and body["error"] == "BAD_ARGUMENT", body
    finally:
        server.stop()


def test_unrelated_histories_have_no_merge_base(root, served_upstream):
    repo, url = served_upstream
    git("checkout", "-q", "--orphan", "elsewhere", cwd=repo.path)
    other = repo.commit({"alone.txt": "no common history\n"}, message="an orphan")
    git("checkout", "-q", "main", cwd=repo.path)
    code, answer, out = run_cli("ensure", url, repo.shas[2], "--base", other, "--wait", "60", root=root)
    assert code == 1 and answer["error"] == "NO_MERGE_BASE", out


def test_an_unknown_base_fails_and_the_checkout_stays(root, served_upstream):
    repo, url = served_upstream
    code, answer, out = run_cli("ensure", url, repo.shas[2], "--base", "e" * 40, "--wait", "60", root=root)
    assert code == 1 and answer["error"] == "UNKNOWN_COMMIT" and "e" * 40 in answer["message"], out
    assert_checkout_matches(only_repo(root).checkout(repo.shas[2]), repo.path, repo.shas[2])


# ---------------------------------------------------------------- the background history, killed

HISTORY_STEPS = ["history-start", "history-before-fetch", "history-during-fetch", "history-after-fetch",
                 "history-during-install", "history-after-packs", "history-after-install"]


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.parametrize("step", HISTORY_STEPS)
def test_a_history_killed_at_each_step_resumes_from_the_store_it_left(root, deep, kill_log, step):
    repo, url = deep
    head = repo.shas[-1]
    answer = wait_ready(root, url, head, env={KILL_AT: step})
    wait_until(lambda: os.path.exists(kill_log) and open(kill_log).read(), what=f"the kill at {step}")
    with open(kill_log) as handle:
        assert handle.read().split()[0] == step
    store = only_repo(root)
    wait_until(lambda: not locks.history_running(store), what="the killed history's lock freed")
    # Whatever step it died at: the checkout is whole, its git works, the mirror is sound.
    assert_checkout_matches(answer["path"], repo.path, head)
    assert commits_in(answer["path"]) in (1, len(repo.shas))
    git("fsck", "--connectivity-only", "--no-dangling", cwd=store.mirror)
    if os.path.exists(store.mirror_shallow):
        with open(store.mirror_shallow) as handle:
            assert handle.read().split() == [head]  # never a boundary claiming more than it has
    # The next gc starts it again (cron's, or serve's schedule); it resumes and completes.
    code, report, out = run_cli("gc", root=root)
    assert code == 0, out
    full_history(root, url, head)
    assert commits_in(answer["path"]) == len(repo.shas)
    assert not os.path.exists(store.history_repo)
    git("fsck", "--connectivity-only", "--no-dangling", cwd=store.mirror)


@pytest.mark.faults
def test_gc_starts_a_dead_history_again_and_says_so(root, deep, kill_log):
    repo, url = deep
    kill_history_at_start(root, url, repo.shas[-1], kill_log)
    code, report, out = run_cli("gc", root=root)
    assert code == 0, out
    (entry,) = report["mirrors"]
    assert entry["history"] == "shallow" and entry["history_process"].startswith("started (pid "), entry
    settled(root)
    code, report, out = run_cli("gc", root=root)
    (entry,) = report["mirrors"]
    assert entry["history"] == "complete" and "history_process" not in entry, entry


def test_gc_leaves_a_running_historys_trash_to_it(root, served_upstream):
    """Regression: a gc at the instant a history finished emptied the history's own trash slot
    (history.<pid>.<hex>, which the history removes itself) and reported it as gc's removal."""
    upstream, url = served_upstream
    wait_ready(root, url, upstream.shas[0])
    settled(root)
    paths = only_repo(root)
    slot = paths.trash_slot("history")
    os.makedirs(os.path.join(slot, "objects"))
    running = locks.history_of(paths)  # this test stands in for the running history: its lock
    assert running is not None
    with running:
        code, report, out = run_cli("gc", root=root)
        assert code == 0 and report["removed"] == [], out
        assert os.path.isdir(slot)
    code, report, out = run_cli("gc", root=root)  # a history that died: its slot is gc's
    assert code == 0 and [(r["reason"], r["name"]) for r in report["removed"]] == \
        [("trash", os.path.basename(slot))], out
    assert not os.path.lexists(slot)


def test_a_failed_history_backs_off_and_status_says_why(root, tmp_path, daemon):
    """A history the server cannot send (the repository gone from it after the first answer)
    fails with a back-off: the checkout stays, status and --history full say why."""
    work = Upstream(os.path.join(daemon.base, "vanishing"))
    work.standard_history(4)
    url = daemon.url("vanishing")
    answer = wait_ready(root, url, work.shas[-1], env={KILL_AT: "history-start"})
    settled(root)
    os.rename(work.path, work.path + ".gone")
    code, answer, out = run_cli("ensure", url, work.shas[-1], "--history", "full", "--wait", "30", root=root)
    assert code == 1 and answer["error"] == "HISTORY_FAILED" and answer["retry_after"] >= 1, out
    status = run_cli("status", root=root)[1]
    history = status["repos"][0]["history"]
    assert history["state"] == "shallow" and history["failure"]["attempts"] == 1, history
    code, again, out = run_cli("ensure", url, work.shas[-1], root=root)
    assert code == 0 and again["history"] == "shallow", out  # the checkout itself is served all along


@pytest.mark.slow
def test_a_commit_upstream_no_longer_has_keeps_no_other_commits_history_out(root, daemon):
    """Regression (review of issue 34): one commit force-pushed away after its depth-1 answer made
    the history fail for the whole repository: `--history full` of every other commit answered
    HISTORY_FAILED (said twice: "... fetched: HISTORY_FAILED: ... fetched: ...") though their
    histories were complete, and a commit fetched later waited out the back-off. The history
    completes every commit it can fetch; the failure names the one it cannot and holds for it
    alone; once its checkout is evicted, the repository's history is complete."""
    from .helpers import make_idle

    work = Upstream(os.path.join(daemon.base, f"forced-{os.urandom(3).hex()}"))
    url = daemon.url(os.path.basename(work.path))
    main = grow(work, 6)
    git("checkout", "-q", "-b", "pr", cwd=work.path)
    gone = work.commit({"pr.txt": "force-pushed away\n"}, message="gone")
    git("checkout", "-q", "main", cwd=work.path)
    wait_ready(root, url, gone, env={KILL_AT: "history-start"})
    wait_ready(root, url, main[-1], env={KILL_AT: "history-start"})
    store = only_repo(root)
    settled(root)
    git("branch", "-q", "-D", "pr", cwd=work.path)
    git("reflog", "expire", "--expire=now", "--all", cwd=work.path)
    git("gc", "-q", "--prune=now", cwd=work.path)
    # main's history is complete, whatever the commit upstream no longer has.
    code, answer, out = run_cli("ensure", url, main[-1], "--history", "full", "--wait", "60", root=root)
    assert code == 0 and answer["history"] == "complete", out
    assert commits_in(answer["path"]) == len(work.shas) - 1
    # A plain ready answer says the repository's history (one stat): still shallow.
    assert run_cli("ensure", url, main[-1], root=root)[1]["history"] == "shallow"
    code, failed, out = run_cli("ensure", url, gone, "--history", "full", "--wait", "30", root=root)
    assert code == 1 and failed["error"] == "HISTORY_FAILED" and gone in failed["message"], out
    assert failed["message"].count("could not be fetched") == 1 and "HISTORY_FAILED" not in failed["message"], out
    status = run_cli("status", root=root)[1]["repos"][0]["history"]
    assert status["failure"]["boundary_commits"] == 1 and gone in status["failure"]["message"], status
    # A commit fetched since is not kept waiting behind that failure's back-off.
    newer = work.commit({"new.txt": "after\n"}, message="newer")
    code, answer, out = run_cli("ensure", url, newer, "--history", "full", "--wait", "60", root=root)
    assert code == 0 and answer["history"] == "complete" and commits_in(answer["path"]) == len(work.shas) - 1, out
    # The gone commit's checkout evicted, gc's prune drops its boundary: the repository is complete.
    make_idle(store.checkout(gone), 7200)
    code, report, out = run_cli("gc", "--max-checkouts", "2", "--max-spares", "0", "--mirror-gc-interval", "0",
                                root=root)
    assert code == 0 and not os.path.exists(store.checkout(gone)), out
    assert not os.path.exists(store.mirror_shallow)
    assert run_cli("ensure", url, main[-1], root=root)[1]["history"] == "complete"
    status = run_cli("status", root=root)[1]["repos"][0]["history"]
    assert status["state"] == "complete" and "failure" not in status, status


# ---------------------------------------------------------------- many reviews on a cold node

class DepthOneBarrier:
    """A TCP proxy in front of the git daemon that holds the server's answer to every depth-1
    fetch (a request with `deepen 1`) until `parties` of them are in flight at once:
    fetches serialized behind one lock would never all be, and the barrier would time out."""

    def __init__(self, target: int, parties: int, timeout: float = 60):
        import socket
        import threading

        self.target, self.parties, self.timeout = target, parties, timeout
        self.arrived = 0
        self.released = threading.Event()
        self.timed_out = False
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            state = {"seen": b"", "gated": False}
            threading.Thread(target=self.up, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self.down, args=(upstream, client, state), daemon=True).start()

    def up(self, client, upstream, state) -> None:
        try:
            while data := client.recv(65536):
                state["seen"] = (state["seen"] + data)[-65536:]
                # `deepen 1` ends its pkt-line: a newline (v0), or the next line's length (v2).
                if not state["gated"] and re.search(rb"deepen 1(?:\n|[0-9a-f]{4})", state["seen"]):
                    state["gated"] = True
                    with self.lock:
                        self.arrived += 1
                        if self.arrived >= self.parties:
                            self.released.set()
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            try:
                upstream.shutdown(2)
            except OSError:
                pass

    def down(self, upstream, client, state) -> None:
        try:
            while data := upstream.recv(65536):
                if state["gated"] and not self.released.is_set():
                    if not self.released.wait(self.timeout):
                        self.timed_out = True
                        self.released.set()
                client.sendall(data)
        except OSError:
            pass
        finally:
            try:
                client.shutdown(2)
            except OSError:
                pass

    def stop(self) -> None:
        self.sock.close()


@pytest.mark.slow
def test_reviews_of_six_commits_on_a_cold_node_fetch_side_by_side(root, deep):
    """Six reviews of six commits on a cold node: their depth-1 fetches are in flight at once
    (never one behind another's mirror lock); two more reviews of the first commit share its
    clone (one clone per commit)."""
    import sys

    repo, url = deep
    shas = repo.shas[-6:]
    daemon_port = int(url.split(":")[2].split("/")[0])
    barrier = DepthOneBarrier(daemon_port, parties=6)
    via = url.replace(f":{daemon_port}/", f":{barrier.port}/")
    try:
        asks = [*shas, shas[0], shas[0]]
        procs = [subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", root, "--json", "ensure", via,
                                   sha, "--wait", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for sha in asks]
        outputs = [proc.communicate(timeout=180) for proc in procs]
    finally:
        barrier.stop()
    assert [proc.returncode for proc in procs] == [0] * len(asks), outputs
    assert barrier.released.is_set() and not barrier.timed_out, "the six depth-1 fetches were never in flight at once"
    assert barrier.arrived == 6  # the asks of one commit shared its one clone: no seventh fetch
    import json

    for sha, (out, _err) in zip(asks, outputs):
        answer = json.loads(out)
        assert answer["state"] == "ready" and answer["commit"] == sha
        assert_checkout_matches(answer["path"], repo.path, sha)
    store = only_repo(root)
    assert open(store.clone_log(shas[0])).read().count(" clone of ") == 1
