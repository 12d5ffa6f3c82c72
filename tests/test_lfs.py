"""Git LFS (README "Git LFS"): LFS files are checked out with their content from one
object store per repository (repos/<key>/lfs/), each object downloaded once per
store; without git-lfs, with the pygit2 transport or with CHECKOUTCACHE_LFS=off
they are pointer files and the answer says so; a missing object is LFS_FAILED;
gc drops the objects no remaining checkout uses."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time

import pytest

from checkoutcache.store.layout import RootPaths

from .helpers import Upstream, git, grep_tree, make_idle, run_cli, settled, wait_ready
from .helpers.lfs import LfsUpstream, lfs_oid, pointer
from .https_git import GitHttpsServer

pytestmark = pytest.mark.skipif(shutil.which("git-lfs") is None, reason="git-lfs is not installed")

TOKEN = "s3cr3t-" + secrets.token_hex(8)
A, B, C, D = (bytes([n]) * 3000 + b"lfs object %d" % n for n in range(4))


def only_store(root: str):
    keys = RootPaths(root).repo_keys()
    assert len(keys) == 1, keys
    return RootPaths(root).repo(keys[0])


def read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def git_status(checkout: str) -> str:
    return subprocess.run(["git", "-c", "safe.directory=*", "-C", checkout, "status", "--porcelain"],
                          capture_output=True, text=True, check=True).stdout


@pytest.fixture
def lfs_server(tmp_path):
    """An https git server on 127.0.0.1 that also serves the LFS batch API, counting downloads,
    behind a token the environment gives for this host only."""
    project_root = tmp_path / "srv"
    project_root.mkdir()
    server = GitHttpsServer(str(project_root), str(tmp_path), lambda user, password: password == TOKEN)
    server.upstream = LfsUpstream(str(project_root / "repo"))
    server.lfs_objects = server.upstream.objects
    operator_config = tmp_path / "operator-gitconfig"
    operator_config.write_text(f"[http]\n\tsslCAInfo = {server.ca_file}\n")
    server.env = {"CHECKOUTCACHE_GIT_CONFIG": str(operator_config), "CHECKOUTCACHE_GIT_PASSWORD": TOKEN,
                  "CHECKOUTCACHE_GIT_HOSTS": f"127.0.0.1:{server.port}"}
    yield server
    server.stop()


@pytest.fixture
def lfs_upstream(tmp_path) -> LfsUpstream:
    return LfsUpstream(str(tmp_path / "upstream"))


@pytest.mark.slow
def test_each_object_is_downloaded_once_across_checkouts_of_several_commits(root, lfs_server):
    up = lfs_server.upstream
    first = up.commit_lfs({"a.bin": A, "b.bin": B}, {"README": "one\n"})
    second = up.commit_lfs({"c.bin": C}, {"README": "two\n"})          # a, b, c
    third = up.commit_lfs({"a.bin": D}, {"README": "three\n"})          # d (as a.bin), b, c
    url = lfs_server.url("127.0.0.1", "repo")
    paths = []
    for sha in (first, second, third):
        answer = wait_ready(root, url, sha, env=lfs_server.env)
        assert answer["lfs"] == "content", answer
        paths.append(answer["path"])
    assert read(os.path.join(paths[0], "a.bin")) == A and read(os.path.join(paths[0], "b.bin")) == B
    assert read(os.path.join(paths[1], "c.bin")) == C and read(os.path.join(paths[1], "a.bin")) == A
    assert read(os.path.join(paths[2], "a.bin")) == D
    # One download per object, whatever number of commits and checkouts use it.
    assert dict(lfs_server.lfs_downloads) == {lfs_oid(data): 1 for data in (A, B, C, D)}
    store = only_store(root)
    assert sorted(store.lfs_object_oids()) == sorted(lfs_oid(data) for data in (A, B, C, D))
    for path in paths:
        assert git_status(path) == "", "the checkout's own filter config keeps `git status` clean"
    # The token reached the LFS batch API through git's host-scoped helper, and is nowhere on disk.
    assert any(r["path"].endswith("/info/lfs/objects/batch") and r["authorization"]
               for r in lfs_server.requests)
    assert grep_tree(root, TOKEN.encode()) == []
    # Asked again: ready at once, nothing downloaded.
    code, answer, _ = run_cli("ensure", url, second, root=root, env=lfs_server.env)
    assert code == 0 and answer["lfs"] == "content"
    assert sum(lfs_server.lfs_downloads.values()) == 4


def test_an_object_missing_upstream_is_lfs_failed_and_nothing_is_published(root, lfs_upstream):
    sha = lfs_upstream.commit_lfs({"a.bin": A}, upload=False)
    code, answer, out = run_cli("ensure", lfs_upstream.path, sha, "--wait", "60", root=root,
                                env={"CHECKOUTCACHE_BACKOFF": "30s"})
    assert code == 1 and answer["error"] == "LFS_FAILED", (answer, out)
    assert answer["retry_after"] > 0
    store = only_store(root)
    assert store.checkout_names() == [] and os.listdir(store.scratch_dir) == []
    # Within the back-off: answered from the record, no new attempt.
    code, again, _ = run_cli("ensure", lfs_upstream.path, sha, root=root)
    assert code == 1 and again["error"] == "LFS_FAILED"


def path_without_git_lfs(tmp_path) -> str:
    bin_dir = tmp_path / "bin-without-lfs"
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            target = os.path.join(directory, name)
            if name != "git-lfs" and not (bin_dir / name).exists() and os.access(target, os.X_OK) \
                    and os.path.isfile(target):
                os.symlink(target, bin_dir / name)
    return str(bin_dir)


def test_without_git_lfs_checkouts_hold_pointers_and_say_so(root, lfs_upstream, tmp_path):
    sha = lfs_upstream.commit_lfs({"a.bin": A}, {"README": "x\n"})
    env = {"PATH": path_without_git_lfs(tmp_path)}
    answer = wait_ready(root, lfs_upstream.path, sha, env=env)
    assert answer["lfs"] == "pointers"
    assert read(os.path.join(answer["path"], "a.bin")).decode() == pointer(A)
    assert git_status(answer["path"]) == ""
    code, status, _ = run_cli("status", root=root, env=env)
    lfs = status["repos"][0]["lfs"]
    assert lfs["setting"] == "on" and "git-lfs is not installed" in lfs["why"]
    assert lfs["checkouts"]["pointers"] == 1 and status["repos"][0]["checkouts"][0]["lfs"] == "pointers"


@pytest.mark.slow
def test_a_commit_without_lfs_files_says_nothing_of_lfs(root, lfs_upstream, tmp_path):
    sha = lfs_upstream.commit({"README": "plain\n"})
    assert "lfs" not in wait_ready(root, lfs_upstream.path, sha)
    other = LfsUpstream(str(tmp_path / "other"))
    sha = other.commit({"README": "plain\n"})
    assert "lfs" not in wait_ready(root, other.path, sha, env={"PATH": path_without_git_lfs(tmp_path)})


@pytest.mark.slow
def test_lfs_off_checks_out_pointers_at_another_path(root, lfs_upstream):
    sha = lfs_upstream.commit_lfs({"a.bin": A})
    default = wait_ready(root, lfs_upstream.path, sha)
    off = wait_ready(root, lfs_upstream.path, sha, env={"CHECKOUTCACHE_LFS": "off"})
    assert default["lfs"] == "content" and off["lfs"] == "off"
    assert off["path"] != default["path"]
    assert read(os.path.join(default["path"], "a.bin")) == A
    assert read(os.path.join(off["path"], "a.bin")).decode() == pointer(A)
    code, status, _ = run_cli("status", lfs_upstream.path, root=root, env={"CHECKOUTCACHE_LFS": "off"})
    assert code == 0 and [r["lfs"]["setting"] for r in status["repos"]] == ["off"]
    assert "CHECKOUTCACHE_LFS=off" in status["repos"][0]["lfs"]["why"]
    code, answer, _ = run_cli("ensure", lfs_upstream.path, sha, root=root, env={"CHECKOUTCACHE_LFS": "maybe"})
    assert code == 2 and answer["error"] == "BAD_ARGUMENT"


def test_the_pygit2_transport_checks_out_pointers_and_says_so(root, lfs_upstream):
    pytest.importorskip("pygit2")
    sha = lfs_upstream.commit_lfs({"a.bin": A})
    answer = wait_ready(root, lfs_upstream.path, sha, env={"CHECKOUTCACHE_TRANSPORT": "pygit2"})
    assert answer["lfs"] == "pointers"
    assert read(os.path.join(answer["path"], "a.bin")).decode() == pointer(A)


@pytest.mark.slow
def test_gc_drops_the_objects_only_evicted_checkouts_used(root, lfs_upstream):
    old = lfs_upstream.commit_lfs({"a.bin": A, "b.bin": B})
    new = lfs_upstream.commit_lfs({"a.bin": C})                           # c (as a.bin), b
    old_path = wait_ready(root, lfs_upstream.path, old)["path"]
    wait_ready(root, lfs_upstream.path, new)
    settled(root)  # the history's finish empties its own scratch through trash/, which gc would report
    store = only_store(root)
    assert sorted(store.lfs_object_oids()) == sorted(lfs_oid(x) for x in (A, B, C))
    make_idle(old_path, 7200)
    code, report, out = run_cli("gc", "--max-checkouts", "1", root=root)
    assert code == 0, out
    assert [r["name"] for r in report["removed"]] == [old]
    assert sorted(store.lfs_object_oids()) == sorted(lfs_oid(x) for x in (B, C)), report["mirrors"]
    assert report["mirrors"][0]["lfs_objects_removed"] == 1
    # The remaining checkout is untouched, and its commit checks out again from the store.
    code, answer, _ = run_cli("ensure", lfs_upstream.path, old, "--wait", "60", root=root)
    assert code == 0 and read(os.path.join(answer["path"], "b.bin")) == B


@pytest.mark.slow
def test_a_repositorys_lfsconfig_never_redirects_the_download(root, daemon):
    """The LFS endpoint comes from the repository URL, pinned on our command line: an
    .lfsconfig pointing elsewhere (here a plain-http listener) is never contacted."""
    import http.server
    import threading

    hits = []

    class Listener(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            hits.append(self.path)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST

    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Listener)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        upstream = Upstream(os.path.join(daemon.base, f"lfsconfig-{os.urandom(3).hex()}"))
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{'ab' * 32}\nsize 12\n"
        sha = upstream.commit({".gitattributes": "*.bin filter=lfs diff=lfs merge=lfs -text\n",
                               ".lfsconfig": f"[lfs]\n\turl = http://127.0.0.1:{evil.server_address[1]}/evil\n",
                               "data.bin": pointer})
        code, answer, _ = run_cli("ensure", daemon.url(os.path.basename(upstream.path)), sha, "--wait", "60",
                                  root=root)
        assert code == 1 and answer["error"] == "LFS_FAILED", answer
        assert hits == [], f"the .lfsconfig endpoint was contacted: {hits}"
    finally:
        evil.shutdown()


def test_a_submodules_lfs_files_hold_their_content_too(root, lfs_upstream, tmp_path):
    """A submodule with LFS files (a local superproject, a local submodule): its work tree
    inside the superproject checkout holds their content, from the submodule's own store."""
    from .helpers import Upstream, git

    sub_sha = lfs_upstream.commit_lfs({"a.bin": A}, {"README": "sub\n"})
    top = Upstream(str(tmp_path / "top"))
    top.commit({"README.md": "top\n", ".gitmodules": f'[submodule "s"]\n\tpath = s\n\turl = {lfs_upstream.path}\n'})
    git("update-index", "--add", "--cacheinfo", f"160000,{sub_sha},s", cwd=top.path)
    git("commit", "-q", "-m", "submodule with lfs", cwd=top.path)
    sha = git("rev-parse", "HEAD", cwd=top.path)
    code, answer, err = run_cli("ensure", top.path, sha, "--wait", "120", root=root)
    assert code == 0, (answer, err)
    assert answer["submodules"] == "included" and answer["lfs"] == "content"
    assert read(os.path.join(answer["path"], "s", "a.bin")) == A
    assert git_status(os.path.join(answer["path"], "s")) == ""


@pytest.mark.slow
def test_which_files_are_lfs_is_what_the_attributes_say(root, lfs_upstream):
    """Regression: a text file shaped like an LFS pointer that no `filter=lfs` attribute routes
    failed the whole checkout with LFS_FAILED (plain git checks it out as it is); and LFS files
    routed only by a nested .gitattributes were left as pointers."""
    stray = f"version https://git-lfs.github.com/spec/v1\noid sha256:{'cd' * 32}\nsize 42\n"
    lfs_upstream.put_object(B)
    sha = lfs_upstream.commit_lfs({"a.bin": A}, {"docs/example-pointer.txt": stray,
                                                 "sub/.gitattributes": "*.dat filter=lfs diff=lfs merge=lfs -text\n",
                                                 "sub/x.dat": pointer(B)})
    code, answer, out = run_cli("ensure", lfs_upstream.path, sha, "--wait", "60", root=root)
    assert code == 0 and answer["lfs"] == "content", out
    assert read(os.path.join(answer["path"], "a.bin")) == A
    assert read(os.path.join(answer["path"], "sub", "x.dat")) == B
    assert read(os.path.join(answer["path"], "docs", "example-pointer.txt")).decode() == stray
    assert git_status(answer["path"]) == ""
    # Only a nested .gitattributes names the filter: still LFS.
    nested = lfs_upstream.commit({".gitattributes": "# nothing here\n", "a.bin": "not lfs any more\n"})
    code, answer, out = run_cli("ensure", lfs_upstream.path, nested, "--wait", "60", root=root)
    assert code == 0 and answer["lfs"] == "content", out
    assert read(os.path.join(answer["path"], "sub", "x.dat")) == B


@pytest.mark.slow
def test_a_default_branchs_lfsconfig_cannot_exclude_what_a_checkout_needs(root, lfs_server, tmp_path):
    """Regression: on a protocol v0 server (no fetch by unadvertised id, so all refs are
    fetched and the mirror's HEAD resolves) `git lfs fetch` obeyed the default branch's
    .lfsconfig `fetchexclude`, exited 0 without the objects, and the checkout's smudge
    filter then downloaded by itself (outside the mirror lock, without the operator's CA):
    LFS_FAILED where a v2 server gave ready."""
    up = lfs_server.upstream
    git("checkout", "-q", "-b", "master", cwd=up.path)  # the branch a fresh mirror's HEAD names
    wanted = up.commit_lfs({"a.bin": A}, {"README": "one\n"})
    up.commit({".lfsconfig": "[lfs]\n\tfetchexclude = *\n"}, message="exclude everything")
    with open(lfs_server.env["CHECKOUTCACHE_GIT_CONFIG"], "a") as handle:
        handle.write("[protocol]\n\tversion = 0\n")
    code, answer, out = run_cli("ensure", lfs_server.url("127.0.0.1", "repo"), wanted, "--wait", "60", root=root,
                                env=lfs_server.env)
    assert code == 0 and answer["lfs"] == "content", out
    assert read(os.path.join(answer["path"], "a.bin")) == A
    assert "fetching all refs" in open(only_store(root).clone_log(wanted)).read()  # the v0 path was taken


def test_the_smudge_filter_never_downloads(root, lfs_upstream, fake_git):
    """The checkout's smudge filter finds every object in the store (checked after the fetch)
    or fails: it never goes to the network itself. Here the objects vanish between the fetch
    and the checkout; the local upstream would hand them to any smudge that asked."""
    sha = lfs_upstream.commit_lfs({"a.bin": A}, {"README": "x\n"})
    vanish = fake_git(f'case "$*" in *" checkout "*) rm -rf {root}/repos/*/lfs/objects;; esac')
    code, answer, out = run_cli("ensure", lfs_upstream.path, sha, "--wait", "60", root=root, env=vanish)
    assert code == 1 and answer["error"] == "LFS_FAILED", out
    assert only_store(root).checkout_names() == []


# ------------------------------------------------------------ issue 27: LFS in the monorepo mode

def test_a_partial_mirrors_cone_gets_its_lfs_content_without_a_scan_of_the_whole_tree(root, lfs_server):
    """Regression: with CHECKOUTCACHE_FILTER=blob:none and a cone, `git lfs fetch URL SHA`
    scanned the whole tree and read pointer blobs outside the cone, which a partial mirror
    lacks: LFS_FAILED "Could not scan for Git LFS files", again after every back-off."""
    up = lfs_server.upstream
    git("config", "uploadpack.allowFilter", "true", cwd=up.path)
    sha = up.commit_lfs({"a/in.bin": A, "outside/far.bin": B}, {"outside/README": "far\n"})
    env = {**lfs_server.env, "CHECKOUTCACHE_FILTER": "blob:none"}
    answer = wait_ready(root, lfs_server.url("127.0.0.1", "repo"), sha, env=env, extra=("--sparse", "a"))
    assert answer["lfs"] == "content", answer
    assert read(os.path.join(answer["path"], "a", "in.bin")) == A
    assert git_status(answer["path"]) == ""
    store = only_store(root)
    # The mirror is partial and still lacks the pointer outside the cone: nothing scanned it.
    listing = git("ls-tree", "-r", sha, cwd=store.mirror).splitlines()
    far = next(line.split()[2] for line in listing if line.endswith("\toutside/far.bin"))
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", far],
                          env={**os.environ, "GIT_NO_LAZY_FETCH": "1"}).returncode != 0
    assert dict(lfs_server.lfs_downloads) == {lfs_oid(A): 1}


def test_a_cones_lfs_download_is_exactly_its_files(root, lfs_upstream):
    """Regression: the cone's files went to git-lfs as lfs.fetchinclude patterns, and the root
    file `top.bin` (in every cone) matched `outside/top.bin` too: downloaded, never needed."""
    top, far, inside = b"top" * 900, b"far away" * 900, b"inside" * 900
    sha = lfs_upstream.commit_lfs({"top.bin": top, "outside/top.bin": far, "a/x.bin": inside})
    answer = wait_ready(root, lfs_upstream.path, sha, extra=("--sparse", "a"))
    assert answer["lfs"] == "content"
    assert read(os.path.join(answer["path"], "top.bin")) == top
    assert read(os.path.join(answer["path"], "a", "x.bin")) == inside
    assert sorted(only_store(root).lfs_object_oids()) == sorted([lfs_oid(top), lfs_oid(inside)])


OVERSIZE = 24 << 20


@pytest.mark.slow
def test_an_lfs_body_longer_than_its_pointer_says_is_cut_and_leaves_nothing(root, lfs_server):
    """Regression: a server sending 64 MiB for a 4 KB pointer failed the clone, but every
    partial download stayed in lfs/incomplete/ across retries and gc (321 MiB after five)."""
    up = lfs_server.upstream
    small = [bytes([n]) * 4000 for n in range(3)]
    sha = up.commit_lfs({f"f{n}.bin": data for n, data in enumerate(small)})
    for data in small:  # what the server sends: the object, then far more than the pointer says
        lfs_server.lfs_objects[lfs_oid(data)] = data + b"\0" * OVERSIZE
    url = lfs_server.url("127.0.0.1", "repo")
    env = {**lfs_server.env, "CHECKOUTCACHE_BACKOFF": "1s"}
    store = None
    for attempt in range(2):
        if attempt:
            time.sleep(1.5)  # past the back-off: the second ensure tries again
        code, answer, out = run_cli("ensure", url, sha, "--wait", "60", root=root, env=env)
        assert code == 1 and answer["error"] == "LFS_FAILED", out
        store = only_store(root)
        leftovers = [os.path.join(d, f) for d, _, files in os.walk(store.lfs_store) for f in files
                     if "/objects/" not in d + "/"]
        assert [p for p in leftovers if "/incomplete/" in p or "/tmp/" in p] == [], leftovers
        assert store.lfs_object_oids() == []
        assert "more bytes than" in answer["message"], answer
    assert lfs_server.lfs_downloads[lfs_oid(small[0])] == 2  # two attempts, each one download
    # A worker killed during its download leaves its partial file: gc removes it once it is
    # an hour old (a younger one may be a download under way).
    os.makedirs(store.lfs_incomplete, exist_ok=True)
    old, young = (os.path.join(store.lfs_incomplete, lfs_oid(data) + "123") for data in small[:2])
    for path in (old, young):
        with open(path, "wb") as handle:
            handle.write(b"\0" * 5000)
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    code, report, out = run_cli("gc", root=root)
    assert code == 0, out
    assert report["mirrors"][0]["lfs_partials_removed"] == 1 and os.listdir(store.lfs_incomplete) == [
        os.path.basename(young)], report["mirrors"]
    # Each body was cut near its declared size: the server could not send it all.
    assert lfs_server.lfs_sent and all(sent < OVERSIZE for sent in lfs_server.lfs_sent), lfs_server.lfs_sent


def test_a_pointer_declaring_a_size_past_any_file_limit_fails_cleanly(root, lfs_upstream):
    """Regression (issue 27 review): a pointer saying `size 9223372036854775807` (git-lfs reads
    it: an int64) made a file size limit of 2**63, which setrlimit cannot take: git-lfs never
    started and the clone failed CLONE_FAILED "SubprocessError: Exception occurred in preexec_fn"."""
    from checkoutcache.git.backend import LfsPointer, lfs_fetch_batches

    huge = (1 << 63) - 1
    assert all(limit < 1 << 63 for limit, _batch in lfs_fetch_batches([LfsPointer(b"a.bin", "0" * 64, huge)]))
    data = b"small" * 100
    lfs_upstream.put_object(data)
    lie = f"version https://git-lfs.github.com/spec/v1\noid sha256:{lfs_oid(data)}\nsize {huge}\n"
    sha = lfs_upstream.commit({".gitattributes": "*.bin filter=lfs diff=lfs merge=lfs -text\n", "a.bin": lie})
    code, answer, out = run_cli("ensure", lfs_upstream.path, sha, "--wait", "60", root=root)
    assert code == 1 and answer["error"] == "LFS_FAILED", (answer, out)
    store = only_store(root)
    assert store.checkout_names() == [] and store.lfs_object_oids() == []
