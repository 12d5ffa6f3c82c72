"""Connected or absent in a partial mirror (DESIGN invariant 13, issue 27): only blobs
may be promised. A server that sends a commit without its parent gets no ready answer,
a mirror left holding such a commit repairs itself, and verify finds the checkout.

The lying server is a real `git daemon` serving a repository whose `info/grafts` cuts
the commit from its parent: its upload-pack walks the commit alone and sends it, its
tree and blobs, never the parent (git's own connectivity check of a partial fetch takes
the parent for a promised object)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from .helpers import GitDaemon, SHORT_BACKOFF, Upstream, git, only_repo, pid_alive, run_cli, settled

PARTIAL = {"CHECKOUTCACHE_FILTER": "blob:none", **SHORT_BACKOFF}


@pytest.fixture
def history(tmp_path):
    """P, its children C and D (each with files of its own), served bare by a git daemon
    of this test; returns (daemon, served path, url, {name: sha})."""
    work = Upstream(str(tmp_path / "work"))
    shas = {"P": work.commit({"p.txt": "parent\n", "shared/s.txt": "s\n"}, message="P")}
    shas["C"] = work.commit({"c/c.txt": "child c\n"}, message="C")
    git("checkout", "-q", "-b", "other", shas["P"], cwd=work.path)
    shas["D"] = work.commit({"d/d.txt": "child d\n"}, message="D")
    base = str(tmp_path / "served")
    os.makedirs(base)
    served = os.path.join(base, "repo.git")
    git("clone", "-q", "--bare", work.path, served)
    git("config", "uploadpack.allowFilter", "true", cwd=served)
    daemon = GitDaemon(base)
    try:
        yield daemon, served, daemon.url("repo.git"), shas
    finally:
        daemon.stop()


def lie_about(served: str, *shas: str) -> None:
    """The server takes the commits for roots: it sends them without their parent."""
    with open(os.path.join(served, "info", "grafts"), "w") as handle:
        handle.write("".join(sha + "\n" for sha in shas))


def be_honest(served: str) -> None:
    os.unlink(os.path.join(served, "info", "grafts"))


def log_works(path: str) -> int:
    done = subprocess.run(["git", "-C", path, "log", "--format=%H"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return len(done.stdout.split())


FULL_FIRST = {"CHECKOUTCACHE_FIRST_FETCH": "full"}


@pytest.mark.slow
def test_a_commit_sent_without_its_parent_is_never_ready(root, history):
    """The full first fetch (CHECKOUTCACHE_FIRST_FETCH=full): the lie fails the clone."""
    daemon, served, url, shas = history
    lie_about(served, shas["C"])
    env = {**PARTIAL, **FULL_FIRST}
    code, answer, err = run_cli("ensure", url, shas["C"], "--wait", "60", root=root, env=env)
    assert code != 0 and answer["state"] == "failed", err  # it was `ready`, and `git log` exited 128 there
    assert answer["error"] == "CLONE_FAILED" and "without its whole history" in answer["message"]
    store = only_repo(root)
    assert not os.path.exists(store.checkout(shas["C"]))
    assert git("for-each-ref", "refs/keep/", cwd=store.mirror) == ""  # nothing kept for it
    # The server is honest again: the commit and its sibling come whole (it was wedged:
    # every commit needing P failed "could not fetch P from promisor remote").
    be_honest(served)
    time.sleep(1.0)  # the back-off (SHORT_BACKOFF) passes: a wait for a state, not for a speed
    code, answer, err = run_cli("ensure", url, shas["C"], "--wait", "60", root=root, env=env)
    assert code == 0 and answer["state"] == "ready", err
    assert log_works(answer["path"]) == 2
    code, answer, err = run_cli("ensure", url, shas["D"], "--wait", "60", root=root, env=env)
    assert code == 0 and answer["state"] == "ready", err
    assert log_works(answer["path"]) == 2


@pytest.mark.parametrize("partial", [True, False], ids=["partial", "full"])
def test_a_commit_sent_without_its_parent_is_shallow_never_complete(root, history, partial):
    """A shallow first answer (the default): the commit alone is what a depth-1 fetch asks
    for, so it is ready, its history shallow (`git log` works, down to its boundary). The
    history the lying server sends without the parent is never taken for complete (a partial
    fetch's check would: every commit and tree is walked), so the answer never says complete
    and the history fails until the server is honest; then it completes."""
    daemon, served, url, shas = history
    lie_about(served, shas["C"], shas["D"])  # no branch reaches P either
    env = PARTIAL if partial else SHORT_BACKOFF
    code, answer, err = run_cli("ensure", url, shas["C"], "--wait", "60", root=root, env=env)
    assert code == 0 and answer["history"] == "shallow", err
    assert log_works(answer["path"]) == 1
    code, answer, err = run_cli("ensure", url, shas["C"], "--history", "full", "--wait", "60", root=root, env=env)
    assert code == 1 and answer["error"] == "HISTORY_FAILED", err
    store = only_repo(root)
    assert os.path.exists(store.mirror_shallow)  # the boundary stays: C's parent is not vouched for
    assert log_works(store.checkout(shas["C"])) == 1
    be_honest(served)
    deadline = time.monotonic() + 60
    while True:  # each ask after the back-off (SHORT_BACKOFF) starts the history again
        code, answer, err = run_cli("ensure", url, shas["C"], "--history", "full", "--wait", "10", root=root, env=env)
        if code == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert code == 0 and answer["history"] == "complete", err
    assert log_works(answer["path"]) == 2


def test_a_full_mirror_refuses_the_same_server(root, history):
    daemon, served, url, shas = history
    lie_about(served, shas["C"], shas["D"])  # no branch reaches P: the fallback fetch of all refs lacks it too
    code, answer, err = run_cli("ensure", url, shas["C"], "--wait", "60", root=root, env={**SHORT_BACKOFF, **FULL_FIRST})
    assert code != 0 and answer["state"] == "failed" and answer["error"] == "CLONE_FAILED", err
    assert not os.path.exists(only_repo(root).checkout(shas["C"]))


def drop_from_mirror(mirror: str, sha: str) -> None:
    """What an older version left: the mirror holds every object but this one (kept
    commits whose parent it is included), all in promisor packs."""
    listed = git("cat-file", "--batch-all-objects", "--batch-check=%(objectname)", cwd=mirror).split()
    assert sha in listed
    pack_dir = os.path.join(mirror, "objects", "pack")
    old = os.listdir(pack_dir)
    name = subprocess.run(["git", "-C", mirror, "pack-objects", "-q", os.path.join(pack_dir, "pack")],
                          input="".join(o + "\n" for o in listed if o != sha), capture_output=True, text=True,
                          check=True).stdout.strip()
    for entry in old:
        os.unlink(os.path.join(pack_dir, entry))
    open(os.path.join(pack_dir, f"pack-{name}.promisor"), "w").close()
    for directory in os.listdir(os.path.join(mirror, "objects")):
        if len(directory) == 2:  # loose objects
            subprocess.run(["rm", "-rf", os.path.join(mirror, "objects", directory)], check=True)


@pytest.mark.slow
def test_a_mirror_holding_a_commit_without_its_parent_repairs_itself_and_verify_sees_it(root, history):
    daemon, served, url, shas = history
    code, answer, err = run_cli("ensure", url, shas["C"], "--wait", "60", "--history", "full", root=root,
                                env=PARTIAL)
    assert code == 0, err
    store = only_repo(root)
    drop_from_mirror(store.mirror, shas["P"])
    # verify notices the checkout whose history is gone (it said ok).
    code, report, err = run_cli("verify", "--json", root=root)
    assert code == 1, (report, err)
    broken = [c for c in report["checkouts"] if not c["ok"]]
    assert [c["commit"] for c in broken] == [shas["C"]] and "history" in broken[0]["problems"][0]
    # D needs P: the mirror is rebuilt instead of failing every such commit (a wedge).
    code, answer, err = run_cli("ensure", url, shas["D"], "--wait", "60", root=root, env=PARTIAL)
    assert code == 0 and answer["state"] == "ready", err
    assert log_works(answer["path"]) == 2
    # The rebuild fetched back what C's checkout borrows: its history works again.
    assert log_works(store.checkout(shas["C"])) == 2
    code, report, err = run_cli("verify", "--json", root=root)
    assert code == 0, (report, err)


@pytest.mark.slow
def test_a_fetch_killed_in_quarantine_leaves_the_mirror_as_it_was(root, history, fake_git, tmp_path):
    """A partial mirror's fetch lands in a quarantine first (git/quarantine.py): a worker
    SIGKILLed while its git fetch runs leaves nothing the mirror reads, and the next clone
    removes the quarantine (under the mirror lock) and the dead view (its owner lock is free)."""
    from checkoutcache.store.layout import QUARANTINE_PREFIX

    daemon, served, url, shas = history
    code, answer, err = run_cli("ensure", url, shas["C"], "--wait", "60", root=root, env=PARTIAL)
    assert code == 0, err
    settled(root)  # the history complete: the next commit is fetched into the mirror, through its quarantine
    store = only_repo(root)
    objects = os.path.join(store.mirror, "objects")
    kills = tmp_path / "kills"
    # The worker is killed by the git it started for the fetch (which then dies with it).
    killing = fake_git(f'case " $* " in *" fetch "*) echo "$PPID" >> {kills}; kill -9 "$PPID"; sleep 5;; esac')
    code, answer, err = run_cli("ensure", url, shas["D"], "--wait", "60", root=root, env={**PARTIAL, **killing})
    assert code == 1 and answer["error"] == "WORKER_DIED", err
    killed = [int(pid) for pid in kills.read_text().split()]
    assert len(killed) >= 3 and not any(pid_alive(pid) for pid in killed)
    left = [name for name in os.listdir(objects) if name.startswith(QUARANTINE_PREFIX)]
    assert left, "a worker killed during the fetch left its quarantine"
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", shas["D"]]).returncode != 0
    assert git("for-each-ref", f"refs/keep/{shas['D']}", cwd=store.mirror) == ""
    for name in left:  # older than a live writer's could be (git/mirror.py STALE_GIT_LOCK_AGE)
        os.utime(os.path.join(objects, name), (time.time() - 60, time.time() - 60))
    time.sleep(1.0)  # the back-off (SHORT_BACKOFF) passes
    code, answer, err = run_cli("ensure", url, shas["D"], "--wait", "60", root=root, env=PARTIAL)
    assert code == 0 and answer["state"] == "ready", err
    assert log_works(answer["path"]) == 2
    assert not [name for name in os.listdir(objects) if name.startswith(QUARANTINE_PREFIX)]
    private_tmp = tmp_path / "private" / "tmp"
    assert not [name for name in os.listdir(private_tmp) if name.startswith("checkoutcache-view-")]


def crafted_bundle(repo_path: str, ref_sha: str, objects: list[str]) -> bytes:
    pack = subprocess.run(["git", "-C", repo_path, "pack-objects", "--stdout"], input="\n".join(objects).encode(),
                          capture_output=True, check=True).stdout
    return f"# v2 git bundle\n{ref_sha} refs/heads/main\n\n".encode() + pack  # no prerequisites named


@pytest.mark.slow
def test_bundle_take_ins_into_a_partial_mirror_count_only_connected_history(tmp_path, served_upstream):
    """Bundle take-ins into a partial mirror are held to the same rule (issue 27): a bundle whose
    ref lacks its history is not taken in, and a commit a sound bundle carries without its
    parents (its pack is marked promisor once seeded) is fetched whole from upstream, never kept
    as it came."""
    from .test_bundles import seed_record, write_store

    repo, url = served_upstream
    first, middle, head = repo.shas
    # A bundle whose ref is a commit without its parents.
    lacking = [head, git("rev-parse", f"{head}^{{tree}}", cwd=repo.path)]
    lacking += [line.split()[2] for line in git("ls-tree", "-r", head, cwd=repo.path).splitlines()]
    node = str(tmp_path / "node-lacking")
    env = {**PARTIAL, "CHECKOUTCACHE_BUNDLE_URI": write_store(tmp_path / "store-lacking", url, {
        "100-abcdef12.bundle": crafted_bundle(repo.path, head, lacking)})}
    code, answer, err = run_cli("ensure", url, head, "--wait", "60", "--history", "full", root=node, env=env)
    assert code == 0, err
    record = seed_record(node)
    assert not record["seeded"] and record["reason"] == "bundle-unusable", record
    assert log_works(answer["path"]) == 3
    # A sound bundle (its ref is `first`) that also carries `head` alone.
    sound = git("rev-list", "--objects", first, cwd=repo.path).splitlines()
    planted = git("rev-list", "--objects", "--no-walk", head, cwd=repo.path).splitlines()
    node = str(tmp_path / "node-planted")
    env = {**PARTIAL, "CHECKOUTCACHE_BUNDLE_URI": write_store(tmp_path / "store-planted", url, {
        "100-abcdef12.bundle": crafted_bundle(repo.path, first, sorted({line.split()[0] for line in sound + planted}))})}
    code, answer, err = run_cli("ensure", url, head, "--wait", "60", "--history", "full", root=node, env=env)
    assert code == 0, err
    assert seed_record(node)["seeded"]
    assert log_works(answer["path"]) == 3
    code, answer, err = run_cli("ensure", url, middle, "--wait", "60", root=node, env=env)
    assert code == 0, err
    assert log_works(answer["path"]) == 2
    code, report, err = run_cli("verify", "--json", root=node)
    assert code == 0 and report["broken"] == 0, (report, err)
