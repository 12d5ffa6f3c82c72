"""`ensure HEAD --base BASE` on a shallow mirror (issue 34), as the review of issue 34 found
it wanting: the merge base answered is git's own (never the first common commit a shallow
view shows while a boundary hides a better one), the checkout's git reaches it and BASE
(every boundary entry the installed objects need is in the mirror's shallow file, and BASE
is kept by a ref), a search that ends after the history completed leaves the mirror
complete, and the deepening stops at CHECKOUTCACHE_BASE_DEEPEN, handing over to the
background history.

Every test runs against a real `git daemon`, through the CLI or the library."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from checkoutcache.cache import Cache
from checkoutcache.store import locks

from .helpers.store import no_history_running, shallow_entries
from .helpers import Upstream, assert_checkout_matches, git, only_repo, run_cli, settled, wait_until
from .test_cold_start import KILL_AT, commits_in, full_history

HELD = {KILL_AT: "history-start"}
pytestmark = pytest.mark.slow  # each over a second: real fetches, a history, gc


def criss_cross(daemon) -> tuple[Upstream, str, dict[str, str]]:
    """R and 20 commits, C1, then three lines from C1: h1 (HEAD's first parent), b1 (BASE's first
    parent), and q1..q6 (Q) from which l1..l6 (HEAD's second parent) and m1..m6 (BASE's second
    parent) branch. git's merge base of HEAD and BASE is Q; a shallow view deepened two commits
    shows C1 common to both first (through h1 and b1) while l* and m* hide Q behind their
    boundary."""
    repo = Upstream(os.path.join(daemon.base, f"criss-{os.urandom(3).hex()}"))
    shas = {"R": repo.commit({"f": "R\n"}, "R")}
    for number in range(20):
        repo.commit({"f": f"p{number}\n"}, f"p{number}")
    shas["C1"] = repo.commit({"f": "C1\n"}, "C1")

    def line(start: str, tag: str, count: int) -> str:
        git("checkout", "-q", "-B", f"line-{tag}", start, cwd=repo.path)
        for number in range(1, count + 1):
            last = repo.commit({f"{tag}.txt": f"{tag}{number}\n"}, f"{tag}{number}")
        return last

    shas["h1"] = line(shas["C1"], "h", 1)
    shas["b1"] = line(shas["C1"], "b", 1)
    shas["Q"] = line(shas["C1"], "q", 6)
    shas["l6"] = line(shas["Q"], "l", 6)
    shas["m6"] = line(shas["Q"], "m", 6)

    def merge(first: str, second: str, name: str) -> str:
        git("checkout", "-q", "-B", name, first, cwd=repo.path)
        git("merge", "-q", "--no-ff", "-m", name, second, cwd=repo.path)
        return git("rev-parse", "HEAD", cwd=repo.path)

    shas["HEAD"] = merge(shas["h1"], shas["l6"], "head")
    shas["BASE"] = merge(shas["b1"], shas["m6"], "base")
    git("checkout", "-q", "head", cwd=repo.path)
    assert git("merge-base", shas["HEAD"], shas["BASE"], cwd=repo.path) == shas["Q"]
    return repo, daemon.url(os.path.basename(repo.path)), shas


def test_the_merge_base_is_gits_own_and_the_checkout_reaches_it_and_the_base(root, daemon):
    """Regression (review of issue 34): the search took the first merge base its shallow view
    showed (C1, through the short lines), stored it and answered it even once the history was
    complete; and it installed BASE's objects without their boundary entries, so `git
    merge-base HEAD BASE` in the checkout failed on a missing parent."""
    repo, url, shas = criss_cross(daemon)
    first = run_cli("ensure", url, shas["HEAD"], "--wait", "60", root=root, env=HELD)[1]
    assert first["history"] == "shallow", first
    no_history_running(root)
    code, answer, out = run_cli("ensure", url, shas["HEAD"], "--base", shas["BASE"], "--wait", "60", root=root,
                                env=HELD)
    assert code == 0 and answer["merge_base"] == shas["Q"] and answer["history"] == "shallow", out
    path = answer["path"]
    # The checkout's git agrees, reading BASE's side too; the mirror's boundary claims no more than it has.
    assert git("merge-base", "HEAD", shas["BASE"], cwd=path) == shas["Q"]
    assert sorted(git("log", "--format=%s", f"{shas['BASE']}..HEAD", cwd=path).split()) == \
        ["h1", "head", "l1", "l2", "l3", "l4", "l5", "l6"]
    assert shallow_entries(root), "the mirror is still shallow (the history was held)"
    git("fsck", "--connectivity-only", "--no-dangling", cwd=only_repo(root).mirror)
    assert_checkout_matches(path, repo.path, shas["HEAD"])
    # Once the history is complete: the same merge base, and the checkout still reaches BASE.
    full_history(root, url, shas["HEAD"])
    code, answer, out = run_cli("ensure", url, shas["HEAD"], "--base", shas["BASE"], root=root)
    assert code == 0 and answer["merge_base"] == shas["Q"] and answer["history"] == "complete", out
    assert git("merge-base", "HEAD", shas["BASE"], cwd=path) == shas["Q"]
    assert commits_in(path, shas["BASE"]) == len(git("rev-list", shas["BASE"], cwd=repo.path).split())
    git("fsck", "--connectivity-only", "--no-dangling", cwd=only_repo(root).mirror)


def test_a_merge_base_an_older_version_recorded_is_searched_again(root, daemon):
    """A merge base recorded before the search proved what it found (it may be the first common
    commit of a shallow view, C1 here) is never answered: it is searched again."""
    repo, url, shas = criss_cross(daemon)
    run_cli("ensure", url, shas["HEAD"], "--wait", "60", root=root, env=HELD)
    no_history_running(root)
    store = only_repo(root)
    with open(store.bases_record(shas["HEAD"]), "w") as handle:
        json.dump({"bases": {shas["BASE"]: shas["C1"]}, "at": time.time()}, handle)
    answer = Cache(root).ensure(url, shas["HEAD"], base=shas["BASE"])
    assert answer.merge_base != shas["C1"], answer
    answer = Cache(root).ensure(url, shas["HEAD"], base=shas["BASE"], wait=60)
    assert answer.state == "ready" and answer.merge_base == shas["Q"], answer


def pull_request(daemon, before: int = 20, on_main: int = 12, on_feature: int = 10) -> tuple[Upstream, str, dict]:
    """main: `before` commits, F, then `on_main` more (BASE); feature: `on_feature` commits from F (HEAD)."""
    repo = Upstream(os.path.join(daemon.base, f"pr-{os.urandom(3).hex()}"))
    for number in range(before):
        repo.commit({"main.txt": f"m{number}\n"}, f"before {number}")
    fork = repo.commit({"main.txt": "F\n"}, "F")
    for number in range(on_main):
        base = repo.commit({"main.txt": f"main {number}\n"}, f"main {number}")
    git("checkout", "-q", "-b", "feature", fork, cwd=repo.path)
    for number in range(on_feature):
        head = repo.commit({"feature.txt": f"feature {number}\n"}, f"feature {number}")
    git("checkout", "-q", "main", cwd=repo.path)
    return repo, daemon.url(os.path.basename(repo.path)), {"HEAD": head, "BASE": base, "F": fork}


def deepened(log_path: str) -> list[int]:
    return [int(n) for n in re.findall(r"--deepen=(\d+)", open(log_path).read())]


def test_the_deepening_stops_at_its_bound_and_the_history_answers(root, daemon):
    """Regression (review of issue 34): the bound (git/shallow.py MAX_DEEPEN) was never used, and
    the deepening doubled until it found a merge base, at the answers' priority, both whole
    histories for unrelated ones. Past the bound the search installs what it fetched (BASE's
    side with its boundary: the checkout's git reads BASE) and hands over: the answer is the
    background history's progress, then the merge base once it is complete."""
    repo, url, shas = pull_request(daemon)
    run_cli("ensure", url, shas["HEAD"], "--wait", "60", root=root, env=HELD)
    no_history_running(root)
    store = only_repo(root)
    gate = locks.try_lock(store.clone_lock("f" * 40))  # a clone of the repository, as the history sees it
    assert gate is not None
    env = {"CHECKOUTCACHE_BASE_DEEPEN": "4"}
    try:
        seen = []

        def waits_for_the_history() -> bool:
            code, answer, out = run_cli("ensure", url, shas["HEAD"], "--base", shas["BASE"], root=root, env=env)
            seen.append(out)
            return code == 75 and answer["base"] == shas["BASE"] and answer["history"] == "shallow" and \
                answer["progress"].get("phase") == "waiting for clones"

        wait_until(waits_for_the_history, 60, "the merge base handed over to the history")
        answer = json.loads(seen[-1])
        assert answer["pid"] and os.path.exists(f"/proc/{answer['pid']}") and "merge_base" not in answer, answer
        log = store.clone_log(shas["HEAD"])
        assert sum(deepened(log)) <= 4 and "handed over" in open(log).read(), open(log).read()
        # What it fetched is in the mirror with its boundary, both sides: the checkout's git reads BASE.
        path = store.checkout(shas["HEAD"])
        assert 1 < commits_in(path, shas["BASE"]) < 13
        assert 1 < commits_in(path) < 11
        git("fsck", "--connectivity-only", "--no-dangling", cwd=store.mirror)
    finally:
        gate.release()
    answer = Cache(root).ensure(url, shas["HEAD"], base=shas["BASE"], wait=120)
    assert answer.state == "ready" and answer.merge_base == shas["F"] and answer.history == "complete", answer
    assert commits_in(answer.path, shas["BASE"]) == 33 and commits_in(answer.path) == 31
    assert git("merge-base", "HEAD", shas["BASE"], cwd=answer.path) == shas["F"]


def test_a_search_ending_after_the_history_completed_leaves_the_mirror_complete(root, daemon):
    """Regression (review of issue 34): a --base search read the mirror's boundary, fetched, and
    installed its boundary change without looking again: the history completed meanwhile, and the
    search made the mirror shallow again. Its depth-1 fetch of BASE is held (a proxy holds every
    answer to a shallow fetch) while the history completes; let go, it searches the complete
    mirror instead and installs no boundary."""
    from .helpers.gate import RequestGate

    repo, _, shas = pull_request(daemon, before=5, on_main=4, on_feature=3)
    gate = RequestGate(daemon.port, b"deepen ")
    url = gate.url(os.path.basename(repo.path))
    try:
        run_cli("ensure", url, shas["HEAD"], "--wait", "60", root=root, env=HELD)
        no_history_running(root)
        store = only_repo(root)
        gate.shut()
        code, answer, out = run_cli("ensure", url, shas["HEAD"], "--base", shas["BASE"], root=root)
        assert code == 75, out
        wait_until(lambda: gate.held >= 1, 60, "the search's fetch of BASE held")
        full_history(root, url, shas["HEAD"], wait="60")  # the history's fetch is not a shallow one: it runs
        assert not os.path.exists(store.mirror_shallow)
        gate.open()
        answer = Cache(root).ensure(url, shas["HEAD"], base=shas["BASE"], wait=60)
        assert answer.state == "ready" and answer.merge_base == shas["F"], answer
        wait_until(lambda: not locks.base_search_running(store, shas["HEAD"]), what="the search's end")
        assert answer.history == "complete" and not os.path.exists(store.mirror_shallow), \
            open(store.mirror_shallow).read()
        assert commits_in(answer.path) == 9
        assert git("merge-base", "HEAD", shas["BASE"], cwd=answer.path) == shas["F"]
        git("fsck", "--connectivity-only", "--no-dangling", cwd=store.mirror)
    finally:
        gate.close()


def test_a_base_is_kept_while_the_checkout_that_asked_for_it_lives(root, daemon):
    """BASE's ref (refs/bases/) keeps its objects in the mirror, so the checkout's `git merge-base
    HEAD BASE` works after gc's repack too; gc drops it with the last checkout whose record names it."""
    from .helpers import make_idle

    repo, url, shas = pull_request(daemon, before=3, on_main=2, on_feature=2)
    code, answer, out = run_cli("ensure", url, shas["HEAD"], "--base", shas["BASE"], "--wait", "60", root=root)
    assert code == 0 and answer["merge_base"] == shas["F"], out
    store = only_repo(root)
    settled(root)  # the history (started after the answer: its lock alone may be free before it runs)
    wait_until(lambda: not locks.base_search_running(store, shas["HEAD"]), what="the search done")
    refs = lambda: git("for-each-ref", "--format=%(refname)", "refs/bases/", cwd=store.mirror).split()  # noqa: E731
    assert refs() == [f"refs/bases/{shas['BASE']}"]
    code, report, out = run_cli("gc", "--mirror-gc-interval", "0", root=root)
    assert code == 0 and refs() == [f"refs/bases/{shas['BASE']}"], out
    assert git("merge-base", "HEAD", shas["BASE"], cwd=answer["path"]) == shas["F"]
    make_idle(answer["path"], 3600)
    code, report, out = run_cli("gc", "--max-checkouts", "0", "--max-spares", "0", "--mirror-gc-interval", "0",
                                root=root)
    assert code == 0 and not os.path.exists(answer["path"]), out
    assert refs() == [] and report["mirrors"][0]["refs_dropped"] == 2, report
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", shas["BASE"]]).returncode != 0


def linear(daemon, count: int = 60, fork_back: int = 20, side: int = 3, second_back: int | None = None) -> tuple:
    """main: `count` commits; side: `side` commits from main~fork_back; side2 likewise from
    main~second_back when given."""
    repo = Upstream(os.path.join(daemon.base, f"lin-{os.urandom(3).hex()}"))
    for number in range(1, count + 1):
        repo.commit({"main.txt": f"m{number}\n"}, f"m{number}")
    main = list(repo.shas)  # main[-1 - n] is main~n
    shas = {"main": main[-1]}
    for name, back in (("side", fork_back), ("side2", second_back)):
        if back is None:
            continue
        git("checkout", "-q", "-b", name, main[-1 - back], cwd=repo.path)
        for number in range(1, side + 1):
            shas[name] = repo.commit({f"{name}.txt": f"{name}{number}\n"}, f"{name}{number}")
        git("checkout", "-q", "main", cwd=repo.path)
    return main, daemon.url(os.path.basename(repo.path)), shas


def mirror_sound(root: str) -> None:
    done = subprocess.run(["git", "-C", only_repo(root).mirror, "fsck", "--connectivity-only", "--no-dangling"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "broken link" not in done.stdout + done.stderr, done.stdout + done.stderr


def test_a_second_search_never_drops_a_boundary_entry_whose_history_is_missing(root, daemon):
    """Regression (second review of issue 34): `--base side` deepened main's line to an entry E;
    `--base main~2` (already in the mirror, with its history) then fetched main~2 at depth 1,
    kept only the entries its two commits reach and dropped E: the mirror claimed history it
    lacked (fsck: broken link), the checkout's `git merge-base HEAD side` could not read a
    parent, and an older commit's checkout was answered ready with a `git log` that failed."""
    main, url, shas = linear(daemon)
    head, older = shas["main"], main[-31]
    run_cli("ensure", url, head, "--wait", "60", root=root, env=HELD)
    no_history_running(root)
    code, answer, out = run_cli("ensure", url, head, "--base", shas["side"], "--wait", "60", root=root, env=HELD)
    assert code == 0 and answer["merge_base"] == main[-21], out
    path = answer["path"]
    code, answer, out = run_cli("ensure", url, head, "--base", main[-3], "--wait", "60", root=root, env=HELD)
    assert code == 0 and answer["merge_base"] == main[-3], out
    mirror_sound(root)
    assert git("merge-base", "HEAD", shas["side"], cwd=path) == main[-21]
    code, answer, out = run_cli("ensure", url, older, "--wait", "60", root=root, env=HELD)
    assert code == 0, out
    git("log", "--format=%H", cwd=answer["path"])  # every commit it reaches can be read
    mirror_sound(root)


def test_a_search_never_cuts_the_history_another_checkout_reaches(root, daemon):
    """Regression (second review of issue 34): a checkout A (main~6) deepened by `--base side`
    had 16 commits of history; `--base side2` of main deepened through A's range, and git
    registered a boundary entry inside it (git lists every commit at a fetch's depth, even one
    whose parents the mirror has): A's log fell to 6 commits and its `git merge-base HEAD side`
    found nothing, while its answer still named the merge base."""
    main, url, shas = linear(daemon, fork_back=20, second_back=5)
    a = main[-7]
    run_cli("ensure", url, a, "--wait", "60", root=root, env=HELD)
    no_history_running(root)
    code, answer, out = run_cli("ensure", url, a, "--base", shas["side"], "--wait", "60", root=root, env=HELD)
    assert code == 0 and answer["merge_base"] == main[-21], out
    a_path = answer["path"]
    before = commits_in(a_path)
    assert git("merge-base", "HEAD", shas["side"], cwd=a_path) == main[-21]
    run_cli("ensure", url, shas["main"], "--wait", "60", root=root, env=HELD)
    code, answer, out = run_cli("ensure", url, shas["main"], "--base", shas["side2"], "--wait", "60", root=root,
                                env=HELD)
    assert code == 0 and answer["merge_base"] == main[-6], out
    assert commits_in(a_path) >= before
    assert git("merge-base", "HEAD", shas["side"], cwd=a_path) == main[-21]
    mirror_sound(root)


def test_a_search_whose_checkout_is_evicted_meanwhile_records_nothing(root, daemon):
    """Regression (second review of issue 34): gc evicted the checkout (its keep-ref dropped, its
    commit pruned) while its --base search waited on the network; the search then failed
    (`error in object: unshallow`) or found no merge base for a commit it could no longer read,
    recorded it, and the checkout made again was answered that verdict (CLONE_FAILED for the
    back-off, or NO_MERGE_BASE for as long as it lived). The search's deepening is held by a
    proxy while gc runs."""
    from .helpers.gate import RequestGate

    main, direct, shas = linear(daemon)
    name = direct.rsplit("/", 1)[-1]
    gate = RequestGate(daemon.port, b"deepen-relative")
    url = gate.url(name)
    try:
        run_cli("ensure", url, shas["main"], "--wait", "60", root=root, env=HELD)
        no_history_running(root)
        store = only_repo(root)
        gate.shut()
        code, answer, out = run_cli("ensure", url, shas["main"], "--base", shas["side"], root=root, env=HELD)
        assert code == 75, out
        wait_until(lambda: gate.held >= 1, 60, "the search's deepening held")
        code, report, out = run_cli("gc", "--grace", "0", "--max-checkouts", "0", "--max-spares", "0", root=root)
        assert code == 0 and [r["name"] for r in report["removed"] if r["reason"] == "lru"] == [shas["main"]], out
        gate.open()
        wait_until(lambda: not locks.base_search_running(store, shas["main"]), 60, "the search's end")
        run_cli("ensure", url, shas["main"], "--wait", "60", root=root, env=HELD)
        code, answer, out = run_cli("ensure", url, shas["main"], "--base", shas["side"], "--wait", "60", root=root,
                                    env=HELD)
        assert code == 0 and answer["merge_base"] == main[-21], out
        mirror_sound(root)
    finally:
        gate.close()


def test_a_leftover_commit_object_is_never_taken_for_history(root, daemon):
    """Third review of issue 34: a commit object that is in the mirror but that no ref reaches
    (what a killed install or prune leaves: c3 here, without its tree) counted as c4's history,
    so c4's boundary entry was skipped and the mirror claimed a history whose tree it lacked
    (fsck: missing tree; `git show HEAD~1` in c4's checkout failed). An entry is skipped only
    where its parents are in the history the refs reach."""
    repo = Upstream(os.path.join(daemon.base, f"left-{os.urandom(3).hex()}"))
    for number in range(6):
        repo.commit({f"f{number}.txt": f"content {number}\n" * 20, "shared.txt": f"v{number}\n"}, f"c{number}")
    url = daemon.url(os.path.basename(repo.path))
    c = repo.shas
    run_cli("ensure", url, c[2], "--wait", "60", root=root, env=HELD)
    no_history_running(root)
    mirror = only_repo(root).mirror
    body = subprocess.run(["git", "-C", repo.path, "cat-file", "commit", c[3]], capture_output=True).stdout
    planted = subprocess.run(["git", "-C", mirror, "hash-object", "-t", "commit", "-w", "--stdin"], input=body,
                             capture_output=True)
    assert planted.stdout.decode().strip() == c[3]
    code, answer, out = run_cli("ensure", url, c[4], "--wait", "60", root=root, env=HELD)
    assert code == 0, out
    assert c[4] in shallow_entries(root)
    mirror_sound(root)
    git("log", "-p", cwd=answer["path"])  # every commit it shows, with its tree
