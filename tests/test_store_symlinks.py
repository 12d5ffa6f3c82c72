"""Nothing outside the root, whoever shares it (issue 26, item 5; DESIGN invariant 12
for the store's own paths): in the trusted-peers mode every member of the root's
group can swap a store directory for a symlink. gc (the CLI's and the sidecar's
scheduled one) and `ensure` must then list, write, rename and delete nothing
through it: the repository is refused with a clear error (ELOOP, the path), the
rest of the store goes on, and what the symlink points at is left exactly as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from checkoutcache.store.checkouts import remove_tree
from checkoutcache.store.layout import RootPaths

from .helpers import (
    settled,
    Serve,
    make_idle,
    only_repo,
    run_cli,
    store_snapshot,
    wait_ready,
    wait_until,
)
from .test_shared_uids import GROUP, cli, second_user, shared_root  # noqa: F401 (fixtures)

SHARED = {"CHECKOUTCACHE_SHARING": "group"}  # the trusted-peers mode


def victim(base) -> str:
    """A directory outside the root holding what must survive: files, a subdirectory."""
    outside = os.path.join(str(base), "outside")
    os.makedirs(os.path.join(outside, "sub"))
    for rel in ("precious.txt", "sub/deeper.txt", ".hidden.tmp"):
        with open(os.path.join(outside, rel), "w") as handle:
            handle.write(f"{rel} must stay\n")
    old = time.time() - 3 * 86400  # old enough for every age-based removal gc makes
    for rel in ("precious.txt", "sub/deeper.txt", ".hidden.tmp", "sub", "."):
        os.utime(os.path.join(outside, rel), (old, old))
    return outside


def swap_for_symlink(store_dir: str, outside: str) -> None:
    """What a peer does: the real directory moves out of the root (so the store would
    still 'work' through the symlink) and a symlink to it takes its place."""
    moved = os.path.join(outside, os.path.basename(store_dir))
    shutil.move(store_dir, moved)
    os.symlink(moved, store_dir)


def problem_paths(report: dict) -> dict[str, str]:
    return {p["path"]: p["error"] for p in report["problems"]}


def test_gc_never_empties_a_trash_that_is_a_symlink(root, upstream, tmp_path):
    """Regression: gc listed trash/ through the symlink and remove_tree started each
    removal from realpath: the directory it pointed at was emptied."""
    wait_ready(root, upstream.path, upstream.shas[0], env=SHARED)
    paths = only_repo(root)
    outside = victim(tmp_path)
    os.rmdir(paths.trash_dir)
    os.symlink(outside, paths.trash_dir)
    before = store_snapshot(outside)
    code, report, out = run_cli("gc", root=root, env=SHARED)
    assert code == 0, out
    assert store_snapshot(outside) == before, "gc deleted through the symlink"
    assert problem_paths(report) == {f"repos/{paths.key}/trash": "ELOOP"}, report["problems"]
    assert "symlink" in report["problems"][0]["why"]


def test_removal_never_starts_from_realpath(root, upstream, tmp_path):
    """remove_tree of a trash entry whose trash/ was swapped for a symlink after it was listed:
    refused (ELOOP), nothing outside the root removed."""
    wait_ready(root, upstream.path, upstream.shas[0], env=SHARED)
    paths = only_repo(root)
    outside = victim(tmp_path)
    os.rmdir(paths.trash_dir)
    os.symlink(outside, paths.trash_dir)
    before = store_snapshot(outside)
    removal = remove_tree(paths.trash_entry("sub"))
    assert [(u.path, u.error) for u in removal.unremovable] == [("", "ELOOP")]
    assert store_snapshot(outside) == before
    from checkoutcache.store import tree

    with pytest.raises(tree.NotBeneath):
        tree.listdir(paths.trash_dir)


@pytest.mark.slow
@pytest.mark.parametrize("store_dir", ["trash", "logs", "state", "locks", "scratch", "checkouts", ".", "spares", "lfs", "mirror.git/refs"])
def test_no_store_directory_is_followed_by_ensure_or_gc(root, upstream, tmp_path, store_dir):
    """Each directory of a repository's store (and repos/<key> itself) swapped for a
    symlink to a directory outside the root: `ensure` of a new commit is refused
    with ROOT_UNUSABLE naming it (nothing written: no log, no state record, no lock,
    no scratch, no checkout), gc lists it as a problem and changes nothing there,
    and the other repository's store is still trimmed by the same run."""
    first, second = upstream.shas[0], upstream.shas[1]
    wait_ready(root, upstream.path, first, env=SHARED)
    other = wait_ready(root, upstream.path, first, extra=("--scope", "other"), env=SHARED)["path"]
    make_idle(other, 3600)
    root_paths = RootPaths(root)
    (key,) = [k for k in root_paths.repo_keys() if not other.startswith(root_paths.repo(k).base + "/")]
    paths = root_paths.repo(key)
    make_idle(paths.checkout(first), 3600)
    os.mkdir(os.path.join(paths.trash_dir, "evicted-before"))  # an interrupted deletion
    outside = os.path.join(str(tmp_path), "outside")
    os.makedirs(outside)
    target = paths.base if store_dir == "." else os.path.join(paths.base, store_dir)
    os.makedirs(target, exist_ok=True)  # (spares/ and lfs/ are made when first needed)
    swap_for_symlink(target, outside)
    before = store_snapshot(outside)
    shown = f"repos/{key}" + ("" if store_dir == "." else f"/{store_dir}")

    code, answer, out = run_cli("ensure", upstream.path, second, "--wait", "30", root=root, env=SHARED)
    assert store_snapshot(outside) == before, f"ensure wrote outside the root through {shown}"
    assert code != 0 and answer["error"] == "ROOT_UNUSABLE", out
    assert shown in answer["message"] and "symlink" in answer["message"], answer
    # Whole idle repositories are dropped too (CHECKOUTCACHE_REPO_MAX_IDLE): never a refused one.
    code, report, out = run_cli("gc", "--max-checkouts", "0", "--grace", "0", "--mirror-gc-interval", "0",
                                root=root, env={**SHARED, "CHECKOUTCACHE_REPO_MAX_IDLE": "1s"})
    assert code == 0, out
    assert store_snapshot(outside) == before, f"something changed outside the root through {shown}"
    assert os.path.islink(target), "the refused store was dropped"
    assert problem_paths(report).get(shown) == "ELOOP", report["problems"]
    # One bad repository costs that repository: the other one was trimmed.
    assert [r["name"] for r in report["removed"] if r["reason"] == "lru"] == [first]
    assert not os.path.exists(other)
    code, status, out = run_cli("status", root=root, env=SHARED)
    assert code == 0 and any(p["path"] == shown for r in status["repos"] for p in r["problems"]), out


@pytest.mark.parametrize("top_dir", ["serve", "unreachable"])
def test_gc_deletes_nothing_through_a_symlinked_top_level_directory(root, upstream, tmp_path, top_dir):
    """serve/ (stale journals) and unreachable/ (old records) are pruned by age: through a
    symlink, the old files of the directory it names went."""
    wait_ready(root, upstream.path, upstream.shas[0], env=SHARED)
    outside = os.path.join(str(tmp_path), "outside")
    os.makedirs(outside)
    name = "123.journal" if top_dir == "serve" else "0" * 32 + ".failed.json"
    with open(os.path.join(outside, name), "w") as handle:
        json.dump({"code": "UNREACHABLE", "message": "m", "next": "n", "attempts": 1, "failed_at": 1.0,
                   "retry_at": 2.0}, handle)
    old = time.time() - 3 * 86400
    os.utime(os.path.join(outside, name), (old, old))
    link = os.path.join(root, top_dir)
    shutil.rmtree(link, ignore_errors=True)
    os.symlink(outside, link)
    before = store_snapshot(outside)
    code, _, out = run_cli("gc", root=root, env=SHARED)
    assert code == 0, out
    assert store_snapshot(outside) == before


def test_root_locks_a_symlink_is_root_unusable(root, upstream, tmp_path):
    wait_ready(root, upstream.path, upstream.shas[0], env=SHARED)
    outside = os.path.join(str(tmp_path), "outside")
    os.makedirs(outside)
    swap_for_symlink(os.path.join(root, "locks"), outside)
    before = store_snapshot(outside)
    code, answer, out = run_cli("gc", root=root, env=SHARED)
    assert code != 0 and answer["error"] == "ROOT_UNUSABLE" and "locks" in answer["message"], out
    assert store_snapshot(outside) == before


@pytest.mark.slow
def test_the_sidecars_scheduled_gc_never_deletes_through_a_symlinked_trash(root, upstream, tmp_path):
    wait_ready(root, upstream.path, upstream.shas[0], env=SHARED)
    paths = only_repo(root)
    outside = victim(tmp_path)
    os.rmdir(paths.trash_dir)
    os.symlink(outside, paths.trash_dir)
    before = store_snapshot(outside)
    serve = Serve(root, tmp_path, env={**SHARED, "CHECKOUTCACHE_GC_INTERVAL": "1s"})
    try:
        def scheduled_runs() -> int:
            status, text = serve.request("GET", "/metrics")
            assert status == 200, text
            runs = [line for line in text.splitlines()
                    if line.startswith('checkoutcache_gc_runs_total{result="ok"}')]
            return int(float(runs[0].split()[-1])) if runs else 0

        wait_until(lambda: scheduled_runs() >= 2, 60, "two scheduled gc runs")
    finally:
        assert serve.stop() == 0, serve.log()
    assert store_snapshot(outside) == before, "the sidecar's gc deleted through the symlink"
    assert "scheduled gc failed" not in serve.log()


def _as_peer(user: str, script: str) -> None:
    import subprocess

    done = subprocess.run(["setpriv", f"--reuid={user}", f"--regid={GROUP}", "--init-groups", "sh", "-c", script],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="a second uid needs root")
@pytest.mark.parametrize("store_dir", ["trash", "logs", "state"])
def test_a_peer_uid_cannot_make_roots_gc_or_ensure_reach_outside(second_user, shared_root, served_upstream,
                                                                    store_dir, tmp_path):
    """The reproduction as a group member tried it: the second uid swaps trash/, logs/ or state/
    for a symlink to a directory of root's it may not change itself; root's gc and ensure (the
    sidecar's uid) then must not delete or write there."""
    upstream, url = served_upstream
    code, answer, out = cli(shared_root, "ensure", url, upstream.shas[0], "--wait", "60")
    assert code == 0, out
    paths = only_repo(shared_root)
    outside = victim(tmp_path)  # root's, 0755: the peer cannot write it
    os.chmod(outside, 0o755)
    target = os.path.join(paths.base, store_dir)
    _as_peer(second_user, f'mv "{target}" "{target}.away" && ln -s "{outside}" "{target}"')
    assert os.path.islink(target) and os.lstat(target).st_uid != 0
    before = store_snapshot(outside)
    code, answer, out = cli(shared_root, "ensure", url, upstream.shas[1], "--wait", "60")
    assert store_snapshot(outside) == before, "root's ensure wrote outside the root"
    gc_code, report, gc_out = cli(shared_root, "gc", "--max-checkouts", "0", "--grace", "0")
    assert store_snapshot(outside) == before, "root's gc changed something outside the root"
    assert code != 0 and answer["error"] == "ROOT_UNUSABLE" and "symlink" in answer["message"], out
    assert gc_code == 0, gc_out
    assert problem_paths(report) == {f"repos/{paths.key}/{store_dir}": "ELOOP"}, report["problems"]


def test_a_directory_swapped_after_the_gate_is_still_never_followed(root, upstream, tmp_path):
    """What a peer swaps between ensure's look at the store and the write: every writer and
    reader of the store (records, the clone log, locks, scratch, renames into trash) is
    refused with NotBeneath on its own, and nothing is made outside the root."""
    from checkoutcache.clone.worker import open_attempt_log
    from checkoutcache.store import locks, records, tree
    from checkoutcache.store.checkouts import to_trash
    from checkoutcache.store.scratch import create_scratch

    sha = upstream.shas[0]
    wait_ready(root, upstream.path, sha, env=SHARED)
    settled(root)  # the worker's tidying and the mirror's history are done writing
    paths = only_repo(root)
    outside = os.path.join(str(tmp_path), "outside")
    os.makedirs(outside)
    for name in ("state", "logs", "locks", "scratch", "trash"):
        swap_for_symlink(os.path.join(paths.base, name), outside)
    before = store_snapshot(outside)
    attempts = {
        "size record": lambda: records.write_json(paths.size_record(sha), {"bytes": 1}),
        "record read": lambda: records.read_json(paths.size_record(sha)),
        "clone log": lambda: open_attempt_log(paths, sha),
        "clone lock": lambda: locks.clone_of(paths, sha),
        "scratch": lambda: create_scratch(paths, sha),
        "to trash": lambda: to_trash(paths, paths.checkout(sha), "evicted"),
        "listing": lambda: tree.listdir(paths.trash_dir),
    }
    refused = {}
    for what, attempt in attempts.items():
        try:
            attempt()
        except tree.NotBeneath as exc:
            refused[what] = exc.filename
    assert set(refused) == set(attempts), f"followed: {sorted(set(attempts) - set(refused))}"
    assert all(path.startswith(paths.base + "/") for path in refused.values()), refused
    assert store_snapshot(outside) == before
    assert os.path.isdir(paths.checkout(sha)), "the checkout was not moved through the symlink"


@pytest.mark.parametrize("store_dir", ["checkouts", "."])
def test_a_ready_answer_never_goes_through_a_symlink(root, upstream, tmp_path, store_dir):
    """checkouts/ (or repos/<key>) moved outside the root and symlinked back: the ready path
    (the CLI's fast answer and the library's) neither answers from it nor records a use on
    the marker there; ensure answers ROOT_UNUSABLE naming the symlink."""
    from checkoutcache import Cache

    sha = upstream.shas[0]
    wait_ready(root, upstream.path, sha, env=SHARED)
    settled(root)  # the worker's tidying and the mirror's history are done writing
    paths = only_repo(root)
    make_idle(paths.checkout(sha), 3600)
    outside = os.path.join(str(tmp_path), "outside")
    os.makedirs(outside)
    target = paths.base if store_dir == "." else paths.checkouts_dir
    swap_for_symlink(target, outside)
    before = store_snapshot(outside)
    code, answer, out = run_cli("ensure", upstream.path, sha, root=root, env=SHARED)
    assert store_snapshot(outside) == before, "the ready answer recorded a use through the symlink"
    assert code != 0 and answer["error"] == "ROOT_UNUSABLE" and "symlink" in answer["message"], out
    answer = Cache(root).ensure(upstream.path, sha)
    assert answer.state != "ready" and answer.error == "ROOT_UNUSABLE", answer
    assert store_snapshot(outside) == before


def test_gc_reaps_no_workspaces_through_a_symlinked_workspaces_directory(root, upstream, tmp_path):
    """Regression (issue 26 adversarial review): the workspaces directory under the root was
    taken through realpath, so a peer's symlink `<root>/workspaces -> elsewhere` made gc
    delete every `.trash-*` and every lockless `ws-*` it found there."""
    wait_ready(root, upstream.path, upstream.shas[0], env=SHARED)
    outside = os.path.join(str(tmp_path), "outside")
    for rel in (".trash-1-aaaaaaaaaaaa/kept", "ws-1-bbbbbbbbbbbb/tree"):
        os.makedirs(os.path.join(outside, rel))
        with open(os.path.join(outside, rel, "precious.txt"), "w") as handle:
            handle.write("must stay\n")
    link = os.path.join(root, "workspaces")
    shutil.rmtree(link, ignore_errors=True)
    os.symlink(outside, link)
    before = store_snapshot(outside)
    code, report, out = run_cli("gc", root=root, env=SHARED)
    assert code == 0, out
    assert store_snapshot(outside) == before, "gc deleted through the symlinked workspaces directory"
    assert problem_paths(report).get(link) == "ELOOP", report["problems"]
    code, _, out = run_cli("status", root=root, env=SHARED)
    assert code == 0, out
    assert store_snapshot(outside) == before
