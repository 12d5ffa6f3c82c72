"""Every guarantee holds on a shallow or half-filled mirror (issue 34, point 7): gc and its
repack, spares, submodules (each fetched shallow first, its history following), Git LFS,
review refs and a fetch-by-id refusal (which falls back as before), bundles (tests/
test_bundles.py), sparse cones of a partial mirror, fsck's choices on every shallow and
deepening fetch, the pygit2 transport (full mirrors), and a workspace's own boundary.

A history the test must keep from arriving dies at its start (CHECKOUTCACHE_TEST_KILL_AT=
history-start, given to every command: each history any of them starts dies so), and is
let through at the end."""

from __future__ import annotations

import os
import subprocess

import pytest

from checkoutcache.cache import Cache

from .helpers.store import no_history_running, shallow_entries
from .helpers import (
    Upstream,
    assert_checkout_matches,
    git,
    make_idle,
    only_repo,
    run_cli,
    settled,
    wait_ready,
    wait_until,
)
from .helpers.lfs import lfs_oid
from .test_cold_start import KILL_AT, commits_in, full_history, grow
from .test_lfs import A, B, lfs_server, read  # noqa: F401 (lfs_server: the fixture, an https git + LFS server)

HELD = {KILL_AT: "history-start"}


def test_gc_and_its_repack_on_a_shallow_mirror(root, served_upstream):
    repo, url = served_upstream
    grow(repo, 10)
    kept = wait_ready(root, url, repo.shas[-1], env=HELD)
    evicted = wait_ready(root, url, repo.shas[5], env=HELD)
    no_history_running(root)
    assert shallow_entries(root) == sorted([repo.shas[-1], repo.shas[5]])
    make_idle(evicted["path"], 3600)
    code, report, out = run_cli("gc", "--max-checkouts", "1", "--max-spares", "0", "--mirror-gc-interval", "0",
                                root=root, env=HELD)
    assert code == 0, out
    (entry,) = report["mirrors"]
    assert entry["refs_dropped"] == 1 and entry["repacked"] is True and entry["history"] == "shallow", entry
    assert not os.path.exists(evicted["path"])
    # git's own prune drops the boundary entry of a commit gone from the mirror; the kept one stays.
    assert shallow_entries(root) == [repo.shas[-1]]
    assert_checkout_matches(kept["path"], repo.path, repo.shas[-1])
    assert commits_in(kept["path"]) == 1 and git("--no-optional-locks", "status", "--porcelain",
                                                 cwd=kept["path"]) == ""
    git("fsck", "--connectivity-only", "--no-dangling", cwd=only_repo(root).mirror)
    full_history(root, url, repo.shas[-1])
    assert commits_in(kept["path"]) == len(repo.shas)


def test_a_spare_is_updated_into_a_new_commit_of_a_shallow_mirror(root, served_upstream):
    repo, url = served_upstream
    first = wait_ready(root, url, repo.shas[1], env=HELD)
    no_history_running(root)
    make_idle(first["path"], 3600)
    code, report, out = run_cli("gc", "--max-checkouts", "0", root=root, env=HELD)
    assert code == 0 and [r for r in report["removed"] if r["spare"]], out
    no_history_running(root)
    answer = wait_ready(root, url, repo.shas[2], env=HELD)
    assert answer["history"] == "shallow"
    assert "updated the spare of" in open(only_repo(root).clone_log(repo.shas[2])).read()
    assert_checkout_matches(answer["path"], repo.path, repo.shas[2])
    no_history_running(root)
    full_history(root, url, repo.shas[2])
    assert commits_in(answer["path"]) == 3


def served(daemon, name: str) -> tuple[Upstream, str]:
    repo = Upstream(os.path.join(daemon.base, f"{name}-{os.urandom(3).hex()}"))
    return repo, daemon.url(os.path.basename(repo.path))


def test_a_submodule_is_fetched_shallow_first_and_its_history_follows(root, daemon):
    from .test_submodules import with_submodule

    sub, sub_url = served(daemon, "sub")
    for number in range(5):
        sub_sha = sub.commit({"lib.txt": f"library v{number}\n"}, message=f"lib {number}")
    top, top_url = served(daemon, "top")
    top.commit({"README.md": "top\n"})
    sha = with_submodule(top, "vendor/lib", f"../{os.path.basename(sub.path)}", sub_sha)
    answer = wait_ready(root, top_url, sha, timeout=120, env=HELD)
    assert answer["submodules"] == "included" and answer["history"] == "shallow"
    lib = os.path.join(answer["path"], "vendor", "lib")
    assert git("rev-parse", "HEAD", cwd=lib) == sub_sha and commits_in(lib) == 1  # the submodule's commit alone
    assert git("--no-optional-locks", "status", "--porcelain", cwd=answer["path"]) == ""
    for key in os.listdir(os.path.join(root, "repos")):  # both mirrors shallow
        assert os.path.getsize(os.path.join(root, "repos", key, "mirror.git", "shallow")) > 0
    # The submodule's history follows as its repository's own (asked here through its URL).
    code, sub_answer, out = run_cli("ensure", sub_url, sub_sha, "--history", "full", "--wait", "120", root=root)
    assert code == 0 and sub_answer["history"] == "complete", out
    assert commits_in(lib) == 5  # the submodule inside the superproject's checkout has it too
    full_history(root, top_url, sha)


def superproject(daemon) -> tuple[Upstream, str, str, str, str]:
    """A superproject whose commit holds a submodule at the last of its 5 commits:
    (sub, sub_url, top_url, top commit, sub commit)."""
    from .test_submodules import with_submodule

    sub, sub_url = served(daemon, "sub")
    for number in range(5):
        sub_sha = sub.commit({"lib.txt": f"library v{number}\n"}, message=f"lib {number}")
    top, top_url = served(daemon, "top")
    top.commit({"README.md": "top\n"})
    top.commit({"README.md": "top, again\n"})
    sha = with_submodule(top, "vendor/lib", f"../{os.path.basename(sub.path)}", sub_sha)
    return sub, sub_url, top_url, sha, sub_sha


@pytest.mark.slow
def test_history_full_waits_for_the_submodules_histories_too(root, daemon):
    """Regression (review of issue 34): `--history full` of a superproject's commit answered
    complete while its submodule's mirror was still shallow, and never started that history:
    `git log` and `blame` inside the submodule stopped at its commit."""
    sub, sub_url, top_url, sha, sub_sha = superproject(daemon)
    answer = wait_ready(root, top_url, sha, timeout=120, env=HELD)
    assert answer["history"] == "shallow"
    settled(root)
    lib = os.path.join(answer["path"], "vendor", "lib")
    assert commits_in(lib) == 1
    code, done, out = run_cli("ensure", top_url, sha, "--history", "full", "--wait", "120", root=root)
    assert code == 0 and done["history"] == "complete", out
    assert commits_in(done["path"]) == 3 and commits_in(lib) == 5
    assert git("blame", "--porcelain", "lib.txt", cwd=lib)


@pytest.mark.slow
def test_history_full_of_a_complete_superproject_waits_for_a_shallow_submodule(root, daemon):
    """The superproject's mirror complete (fetched whole), its submodule's commit fetched at depth 1
    before: a plain answer says the superproject's history (complete), `--history full` waits for
    the submodule's too (the ready path sees the shallow submodule mirror, one stat)."""
    sub, sub_url, top_url, sha, sub_sha = superproject(daemon)
    wait_ready(root, sub_url, sub_sha, env=HELD)
    answer = wait_ready(root, top_url, sha, timeout=120, env={"CHECKOUTCACHE_FIRST_FETCH": "full", **HELD})
    assert answer["history"] == "complete"
    lib = os.path.join(answer["path"], "vendor", "lib")
    assert commits_in(lib) == 1
    cache = Cache(root)
    first = cache.ensure(top_url, sha, history="full")
    assert first.state == "cloning" and first.history == "shallow", first
    done = cache.ensure(top_url, sha, history="full", wait=120)
    assert done.state == "ready" and done.history == "complete", done
    assert commits_in(lib) == 5


@pytest.mark.slow
def test_lfs_content_on_a_shallow_mirror_is_downloaded_once(root, lfs_server):
    up = lfs_server.upstream
    first = up.commit_lfs({"a.bin": A}, {"README": "one\n"})
    second = up.commit_lfs({"b.bin": B}, {"README": "two\n"})
    url = lfs_server.url("127.0.0.1", "repo")
    answer = wait_ready(root, url, second, env={**lfs_server.env, **HELD})
    assert answer["lfs"] == "content" and answer["history"] == "shallow", answer
    assert read(os.path.join(answer["path"], "a.bin")) == A and read(os.path.join(answer["path"], "b.bin")) == B
    no_history_running(root)
    code, done, out = run_cli("ensure", url, second, "--history", "full", "--wait", "120", root=root,
                              env=lfs_server.env)
    assert code == 0 and done["history"] == "complete" and done["lfs"] == "content", out
    older = wait_ready(root, url, first, env=lfs_server.env)
    assert older["lfs"] == "content" and read(os.path.join(older["path"], "a.bin")) == A
    assert dict(lfs_server.lfs_downloads) == {lfs_oid(A): 1, lfs_oid(B): 1}  # once each, history or not


def test_a_fetch_by_id_refused_falls_back_as_before(root, daemon, tmp_path):
    """A server that refuses unadvertised ids (protocol v0, no allow*SHA1InWant): the depth-1
    fetch of a commit inside the history is refused, so it is fetched as before: every branch
    and tag, whole. Its answer then has the complete history at once."""
    repo, url = served(daemon, "refusing")
    repo.standard_history(4)
    operator = tmp_path / "operator-gitconfig"
    operator.write_text("[protocol]\n\tversion = 0\n")
    env = {"CHECKOUTCACHE_GIT_CONFIG": str(operator)}
    code, answer, out = run_cli("ensure", url, repo.shas[1], "--wait", "60", root=root, env=env)
    assert code == 0 and answer["history"] == "complete", out
    log = open(only_repo(root).clone_log(repo.shas[1])).read()
    assert "could not be fetched" in log and "fetching all refs" in log, log
    assert commits_in(answer["path"]) == 2
    # The tip is advertised: fetched by id at depth 1 is allowed, and the history follows as usual.
    other = str(tmp_path / "other-root")
    code, answer, out = run_cli("ensure", url, repo.shas[-1], "--wait", "60", root=other, env=env)
    assert code == 0, out
    code, answer, out = run_cli("ensure", url, repo.shas[-1], "--history", "full", "--wait", "60", root=other,
                                env=env)
    assert code == 0 and answer["history"] == "complete" and commits_in(answer["path"]) == 4, out


def test_a_review_ref_commit_on_a_shallow_mirror(root, daemon, tmp_path):
    """A pull request's tip first (shallow), then a commit inside it that the server refuses by
    id: found through the review refs, as before, beside the shallow boundary."""
    repo, url = served(daemon, "pr")
    repo.commit({"README.md": "main\n"})
    git("checkout", "-q", "-b", "feature", cwd=repo.path)
    inside = repo.commit({"feature.txt": "one\n"})
    tip = repo.commit({"feature.txt": "two\n"})
    git("update-ref", "refs/pull/7/head", tip, cwd=repo.path)
    git("checkout", "-q", "main", cwd=repo.path)
    git("branch", "-q", "-D", "feature", cwd=repo.path)
    operator = tmp_path / "operator-gitconfig"
    operator.write_text("[protocol]\n\tversion = 0\n")
    env = {"CHECKOUTCACHE_GIT_CONFIG": str(operator), **HELD}
    first = wait_ready(root, url, tip, env=env)
    assert first["history"] == "shallow"
    answer = wait_ready(root, url, inside, env=env)
    assert_checkout_matches(answer["path"], repo.path, inside)
    assert "review ref(s) under refs/pull/*" in open(only_repo(root).clone_log(inside)).read()
    assert commits_in(answer["path"]) == 2  # fetched whole, as before
    no_history_running(root)
    code, answer, out = run_cli("ensure", url, tip, "--history", "full", "--wait", "60", root=root,
                                env={"CHECKOUTCACHE_GIT_CONFIG": str(operator)})
    assert code == 0 and answer["history"] == "complete" and commits_in(answer["path"]) == 3, out


def test_a_sparse_cone_of_a_partial_shallow_mirror(root, served_upstream):
    """CHECKOUTCACHE_FILTER=blob:none and a cone: the commit's trees at depth 1, the cone's blobs,
    checked by fsck where git cannot check a partial fetch itself; the history then brings
    commits and trees only (blobs stay promised), each walked."""
    repo, url = served_upstream
    git("config", "uploadpack.allowFilter", "true", cwd=repo.path)
    repo.commit({"services/a/main.py": "a\n", "services/b/main.py": "b\n" * 100}, message="services")
    grow(repo, 5, "services/a")
    env = {"CHECKOUTCACHE_FILTER": "blob:none"}
    answer = wait_ready(root, url, repo.shas[-1], extra=("--sparse", "services/a"), env={**env, **HELD})
    assert answer["history"] == "shallow" and answer["sparse"] == ["services/a"]
    path = answer["path"]
    assert os.path.exists(os.path.join(path, "services", "a", "main.py"))
    assert not os.path.exists(os.path.join(path, "services", "b"))
    store = only_repo(root)
    blob_b = git("rev-parse", f"{repo.shas[-1]}:services/b/main.py", cwd=repo.path)
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", blob_b]).returncode != 0  # never fetched
    no_history_running(root)
    code, answer, out = run_cli("ensure", url, repo.shas[-1], "--sparse", "services/a", "--history", "full",
                                "--wait", "120", root=root, env=env)
    assert code == 0 and answer["history"] == "complete", out
    assert commits_in(path) == len(repo.shas)
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", blob_b]).returncode != 0  # still promised
    assert all(name.endswith(".promisor") or not name.endswith(".pack") or
               os.path.exists(os.path.join(store.mirror, "objects", "pack", name[:-5] + ".promisor"))
               for name in os.listdir(os.path.join(store.mirror, "objects", "pack")))


def hostile_history(base: str) -> tuple[str, list[str]]:
    """A served repository bad <- c0 <- quirky <- c1 <- c2 whose root commit's tree git's fsck
    refuses (a `.git` entry) and whose `quirky` tree has a quirk long-lived histories carry (a
    zero-padded mode, as git before 2.0 wrote it): (path, [bad, c0, quirky, c1, c2])."""
    path = os.path.join(base, f"hostile-{os.urandom(3).hex()}")
    git("init", "-q", "--bare", path)

    def obj(kind: str, data: bytes) -> str:
        return subprocess.run(["git", "-C", path, "hash-object", "-t", kind, "-w", "--literally", "--stdin"],
                              input=data, capture_output=True, check=True).stdout.decode().strip()

    def tree(name: bytes, blob_text: bytes) -> str:
        return obj("tree", b"100644 " + name + b"\0" + bytes.fromhex(obj("blob", blob_text)))

    def commit(tree_id: str, parent: str | None, message: str) -> str:
        text = f"tree {tree_id}\n" + (f"parent {parent}\n" if parent else "") + \
            "author A <a@example.invalid> 1700000000 +0000\ncommitter A <a@example.invalid> 1700000000 +0000\n\n"
        return obj("commit", (text + message + "\n").encode())

    padded = obj("tree", b"040000 d\0" + bytes.fromhex(tree(b"f", b"in d\n")))
    bad = commit(tree(b".git", b"x\n"), None, "bad")
    c0 = commit(tree(b"ok.txt", b"c0\n"), bad, "c0")
    quirky = commit(padded, c0, "quirky")
    c1 = commit(tree(b"ok.txt", b"c1\n"), quirky, "c1")
    c2 = commit(tree(b"ok.txt", b"c2\n"), c1, "c2")
    git("update-ref", "refs/heads/main", c2, cwd=path)
    return path, [bad, c0, quirky, c1, c2]


def test_fsck_choices_hold_on_shallow_and_deepening_fetches(root, daemon):
    path, (bad, c0, quirky, c1, c2) = hostile_history(daemon.base)
    url = daemon.url(os.path.basename(path))
    answer = wait_ready(root, url, c2, env=HELD)  # the newest commit's tree is clean: it comes, shallow
    assert answer["history"] == "shallow"
    no_history_running(root)
    # A deepening that reaches the quirk takes it (git's own clone takes it).
    code, answer, out = run_cli("ensure", url, c2, "--base", c1, "--wait", "60", root=root, env=HELD)
    assert code == 0 and answer["merge_base"] == c1, out
    store = only_repo(root)
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", quirky]).returncode == 0
    # One that reaches the `.git` tree is refused by fsck: no merge base, nothing of it in the mirror.
    code, answer, out = run_cli("ensure", url, c2, "--base", c0, "--wait", "60", root=root, env=HELD)
    assert code == 1 and answer["error"] == "CLONE_FAILED" and "hasDotgit" in answer["message"], out
    # So is the history: the mirror keeps its boundary, the checkouts work.
    code, answer, out = run_cli("ensure", url, c2, "--history", "full", "--wait", "60", root=root)
    assert code == 1 and answer["error"] == "HISTORY_FAILED" and "hasDotgit" in answer["message"], out
    assert os.path.exists(store.mirror_shallow)
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", bad]).returncode != 0
    assert commits_in(store.checkout(c2)) >= 1


def test_the_pygit2_transport_makes_full_mirrors(root, served_upstream):
    repo, url = served_upstream
    answer = wait_ready(root, url, repo.shas[-1], env={"CHECKOUTCACHE_TRANSPORT": "pygit2"})
    assert answer["history"] == "complete" and commits_in(answer["path"]) == 3
    assert not os.path.exists(only_repo(root).history_repo)
    assert not os.path.exists(os.path.join(root, "repos", only_repo(root).key, "logs", "history.log"))


def test_a_workspace_of_a_shallow_checkout_has_its_own_boundary(root, served_upstream, tmp_path):
    """A workspace is the review's to write: its .git/shallow is a copy, so a deepening there
    never writes the mirror's (a checkout's is a link to it)."""
    repo, url = served_upstream
    wait_ready(root, url, repo.shas[-1], env=HELD)
    no_history_running(root)
    store = only_repo(root)
    before = open(store.mirror_shallow).read()
    script = tmp_path / "deepen.sh"
    script.write_text("set -e\ntest ! -L .git/shallow\ncat .git/shallow > \"$OUT/shallow\"\n"
                      f"git fetch -q --deepen=1 \"$URL\" {repo.shas[-1]}\n"
                      "git rev-list --count HEAD > \"$OUT/count\"\n")
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run_cli("exec", "--writable", url, repo.shas[-1], "--", "sh", str(script), root=root,
                           env={"OUT": str(out), "URL": url, **HELD})
    assert code == 0, err
    assert (out / "shallow").read_text() == before
    assert int((out / "count").read_text()) == 2  # deepened in the workspace
    assert open(store.mirror_shallow).read() == before  # the mirror's boundary untouched


def loose_objects(git_dir: str) -> list[str]:
    objects = os.path.join(git_dir, "objects")
    return [name + entry for name in os.listdir(objects) if len(name) == 2
            for entry in os.listdir(os.path.join(objects, name))]


def test_a_history_fetched_without_fsck_is_kept_whole(root, served_upstream, kill_log):
    """Regression (review of issue 34): with CHECKOUTCACHE_FSCK=off git unpacks a fetch of fewer
    than 100 objects into loose files (fetch.unpackLimit); the history installs history.git's
    packs only, so it dropped the boundary and removed history.git while the mirror lacked the
    commits it had just proven: "complete", and `git log` failed on a missing parent."""
    repo, url = served_upstream
    env = {"CHECKOUTCACHE_FSCK": "off"}
    answer = wait_ready(root, url, repo.shas[-1], env={**env, **HELD})
    no_history_running(root)
    store = only_repo(root)
    # Killed right after its fetch: what history.git holds is whole packs, nothing loose.
    run_cli("ensure", url, repo.shas[-1], "--history", "full", root=root, env={**env, KILL_AT: "history-after-fetch"})
    wait_until(lambda: os.path.exists(kill_log) and "history-after-fetch" in open(kill_log).read(),
               what="the history's kill after its fetch")
    no_history_running(root)
    assert os.path.isdir(store.history_repo) and loose_objects(store.history_repo) == [], \
        loose_objects(store.history_repo)
    code, done, out = run_cli("ensure", url, repo.shas[-1], "--history", "full", "--wait", "60", root=root, env=env)
    assert code == 0 and done["history"] == "complete", out
    assert commits_in(answer["path"]) == len(repo.shas)  # git log reaches the root: every parent is there
    git("fsck", "--connectivity-only", "--no-dangling", cwd=store.mirror)


def test_a_history_repository_holding_loose_objects_is_installed_whole(root, served_upstream, kill_log):
    """A history.git an older version left with loose objects (its fetch was unpacked): the install
    packs them before it links history.git's packs, so no boundary entry goes while the mirror
    lacks an object history.git proved."""
    repo, url = served_upstream
    answer = wait_ready(root, url, repo.shas[-1], env=HELD)
    no_history_running(root)
    store = only_repo(root)
    run_cli("ensure", url, repo.shas[-1], "--history", "full", root=root, env={KILL_AT: "history-after-fetch"})
    wait_until(lambda: os.path.exists(kill_log) and "history-after-fetch" in open(kill_log).read(),
               what="the history's kill after its fetch")
    no_history_running(root)
    # As git's unpack-objects leaves a small fetch: every object loose, no pack.
    pack_dir = os.path.join(store.history_repo, "objects", "pack")
    (pack,) = [name for name in os.listdir(pack_dir) if name.endswith(".pack")]
    aside = os.path.join(str(store.base), "pack-aside")
    os.rename(os.path.join(pack_dir, pack), aside)
    for name in os.listdir(pack_dir):
        os.unlink(os.path.join(pack_dir, name))
    with open(aside, "rb") as handle:
        subprocess.run(["git", "-C", store.history_repo, "unpack-objects", "-q"], stdin=handle, check=True)
    os.unlink(aside)
    assert loose_objects(store.history_repo)
    code, done, out = run_cli("ensure", url, repo.shas[-1], "--history", "full", "--wait", "60", root=root)
    assert code == 0 and done["history"] == "complete", out
    assert commits_in(answer["path"]) == len(repo.shas)
    git("fsck", "--connectivity-only", "--no-dangling", cwd=store.mirror)
