"""Monorepos: sparse checkouts of a cone (`--sparse DIR`, the API's `sparse`)
and partial mirrors (CHECKOUTCACHE_FILTER=blob:none), against a real git
daemon that allows filters (or not), through the CLI, the library and the API.

What is checked: a sparse checkout holds its cone (and the files git's cone
mode adds) and nothing else, one checkout per cone whatever its spelling; a
partial mirror lacks every blob no checkout asked for, fetches a new cone's in
one request and keeps them; gc never drops what a checkout needs (a checkout
made again afterwards needs no network); a server that refuses filters gives
a full mirror with a note; bundles are made from full mirrors only, and a
partial mirror seeded from bundles survives gc; bad cones are BAD_ARGUMENT
with nothing written; submodules outside the cone are left out."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import urllib.parse

import pytest

from checkoutcache import Cache
from checkoutcache.config import Config

from .helpers import (
    Serve,
    Upstream,
    assert_checkout_matches,
    git,
    only_repo,
    run_cli,
    wait_ready,
)
from .helpers.gate import GatedProxy
from .test_submodules import served as served_in, with_submodule

PARTIAL = {"CHECKOUTCACHE_FILTER": "blob:none"}


def monorepo(repo: Upstream, allow_filter: bool = True) -> str:
    """Three services and a shared library, with files at each level; one commit."""
    if allow_filter:
        git("config", "uploadpack.allowFilter", "true", cwd=repo.path)
    files = {"README.md": "root\n", "services/README.md": "services\n", "lib/util.py": "UTIL = 1\n"}
    for service in ("alpha", "beta", "gamma"):
        for number in range(5):
            files[f"services/{service}/src/file_{number}.txt"] = f"{service} {number}\n" * 50
        files[f"services/{service}/BUILD"] = f"{service}\n"
    return repo.commit(files, message="monorepo")


def worktree_files(path: str) -> set[str]:
    found = set()
    for folder, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != ".git"]
        found |= {os.path.relpath(os.path.join(folder, f), path) for f in files}
    return found


def mirror_missing(root: str, sha: str) -> set[str]:
    """The paths of the commit's files whose blobs the mirror lacks."""
    mirror = only_repo(root).mirror
    missing = {line[1:] for line in git("rev-list", "--objects", "--no-walk", "--missing=print", sha,
                                        cwd=mirror).splitlines() if line.startswith("?")}
    listing = git("ls-tree", "-r", sha, cwd=mirror).splitlines()
    return {line.split("\t", 1)[1] for line in listing if line.split()[2] in missing}


@pytest.mark.slow
def test_a_sparse_checkout_holds_its_cone_and_one_checkout_serves_each_cone(root, tmp_path, served_upstream):
    repo, url = served_upstream
    sha = monorepo(repo)
    code, alpha, out = run_cli("ensure", url, sha, "--sparse", "services/alpha", "--wait", "60", root=root)
    assert code == 0, out
    assert alpha["sparse"] == ["services/alpha"]
    assert worktree_files(alpha["path"]) == {  # root files (the standard history's too), ancestors' files
        "README.md", "link-to-readme", "services/README.md", "services/alpha/BUILD",
        *(f"services/alpha/src/file_{n}.txt" for n in range(5))}
    assert git("status", "--porcelain", cwd=alpha["path"]) == ""
    assert git("rev-parse", "HEAD", cwd=alpha["path"]) == sha
    # The same cone, spelled otherwise, is the same checkout (ready at once); another cone,
    # and the whole tree, are checkouts of their own.
    code, again, _ = run_cli("ensure", url, sha, "--sparse", "services/alpha/", "--sparse", "services/alpha/src",
                             root=root)
    assert code == 0 and again["path"] == alpha["path"]
    code, beta, out = run_cli("ensure", url, sha, "--sparse", "services/beta", "--wait", "60", root=root)
    assert code == 0 and beta["path"] != alpha["path"], out
    whole = wait_ready(root, url, sha)
    assert "sparse" not in whole and len({whole["path"], alpha["path"], beta["path"]}) == 3
    assert_checkout_matches(whole["path"], repo.path, sha)
    # The library and the sidecar answer the same paths.
    assert Cache(root).ensure(url, sha, sparse=["services/beta"]).path == beta["path"]
    running = Serve(root, tmp_path, "--gc-interval", "0")
    try:
        answer = running.client().ensure(url, sha, sparse=["services/alpha"])
        assert answer.state == "ready" and answer.path == alpha["path"] and answer.sparse == ["services/alpha"]
        query = urllib.parse.urlencode({"repo": url, "commit": sha, "sparse": "services/beta"})
        status, body = running.request("GET", f"/v1/ensure?{query}")
        assert status == 200 and body["path"] == beta["path"], body
    finally:
        running.stop()
    code, status, _ = run_cli("status", root=root)
    cones = sorted(tuple(c.get("sparse", ())) for r in status["repos"] for c in r["checkouts"])
    assert cones == [(), ("services/alpha",), ("services/beta",)]
    code, report, _ = run_cli("verify", root=root)
    assert code == 0 and report["broken"] == 0 and len(report["checkouts"]) == 3


@pytest.mark.parametrize("cone,why", [
    (["/etc"], "absolute"), (["services/../../x"], "'..'"), (["a/./b"], "'.'"), ([".git/hooks"], ".git"),
    (["a//b"], "empty"), (["bad\nname"], "control"), ([""], "no directory"),
    # git's --stdin would unquote or trim these into another directory (review: '"\\056git"' became .git)
    (['"b"'], "double quote"), (['"\\056git"'], "double quote"), ([" b"], "blank"), (["b "], "blank"),
    (["b /"], "blank"), (["/".join(["d"] * 65)], "deeper than 64"),
])
def test_a_bad_cone_is_bad_argument_and_writes_nothing(root, served_upstream, cone, why):
    repo, url = served_upstream
    sha = repo.shas[-1]
    code, answer, out = run_cli("ensure", url, sha, *[a for d in cone for a in ("--sparse", d)], "--wait", "30",
                                root=root)
    assert code == 2 and answer["error"] == "BAD_ARGUMENT" and why in answer["message"], answer
    assert not os.path.exists(os.path.join(root, "repos"))
    answer = Cache(root).ensure(url, sha, sparse=cone)
    assert answer.error == "BAD_ARGUMENT"
    assert not os.path.exists(os.path.join(root, "repos"))


@pytest.mark.slow
def test_a_cone_whose_pathspecs_outgrow_a_command_line_works_on_a_partial_mirror(root, served_upstream,
                                                                                  monkeypatch):
    """Regression (review): a partial mirror listed a cone's blobs with its pathspecs (every
    ancestor of every directory) on rev-list's command line: a deep cone failed the commit
    with "Argument list too long". 256 directories, 63 levels of 15-byte names each: ~8 MB."""
    repo, url = served_upstream
    sha = monorepo(repo)
    monkeypatch.setenv("CHECKOUTCACHE_FILTER", "blob:none")
    deep = [f"services/alpha/{'/'.join(f'level-{n:03d}-{i:04d}' for n in range(61))}" for i in range(255)]
    answer = Cache(root).ensure(url, sha, sparse=["services/beta", *deep], wait=120)
    assert answer.state == "ready", answer
    assert {f"services/beta/src/file_{n}.txt" for n in range(5)} <= worktree_files(answer.path)
    assert not any(path.startswith("services/alpha/src/") for path in worktree_files(answer.path))


@pytest.mark.slow
def test_a_checkout_whose_ready_marker_is_large_is_answered_ready(root, served_upstream):
    """Regression (found by the test above): the ready path read 64 KiB of a marker, gc and
    the worker all of it; a cone of many long directories made a marker of ~240 KiB, which
    the ready path called damaged and the worker published: cloned again every 200 ms, and
    `cloning` answered until the wait ran out."""
    repo, url = served_upstream
    sha = monorepo(repo)
    many = ["services/beta", *(f"services/gamma/{'/'.join(f'{i:04d}-' + 'x' * 240 for _ in range(4))}"
                               for i in range(255))]
    args = [a for d in many for a in ("--sparse", d)]
    code, answer, out = run_cli("ensure", url, sha, *args, "--wait", "60", root=root)
    assert code == 0 and answer["state"] == "ready", out[-500:]
    assert os.path.getsize(os.path.join(answer["path"], ".git", "checkoutcache-ready")) > 1 << 16
    again = run_cli("ensure", url, sha, *args, root=root)  # the ready path, no wait
    assert again[0] == 0 and again[1]["path"] == answer["path"], again[2][-500:]
    log = open(only_repo(root).clone_log(os.path.basename(answer["path"]))).read()
    assert log.count("clone of") == 1, log[-2000:]


def test_a_cone_that_is_not_utf8_or_not_a_list_is_refused_by_cli_and_api(root, tmp_path, served_upstream):
    repo, url = served_upstream
    sha = repo.shas[-1]
    done = subprocess.run([os.fsencode(sys.executable), b"-m", b"checkoutcache", b"--root", root.encode(), b"--json",
                           b"ensure", url.encode(), sha.encode(), b"--sparse", b"caf\xe9"], capture_output=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    answer = json.loads(done.stdout)
    assert done.returncode == 2 and answer["error"] == "BAD_ARGUMENT" and "UTF-8" in answer["message"], answer
    running = Serve(root, tmp_path, "--gc-interval", "0")
    try:
        for body in ({"sparse": "services"}, {"sparse": [1]}, {"sparse": ["../etc"]}, {"sparse": ["/etc/passwd"]},
                     {"sparse": ["x"] * 300}):
            status, answer = running.request("POST", "/v1/ensure", {"repo": url, "commit": sha, **body})
            assert status == 400 and answer["error"] == "BAD_ARGUMENT", (body, answer)
        assert os.listdir(os.path.join(root, "repos")) == []  # serve made the root; no repository store
    finally:
        running.stop()


@pytest.mark.slow
def test_a_partial_mirror_fetches_only_what_checkouts_need_once_and_gc_keeps_it(root, daemon, served_upstream):
    repo, url = served_upstream
    sha = monorepo(repo)
    proxy = GatedProxy(daemon.port)
    url = proxy.url(url.rsplit("/", 1)[1])
    try:
        alpha = wait_ready(root, url, sha, env=PARTIAL, extra=("--sparse", "services/alpha"))
        record = json.load(open(only_repo(root).filter_record))
        assert record["filter"] == "blob:none" and record["partial"] is True, record
        missing = mirror_missing(root, sha)
        assert {f"services/beta/src/file_{n}.txt" for n in range(5)} <= missing
        assert not {p for p in missing if p.startswith("services/alpha/")} and "README.md" not in missing
        # Another cone fetches its own blobs (one request), and they stay in the mirror.
        beta = wait_ready(root, url, sha, env=PARTIAL, extra=("--sparse", "services/beta"))
        assert not {p for p in mirror_missing(root, sha) if p.startswith("services/beta/")}
        assert "gamma" in " ".join(mirror_missing(root, sha))
        log = open(only_repo(root).clone_log(os.path.basename(beta["path"]))).read()
        assert re.search(r"--filter=blob:none --stdin checkoutcache-[0-9a-f]{16}\b", log) and "blob(s) the checkout needs" in log
        # gc repacks the partial mirror: nothing a checkout needs goes. Made again with the
        # upstream unreachable, the same cones need no network.
        code, report, out = run_cli("gc", "--mirror-gc-interval", "0", "--max-checkouts", "0", "--grace", "0",
                                    root=root, env=PARTIAL)
        assert code == 0 and report["mirrors"][0]["repacked"] is True, out
        assert not os.path.exists(alpha["path"]) and not os.path.exists(beta["path"])
        proxy.shut()
        for cone in ("services/alpha", "services/beta"):
            again = wait_ready(root, url, sha, env=PARTIAL, extra=("--sparse", cone), timeout=30)
            assert git("status", "--porcelain", cwd=again["path"]) == ""
        assert proxy.held == 0, "a checkout of blobs the mirror kept went to the network"
        proxy.open()
        whole = wait_ready(root, url, sha, env=PARTIAL)
        assert_checkout_matches(whole["path"], repo.path, sha)
        assert mirror_missing(root, sha) == set()
        assert all(name.endswith((".pack", ".idx", ".promisor", ".rev"))
                   for name in os.listdir(os.path.join(only_repo(root).mirror, "objects", "pack")))
        git("fsck", "--connectivity-only", cwd=only_repo(root).mirror)
    finally:
        proxy.close()


def test_a_cold_partial_sparse_checkout_of_a_commit_that_changed_nothing_in_its_cone(root, served_upstream):
    """Regression: the cone's missing blobs were listed with pathspecs on the commit, which
    limit commits: a commit that changed nothing in the cone listed none, and the checkout
    failed with "could not fetch ... from promisor remote"."""
    repo, url = served_upstream
    monorepo(repo)
    sha = repo.commit({"services/beta/src/file_0.txt": "only beta changes\n"})
    answer = wait_ready(root, url, sha, env=PARTIAL, extra=("--sparse", "services/alpha"))
    assert git("status", "--porcelain", cwd=answer["path"]) == ""
    assert open(os.path.join(answer["path"], "services", "alpha", "src", "file_0.txt")).read() == "alpha 0\n" * 50


def test_a_server_that_refuses_filters_gives_a_full_mirror_and_says_so(root, served_upstream):
    repo, url = served_upstream
    sha = monorepo(repo, allow_filter=False)
    answer = wait_ready(root, url, sha, env=PARTIAL, extra=("--sparse", "services/alpha"))
    assert answer["sparse"] == ["services/alpha"]
    record = json.load(open(only_repo(root).filter_record))
    assert record["partial"] is False and "does not allow filters" in record["note"], record
    pack_dir = os.path.join(only_repo(root).mirror, "objects", "pack")
    assert not [n for n in os.listdir(pack_dir) if n.endswith(".promisor")]
    assert mirror_missing(root, sha) == set()
    code, status, _ = run_cli("status", root=root, env=PARTIAL)
    assert status["repos"][0]["filter"]["partial"] is False, status["repos"][0].get("filter")


def test_libgit2_makes_full_mirrors_and_refuses_sparse_checkouts(root, served_upstream):
    repo, url = served_upstream
    sha = monorepo(repo)
    env = {**PARTIAL, "CHECKOUTCACHE_TRANSPORT": "pygit2"}
    code, answer, out = run_cli("ensure", url, sha, "--sparse", "services/alpha", "--wait", "30", root=root, env=env)
    assert code == 2 and answer["error"] == "BAD_ARGUMENT" and "git CLI" in answer["message"], answer
    assert not os.path.exists(os.path.join(root, "repos"))
    whole = wait_ready(root, url, sha, env=env)
    assert_checkout_matches(whole["path"], repo.path, sha)
    record = json.load(open(only_repo(root).filter_record))
    assert record["partial"] is False and "pygit2" in record["note"], record


def test_submodules_outside_the_cone_are_left_out(root, daemon):
    sub, _ = served_in(daemon, "sub")
    sub_sha = sub.commit({"lib.txt": "library\n"})
    top, top_url = served_in(daemon, "top")
    top.commit({"src/main.c": "int main;\n", "vendor/README": "vendored\n"})
    sha = with_submodule(top, "vendor/lib", f"../{os.path.basename(sub.path)}", sub_sha)
    code, src, out = run_cli("ensure", top_url, sha, "--sparse", "src", "--wait", "60", root=root)
    assert code == 0 and "submodules" not in src, out
    assert worktree_files(src["path"]) == {"src/main.c", ".gitmodules"}
    assert len(os.listdir(os.path.join(root, "repos"))) == 1  # the submodule's repository was never cloned
    code, vendor, out = run_cli("ensure", top_url, sha, "--sparse", "vendor", "--wait", "60", root=root)
    assert code == 0 and vendor["submodules"] == "included", out
    assert open(os.path.join(vendor["path"], "vendor", "lib", "lib.txt")).read() == "library\n"


@pytest.mark.slow
def test_bundles_come_from_full_mirrors_and_seed_partial_ones_that_survive_gc(tmp_path, served_upstream):
    """A bundle's take-in writes an ordinary pack: unmarked in a partial mirror, gc then drops
    objects later promisor commits reach (benchmarks/MONOREPO.md A6)."""
    repo, url = served_upstream
    base = monorepo(repo)
    store = f"file://{tmp_path / 'store'}"
    publisher, partial = str(tmp_path / "publisher"), str(tmp_path / "partial")
    code, report, out = run_cli("bundle", "publish", url, "--to", store, root=publisher)
    assert code == 0 and report["published"][0]["action"] == "full", out
    newer = repo.commit({"services/alpha/src/file_0.txt": "changed\n", "lib/util.py": "UTIL = 2\n"})
    env = {**PARTIAL, "CHECKOUTCACHE_BUNDLE_URI": store}
    # The bundles seed the history, which follows the first answer: waited for here.
    first = wait_ready(partial, url, newer, env=env, extra=("--sparse", "services/alpha", "--history", "full"))
    seed = json.load(open(only_repo(partial).seed_record))
    assert seed["seeded"], seed
    pack_dir = os.path.join(only_repo(partial).mirror, "objects", "pack")
    packs = [n for n in os.listdir(pack_dir) if n.endswith(".pack")]
    assert packs and all(os.path.exists(os.path.join(pack_dir, p[:-5] + ".promisor")) for p in packs)
    for _ in range(2):
        code, _, out = run_cli("gc", "--mirror-gc-interval", "0", root=partial, env=env)
        assert code == 0, out
    git("fsck", "--connectivity-only", cwd=only_repo(partial).mirror)
    assert git("status", "--porcelain", cwd=first["path"]) == ""
    whole = wait_ready(partial, url, base, env=env)
    assert_checkout_matches(whole["path"], repo.path, base)
    # Publishing from the partial node: refused with the reason, the store untouched.
    before = sorted(os.listdir(tmp_path / "store"))
    code, report, out = run_cli("bundle", "publish", url, "--to", store, root=partial, env=env)
    (failed,) = report["published"]
    assert code == 1 and failed["error"] == "BUNDLE_FAILED" and "partial" in failed["message"], out
    assert sorted(os.listdir(tmp_path / "store")) == before


def test_the_filter_setting_is_checked(root):
    code, answer, _ = run_cli("ensure", "https://example.com/r", "a" * 40, root=root,
                              env={"CHECKOUTCACHE_FILTER": "tree:0"})
    assert code == 2 and answer["message"].startswith("CHECKOUTCACHE_FILTER: "), answer
    assert Config.from_env({"CHECKOUTCACHE_FILTER": "blob:limit=1m"}).filter == "blob:limit=1m"


@pytest.mark.slow
def test_a_rebuilt_partial_mirror_gets_back_the_blobs_existing_checkouts_read(root, served_upstream):
    """A partial mirror gone (deleted, or moved aside as unreadable) is made anew by the next
    clone, which fetches back what existing checkouts borrow: for a partial mirror not only
    their commits but each one's cone of blobs (from its marker)."""
    repo, url = served_upstream
    sha = monorepo(repo)
    alpha = wait_ready(root, url, sha, env=PARTIAL, extra=("--sparse", "services/alpha"))
    subprocess.run(["rm", "-rf", only_repo(root).mirror], check=True)
    assert subprocess.run(["git", "status", "--porcelain"], cwd=alpha["path"], capture_output=True).returncode != 0
    newer = repo.commit({"services/beta/src/new.txt": "new\n"})
    beta = wait_ready(root, url, newer, env=PARTIAL, extra=("--sparse", "services/beta"))
    log = open(only_repo(root).clone_log(os.path.basename(beta["path"]))).read()
    assert "restoring the objects of 1 existing commit(s)" in log, log[-2000:]
    assert git("status", "--porcelain", cwd=beta["path"]) == ""
    assert git("status", "--porcelain", cwd=alpha["path"]) == ""  # its cone's blobs came back with its commit
    assert not {p for p in mirror_missing(root, sha) if p.startswith("services/alpha/")}
    assert {p for p in mirror_missing(root, sha) if p.startswith("services/gamma/")}  # still partial
    code, report, _ = run_cli("verify", root=root)
    assert code == 0 and report["broken"] == 0


def test_lfs_files_outside_the_cone_are_left_out(root, tmp_path):
    """An LFS object never uploaded fails a checkout that needs it (LFS_FAILED); a cone without
    that file needs nothing of LFS at all, as git's own sparse checkout would not smudge it."""
    from .helpers.lfs import LfsUpstream

    upstream = LfsUpstream(str(tmp_path / "lfs-upstream"))
    sha = upstream.commit_lfs({"assets/model.bin": b"weights" * 1000}, other={"src/main.py": "print(1)\n"},
                              upload=False)
    src = wait_ready(root, upstream.path, sha, extra=("--sparse", "src"))
    assert "lfs" not in src and worktree_files(src["path"]) == {"src/main.py", ".gitattributes"}
    code, assets, out = run_cli("ensure", upstream.path, sha, "--sparse", "assets", "--wait", "60", root=root,
                                env={"CHECKOUTCACHE_BACKOFF": "30s"})
    assert code == 1 and assets["error"] == "LFS_FAILED", out


def test_a_cones_lfs_files_are_downloaded_and_the_others_are_not(root, tmp_path):
    from .helpers.lfs import LfsUpstream, lfs_oid

    upstream = LfsUpstream(str(tmp_path / "lfs-upstream"))
    inside, outside = b"inside" * 500, b"outside" * 500
    sha = upstream.commit_lfs({"game/level.bin": inside, "film/reel.bin": outside})
    game = wait_ready(root, upstream.path, sha, extra=("--sparse", "game"))
    assert game["lfs"] == "content" and open(os.path.join(game["path"], "game", "level.bin"), "rb").read() == inside
    stored = [name for _, _, files in os.walk(only_repo(root).lfs_objects) for name in files]
    assert stored == [lfs_oid(inside)], stored  # the other cone's object stayed upstream
