"""Fleet seeding (issue 15): `bundle publish` writes git bundles and a bundle list to
a shared store (a directory, or S3 through moto in server mode); a cold node's new
mirror takes them in before it fetches the difference from upstream. A store that
is down, a bundle removed or corrupt, a list that names other places: each costs
speed only, and says so in the seed record, status and metrics."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
import uuid

import pytest
import trustme

from checkoutcache.bundles.bundlelist import (
    BundleEntry,
    parse_list,
    plan_publish,
    plan_prune,
    render_list,
)
from checkoutcache.bundles.location import bundle_key, parse_bundle_uri
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.store import locks

from .helpers.disk import small_filesystem
from .helpers import (
    AWS_TEST_SECRET,
    MotoS3,
    Serve,
    assert_checkout_matches,
    git,
    grep_tree,
    only_repo,
    run_cli,
    wait_until,
)
from .helpers import wait_ready as _wait_ready

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="bundles need the git CLI")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = MotoS3(str(tmp_path_factory.mktemp("moto")))
    yield server
    server.stop()


@pytest.fixture
def bucket(s3) -> str:
    name = f"fleet-{uuid.uuid4().hex[:12]}"
    s3.make_bucket(name)
    return name


def grow(repo, count: int, tag: str) -> list[str]:
    """count commits, each changing a few files of a growing tree (a history worth seeding)."""
    for number in range(count):
        repo.commit({f"{tag}/part_{number % 7}/file_{number}.txt": f"{tag} {number}\n" * (20 + number),
                     "CHANGELOG": f"{tag} {number}\n"}, message=f"{tag} {number}")
    return repo.shas[-count:]


def wait_ready(root: str, repo: str, sha: str, timeout: float = 60, extra: tuple[str, ...] = (), **kw) -> dict:
    """ensure --wait; with a bundle store, --history full too: a cold node's first answer is the
    commit alone, and the bundles seed its history, which follows (issue 34), so what seeding
    did is known once the history is complete."""
    if ((kw.get("env") or {}).get("CHECKOUTCACHE_BUNDLE_URI")):
        extra = (*extra, "--history", "full")
    return _wait_ready(root, repo, sha, timeout, extra, **kw)


def publish(root: str, url: str, store: str, *extra: str, env: dict | None = None) -> dict:
    code, answer, out = run_cli("bundle", "publish", url, "--to", store, *extra, root=root, env=env)
    assert code == 0, out
    [report] = answer["published"]
    return report


def seed_record(root: str) -> dict:
    with open(only_repo(root).seed_record) as handle:
        return json.load(handle)


def mirror_objects(root: str) -> int:
    counts = dict(line.split(": ") for line in git("count-objects", "-v", cwd=only_repo(root).mirror).splitlines())
    return int(counts["count"]) + int(counts["in-pack"])


def store_dir(store: str) -> str:
    """The one repository folder of a file:// store."""
    base = store[len("file://"):]
    [key] = os.listdir(base)
    return os.path.join(base, key)


@pytest.fixture
def published(tmp_path, served_upstream):
    """An upstream with a history, published to a file:// store as a full bundle and
    one increment, then 3 commits more: the newest commits are in no bundle."""
    repo, url = served_upstream
    grow(repo, 30, "base")
    store = f"file://{tmp_path / 'store'}"
    publisher = str(tmp_path / "publisher")
    first = publish(publisher, url, store)
    grow(repo, 5, "second")
    second = publish(publisher, url, store)
    assert (first["action"], second["action"]) == ("full", "increment"), (first, second)
    in_bundles = repo.shas[-1]
    newer = grow(repo, 3, "after")
    return repo, url, store, in_bundles, newer[-1]


# ---------------------------------------------------------------- the issue's regression

@pytest.mark.slow
def test_a_cold_node_seeded_from_bundles_fetches_only_the_difference_from_upstream(tmp_path, published):
    repo, url, store, _, newest = published
    seeded, unseeded = str(tmp_path / "node-seeded"), str(tmp_path / "node-plain")
    answer = wait_ready(seeded, url, newest, env={"CHECKOUTCACHE_BUNDLE_URI": store})
    wait_ready(unseeded, url, newest, extra=("--history", "full"))  # the whole history, as a full clone
    assert_checkout_matches(answer["path"], repo.path, newest)
    record = seed_record(seeded)
    assert record["seeded"] and record["why"] is None, record
    assert len(record["bundles"]) == 2, record
    full_clone = mirror_objects(unseeded)
    fetched = record["upstream"]["objects"]
    # The 3 newest commits' objects, not the repository's: a full clone is ~10x more here.
    assert 0 < fetched <= full_clone * 0.2, (fetched, full_clone)
    code, status, out = run_cli("status", root=seeded)
    assert status["repos"][0]["seed"]["seeded"] and status["repos"][0]["seed"]["upstream_since"]["objects"] == fetched
    # The bundles seeded the history (clone/history.py), whose refs/bundles/ the mirror took in.
    assert git("for-each-ref", "--format=%(refname)", "refs/bundles/", cwd=only_repo(seeded).mirror)
    assert git("rev-list", "--count", newest, cwd=answer["path"]) == git("rev-list", "--count", newest, cwd=repo.path)


@pytest.mark.slow
def test_bundle_refs_go_once_the_mirror_has_fetched_from_upstream(tmp_path, published):
    """Regression: refs/bundles/* survived every gc, holding the whole bundled history in
    every seeded mirror for ever. Once the mirror has fetched from upstream they go, and the
    next repack drops what only they held; a bundled commit asked later is fetched anew."""
    repo, url, store, in_bundles, newest = published
    node = str(tmp_path / "node")
    answer = wait_ready(node, url, newest, env={"CHECKOUTCACHE_BUNDLE_URI": store})
    mirror = only_repo(node).mirror
    code, report, out = run_cli("gc", "--mirror-gc-interval", "0", root=node)
    assert code == 0, out
    (entry,) = report["mirrors"]
    assert entry.get("bundle_refs_dropped") is True and entry["repacked"] is True, entry
    assert git("for-each-ref", "--format=%(refname)", "refs/bundles/", cwd=mirror) == ""
    assert_checkout_matches(answer["path"], repo.path, newest)
    older = wait_ready(node, url, in_bundles)
    assert_checkout_matches(older["path"], repo.path, in_bundles)


@pytest.mark.slow
def test_a_commit_the_bundles_hold_needs_no_objects_from_upstream(tmp_path, published):
    repo, url, store, in_bundles, _ = published
    node = str(tmp_path / "node")
    answer = wait_ready(node, url, in_bundles, env={"CHECKOUTCACHE_BUNDLE_URI": store})
    assert_checkout_matches(answer["path"], repo.path, in_bundles)
    assert seed_record(node)["upstream"]["objects"] == 0


# ---------------------------------------------------------------- S3 (moto in server mode)

@pytest.mark.slow
def test_four_cold_nodes_seed_from_s3_at_once_and_no_credential_reaches_the_root(tmp_path, served_upstream, s3,
                                                                              bucket):
    repo, url = served_upstream
    grow(repo, 20, "base")
    store = f"s3://{bucket}/fleet"
    publisher = str(tmp_path / "publisher")
    assert publish(publisher, url, store, env=s3.env)["action"] == "full"
    grow(repo, 3, "second")
    assert publish(publisher, url, store, env=s3.env)["action"] == "increment"
    keys = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"])
    assert len(keys) == 5 and keys[0].startswith("fleet/") and keys[-1].endswith("/bundle-list"), keys
    newest = grow(repo, 2, "after")[-1]
    env = {**os.environ, **s3.env, "CHECKOUTCACHE_BUNDLE_URI": store}
    nodes = [str(tmp_path / f"node-{n}") for n in range(4)]
    procs = [subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", node, "ensure", url, newest,
                               "--wait", "120", "--history", "full"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in nodes]
    outputs = [proc.communicate(timeout=180) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0, 0], outputs
    for node, (out, _err) in zip(nodes, outputs):
        answer = json.loads(out)
        assert answer["state"] == "ready"
        assert_checkout_matches(answer["path"], repo.path, newest)
        record = seed_record(node)
        assert record["seeded"] and len(record["bundles"]) == 2 and record["why"] is None, record
        assert record["store"] == store
        assert not grep_tree(node, AWS_TEST_SECRET.encode()), "an AWS secret reached the root"
        assert AWS_TEST_SECRET not in out + _err
    assert not grep_tree(publisher, AWS_TEST_SECRET.encode())


@pytest.mark.slow
def test_an_s3_upload_that_fails_is_aborted_and_a_killed_publishers_by_the_next(tmp_path, served_upstream, s3,
                                                                             bucket, kill_log):
    """Regression: a publisher killed during an S3 multipart upload left the upload open for
    ever (its parts billed, invisible to pruning). A failed upload is aborted at once; one a
    killed publisher left is aborted by the next publish, --prune-after after it began."""
    repo, url = served_upstream
    repo.commit({"big.bin": os.urandom(12 << 20)}, message="a bundle of two parts")  # > one 8 MiB part
    store = f"s3://{bucket}/fleet"
    publisher = str(tmp_path / "publisher")

    def uploads() -> list[str]:
        return [u["Key"] for u in s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])]

    code, answer, out = run_cli("bundle", "publish", url, "--to", store, root=publisher,
                                env={**s3.env, "CHECKOUTCACHE_TEST_ENOSPC_AT": "during-upload"})
    assert code == 1 and answer["published"][0]["action"] == "failed", out
    assert uploads() == []  # aborted on the failure
    code, _, out = run_cli("bundle", "publish", url, "--to", store, root=publisher,
                           env={**s3.env, "CHECKOUTCACHE_TEST_KILL_AT": "during-upload"})
    assert code == -9 and open(kill_log).read().startswith("during-upload "), out
    assert len(uploads()) == 1  # the killed publisher's
    report = publish(publisher, url, store, "--prune-after", "0", env=s3.env)
    assert report["action"] == "full" and uploads() == [], report


@pytest.mark.slow
def test_the_s3_store_down_costs_speed_only(tmp_path, served_upstream):
    repo, url = served_upstream
    down = MotoS3(str(tmp_path))
    down.stop()  # the endpoint refuses connections now
    node = str(tmp_path / "node")
    started = time.monotonic()
    answer = wait_ready(node, url, repo.shas[-1], env={**down.env, "CHECKOUTCACHE_BUNDLE_URI": "s3://gone/fleet"})
    assert time.monotonic() - started < 60
    assert_checkout_matches(answer["path"], repo.path, repo.shas[-1])
    record = seed_record(node)
    assert not record["seeded"] and "did not answer" in record["why"] and record["reason"] == "store-down", record
    with open(only_repo(node).clone_log("history")) as handle:  # the history's log: the bundles seed it
        assert "bundles: the store did not answer" in handle.read()


@pytest.mark.slow
def test_publishing_to_a_store_that_is_down_fails_with_a_code(tmp_path, served_upstream):
    _, url = served_upstream
    down = MotoS3(str(tmp_path))
    down.stop()
    code, answer, out = run_cli("bundle", "publish", url, "--to", "s3://gone/fleet", root=str(tmp_path / "pub"),
                                env=down.env)
    assert code == 1, out
    [report] = answer["published"]
    assert report["action"] == "failed" and report["error"] == "BUNDLE_STORE_FAILED", report
    assert AWS_TEST_SECRET not in out


# ---------------------------------------------------------------- damaged stores

@pytest.mark.parametrize("damage", ["increment removed", "increment truncated", "full removed", "full truncated"])
@pytest.mark.slow
def test_a_bundle_removed_or_corrupt_after_the_list_was_written(tmp_path, published, damage):
    repo, url, store, _, newest = published
    folder = store_dir(store)
    with open(os.path.join(folder, "bundle-list")) as handle:
        full, increment = [e.uri for e in parse_list(handle.read()).entries]
    victim = os.path.join(folder, increment if damage.startswith("increment") else full)
    if damage.endswith("removed"):
        os.unlink(victim)
    else:
        with open(victim, "r+b") as handle:
            handle.truncate(os.path.getsize(victim) // 2)
    node = str(tmp_path / "node")
    answer = wait_ready(node, url, newest, env={"CHECKOUTCACHE_BUNDLE_URI": store})
    assert_checkout_matches(answer["path"], repo.path, newest)
    record = seed_record(node)
    assert os.path.basename(victim) in record["why"], record
    assert record["bundles"] == ([full] if damage.startswith("increment") else []), record
    assert record["seeded"] == damage.startswith("increment") and record["reason"] == "bundle-unusable"
    assert not os.listdir(only_repo(node).scratch_dir), "a download was left behind"


@pytest.mark.parametrize("listing", ["", "[bundle]\n\tversion = 1\n[bundle \"x\"]\n\turi = https://elsewhere.example/x"
                                         ".bundle\n\tcreationToken = 5\n[bundle \"y\"]\n\turi = ../other/1-abcdef12.bundle"
                                         "\n\tcreationToken = 6\n", "not a list at all ]]]\n"])
@pytest.mark.slow
def test_a_list_that_is_empty_malformed_or_names_other_places_is_not_followed(tmp_path, served_upstream, listing):
    repo, url = served_upstream
    store = tmp_path / "store"
    code, _, out = run_cli("bundle", "publish", url, "--to", f"file://{store}", root=str(tmp_path / "pub"))
    assert code == 0, out
    with open(os.path.join(store_dir(f"file://{store}"), "bundle-list"), "w") as handle:
        handle.write(listing)
    node = str(tmp_path / "node")
    wait_ready(node, url, repo.shas[-1], env={"CHECKOUTCACHE_BUNDLE_URI": f"file://{store}"})
    record = seed_record(node)
    assert not record["seeded"] and ("not usable" in record["why"] or "names no bundle" in record["why"]), record
    assert record["reason"] == "bad-list"


def test_a_store_without_this_repository_says_so(tmp_path, served_upstream):
    repo, url = served_upstream
    node = str(tmp_path / "node")
    wait_ready(node, url, repo.shas[-1], env={"CHECKOUTCACHE_BUNDLE_URI": f"file://{tmp_path / 'empty'}"})
    record = seed_record(node)
    assert not record["seeded"] and "no bundle list for this repository" in record["why"], record
    assert record["reason"] == "no-list"


# ---------------------------------------------------------------- https (read-only), and refusals

class _Https:
    """A threaded HTTPS server on 127.0.0.1 with a certificate from a test CA (ca_file)."""

    def __init__(self, workdir: str, handler: type[http.server.BaseHTTPRequestHandler]):
        ca = trustme.CA()
        self.ca_file = os.path.join(workdir, "ca.pem")
        ca.cert_pem.write_to_path(self.ca_file)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(context)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()


class _StoreOverHttps(_Https):
    """The store's directory served read-only over HTTPS; /redirect/<path> sends to http://."""

    def __init__(self, directory: str, workdir: str):
        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=directory, **kwargs)

            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path.startswith("/redirect/"):
                    self.send_response(302)
                    self.send_header("Location", "http://127.0.0.1:9/" + self.path[len("/redirect/"):])
                    self.end_headers()
                    return
                super().do_GET()

        super().__init__(workdir, Handler)


@pytest.mark.slow
def test_a_node_seeds_from_an_https_store_and_refuses_a_redirect_to_http(tmp_path, published):
    repo, url, store, _, newest = published
    server = _StoreOverHttps(store[len("file://"):], str(tmp_path))
    try:
        env = {"SSL_CERT_FILE": server.ca_file}
        node = str(tmp_path / "node")
        wait_ready(node, url, newest, env={**env, "CHECKOUTCACHE_BUNDLE_URI": f"https://127.0.0.1:{server.port}"})
        assert seed_record(node)["seeded"] and len(seed_record(node)["bundles"]) == 2
        other = str(tmp_path / "node-redirected")
        wait_ready(other, url, newest,
                   env={**env, "CHECKOUTCACHE_BUNDLE_URI": f"https://127.0.0.1:{server.port}/redirect"})
        record = seed_record(other)
        assert not record["seeded"] and "away from https" in record["why"], record
    finally:
        server.stop()


@pytest.mark.parametrize("uri", ["http://127.0.0.1:1/store", "https://user:secret-in-uri@127.0.0.1/x",
                                 "https://127.0.0.1/x?X-Amz-Signature=abc", "s3://NOT_A_BUCKET/x", "file://relative/x",
                                 "ftp://127.0.0.1/x"])
def test_an_unusable_bundle_location_is_bad_input_and_writes_nothing(tmp_path, served_upstream, uri):
    repo, url = served_upstream
    root = str(tmp_path / "root")
    code, answer, out = run_cli("ensure", url, repo.shas[-1], root=root, env={"CHECKOUTCACHE_BUNDLE_URI": uri})
    assert code == 2 and answer["error"] == "BAD_ARGUMENT", out
    assert "secret-in-uri" not in out and "abc" not in answer["message"]
    code, answer, out = run_cli("bundle", "publish", url, "--to", uri, root=root)
    assert code == 2 and answer["error"] == "BAD_ARGUMENT", out
    assert not os.path.exists(root)


@pytest.mark.slow
def test_publishing_needs_a_writable_store_and_a_remote_repository(tmp_path, served_upstream, upstream):
    _, url = served_upstream
    root = str(tmp_path / "root")
    code, answer, out = run_cli("bundle", "publish", url, "--to", "https://127.0.0.1:1/store", root=root)
    assert code == 2 and "read-only" in answer["message"], out
    code, answer, out = run_cli("bundle", "publish", url, root=root)
    assert code == 2 and "no bundle store" in answer["message"], out
    assert not os.path.exists(root)
    code, answer, out = run_cli("bundle", "publish", upstream.path, "--to", f"file://{tmp_path / 's'}", root=root)
    assert code == 1 and answer["published"][0]["error"] == "BAD_ARGUMENT", out


def test_a_bundle_location_opens_no_transport_for_repositories(tmp_path):
    code, answer, out = run_cli("ensure", "http://127.0.0.1:1/repo", "a" * 40, root=str(tmp_path / "root"),
                                env={"CHECKOUTCACHE_BUNDLE_URI": "https://127.0.0.1:1/store"})
    assert code == 2 and answer["error"] == "UNSAFE_TRANSPORT", out


# ---------------------------------------------------------------- publishing

@pytest.mark.slow
def test_publish_chains_increments_then_starts_anew_and_prunes_what_no_list_names(tmp_path, served_upstream):
    repo, url = served_upstream
    store = f"file://{tmp_path / 'store'}"
    publisher = str(tmp_path / "publisher")
    options = ("--max-increments", "1", "--prune-after", "0")
    actions = [publish(publisher, url, store, *options)["action"]]
    actions.append(publish(publisher, url, store, *options)["action"])
    grow(repo, 2, "one")
    actions.append(publish(publisher, url, store, *options)["action"])
    grow(repo, 2, "two")
    last = publish(publisher, url, store, *options)
    actions.append(last["action"])
    # The first chain is only retired by that run; the next one deletes it (after --prune-after, 0 here).
    final = publish(publisher, url, store, *options)
    actions.append(final["action"])
    assert actions == ["full", "up to date", "increment", "full", "up to date"], actions
    assert len(final["pruned"]) == 6, final  # two bundles, their heads and retired marks
    folder = store_dir(store)
    stem = last["bundle"][: -len(".bundle")]
    assert sorted(os.listdir(folder)) == sorted(["bundle-list", f"{stem}.bundle", f"{stem}.heads"])
    node = str(tmp_path / "node")
    wait_ready(node, url, repo.shas[-1], env={"CHECKOUTCACHE_BUNDLE_URI": store})
    assert seed_record(node)["bundles"] == [last["bundle"]]
    assert seed_record(node)["upstream"]["objects"] == 0


@pytest.mark.slow
def test_publish_without_repo_publishes_every_mirror_of_the_root(tmp_path, served_upstream):
    repo, url = served_upstream
    publisher = str(tmp_path / "publisher")
    wait_ready(publisher, url, repo.shas[0], extra=("--history", "full"))  # bundles come from whole histories
    store = f"file://{tmp_path / 'store'}"
    code, answer, out = run_cli("bundle", "publish", "--to", store, root=publisher)
    assert code == 0, out
    [report] = answer["published"]
    assert report["action"] == "full" and report["repo"] == url and report["refs"] == 1, report
    code, _, text = run_cli("bundle", "publish", "--to", store, root=publisher)
    assert code == 0


@pytest.mark.slow
def test_two_publishers_at_once_leave_a_list_whose_bundles_all_seed(tmp_path, served_upstream):
    repo, url = served_upstream
    store = f"file://{tmp_path / 'store'}"
    errors = []

    def publisher(name: str) -> None:
        for _ in range(4):
            code, _, out = run_cli("bundle", "publish", url, "--to", store, root=str(tmp_path / name))
            if code != 0:
                errors.append(out)

    threads = [threading.Thread(target=publisher, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for _ in range(4):
        grow(repo, 1, f"race-{time.monotonic_ns()}")
        time.sleep(0.3)
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert publish(str(tmp_path / "a"), url, store)["action"] in ("increment", "up to date", "full")
    with open(os.path.join(store_dir(store), "bundle-list")) as handle:
        listed = parse_list(handle.read()).entries
    assert listed and all(os.path.isfile(os.path.join(store_dir(store), e.uri)) for e in listed)
    node = str(tmp_path / "node")
    answer = wait_ready(node, url, repo.shas[-1], env={"CHECKOUTCACHE_BUNDLE_URI": store})
    assert_checkout_matches(answer["path"], repo.path, repo.shas[-1])
    record = seed_record(node)
    assert record["seeded"] and record["why"] is None and len(record["bundles"]) == len(listed), record


# ---------------------------------------------------------------- the other transport, kills, metrics

@pytest.mark.slow
def test_the_libgit2_transport_fetches_the_difference_after_seeding(tmp_path, published):
    repo, url, store, _, newest = published
    node = str(tmp_path / "node")
    answer = wait_ready(node, url, newest, env={"CHECKOUTCACHE_BUNDLE_URI": store, "CHECKOUTCACHE_TRANSPORT": "pygit2"})
    assert_checkout_matches(answer["path"], repo.path, newest)
    record = seed_record(node)
    assert record["seeded"] and 0 < record["upstream"]["objects"] < mirror_objects(node) * 0.5, record


@pytest.mark.slow
def test_without_the_git_cli_a_node_clones_from_upstream_and_says_why(tmp_path, published):
    repo, url, store, _, newest = published
    empty = tmp_path / "bin-without-git"
    empty.mkdir()
    node = str(tmp_path / "node")
    code, answer, out = run_cli("ensure", url, newest, "--wait", "60", root=node,
                                env={"CHECKOUTCACHE_BUNDLE_URI": store, "CHECKOUTCACHE_TRANSPORT": "pygit2",
                                     "PATH": str(empty)})
    assert code == 0, out
    assert_checkout_matches(answer["path"], repo.path, newest)
    record = seed_record(node)
    assert not record["seeded"] and "git CLI" in record["why"] and record["reason"] == "no-git", record


@pytest.mark.slow
def test_a_worker_killed_while_seeding_leaves_no_mirror_and_the_next_one_seeds(tmp_path, published, kill_log):
    """A mirror whose first fetch is its whole history (CHECKOUTCACHE_FIRST_FETCH=full) is seeded
    by its worker: killed there, it leaves no mirror. A shallow mirror's history is seeded by the
    history's process: killed there, the checkout stays and the next history seeds (test below)."""
    repo, url, store, _, newest = published
    node = str(tmp_path / "node")
    env = {"CHECKOUTCACHE_BUNDLE_URI": store, "CHECKOUTCACHE_FIRST_FETCH": "full"}
    code, answer, out = run_cli("ensure", url, newest, root=node,  # one worker, answering at once
                                env={**env, "CHECKOUTCACHE_TEST_KILL_AT": "before-seed"})
    assert answer["state"] == "cloning", out
    wait_until(lambda: os.path.exists(kill_log) and open(kill_log).read(), what="the worker's kill")
    with open(kill_log) as handle:
        assert handle.read().split()[0] == "before-seed"
    wait_until(lambda: not locks.clone_running(only_repo(node), newest), what="the killed worker's lock freed")
    assert not os.path.exists(only_repo(node).mirror)
    answer = wait_ready(node, url, newest, env=env)
    assert_checkout_matches(answer["path"], repo.path, newest)
    assert seed_record(node)["seeded"]


@pytest.mark.slow
@pytest.mark.faults
def test_a_history_killed_while_seeding_leaves_the_checkout_and_the_next_history_seeds(tmp_path, published,
                                                                                        kill_log):
    repo, url, store, _, newest = published
    node = str(tmp_path / "node")
    env = {"CHECKOUTCACHE_BUNDLE_URI": store}
    answer = _wait_ready(node, url, newest, env={**env, "CHECKOUTCACHE_TEST_KILL_AT": "history-before-seed"})
    assert answer["history"] == "shallow"
    wait_until(lambda: os.path.exists(kill_log) and open(kill_log).read(), what="the history's kill")
    with open(kill_log) as handle:
        assert handle.read().split()[0] == "history-before-seed"
    wait_until(lambda: not locks.history_running(only_repo(node)), what="the killed history's lock freed")
    assert not os.path.exists(only_repo(node).seed_record)  # killed before it took anything in
    assert_checkout_matches(answer["path"], repo.path, newest)  # the published tree is whole all the while
    answer = wait_ready(node, url, newest, env=env)  # --history full: the next history, from the start
    assert answer["history"] == "complete"
    assert seed_record(node)["seeded"]
    assert git("rev-list", "--count", newest, cwd=answer["path"]) == git("rev-list", "--count", newest, cwd=repo.path)


@pytest.mark.slow
def test_serve_metrics_say_which_mirrors_were_seeded(tmp_path, published):
    repo, url, store, _, newest = published
    root = str(tmp_path / "node")
    server = Serve(root, tmp_path, env={"CHECKOUTCACHE_BUNDLE_URI": store})
    try:
        status, body = server.request("POST", "/v1/ensure", {"repo": url, "commit": newest, "wait": 60,
                                                             "history": "full"})  # the history is seeded
        assert status == 200 and body["state"] == "ready" and body["history"] == "complete", body
        key = only_repo(root).key
        newest_bundle = seed_record(root)["bundles"][-1]
        deadline = time.monotonic() + 10
        while True:
            status, text = server.request("GET", "/metrics")
            text = text if isinstance(text, str) else json.dumps(text)
            if 'checkoutcache_bundle_seeds_total{outcome="seeded",reason=""} 1.0' in text or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert f'checkoutcache_mirror_seeded{{bundle="{newest_bundle}",repo="{key}"}} 1.0' in text, text
        assert 'checkoutcache_bundle_seeds_total{outcome="seeded",reason=""} 1.0' in text, text
        assert f'checkoutcache_upstream_objects_since_seed{{repo="{key}"}}' in text
        status, body = server.request("GET", "/v1/status")
        assert body["repos"][0]["seed"]["seeded"], body
    finally:
        server.stop()


# ---------------------------------------------------------------- pure decisions

def test_the_list_we_write_is_the_list_git_reads(tmp_path):
    entries = [BundleEntry("100-aaaaaaaa", "100-aaaaaaaa.bundle", 100), BundleEntry("90-bbbbbbbb", "90-bbbbbbbb.bundle", 90)]
    text = render_list(entries)
    path = tmp_path / "list"
    path.write_text(text)
    read = git("config", "--file", str(path), "--list")
    assert "bundle.mode=all" in read and "bundle.heuristic=creationToken" in read
    assert "bundle.100-aaaaaaaa.creationtoken=100" in read
    assert [e.token for e in parse_list(text).entries] == [90, 100]


def test_a_list_names_only_objects_of_its_own_folder():
    text = render_list([BundleEntry("1-abcdef12", "1-abcdef12.bundle", 1)])
    text += '[bundle "evil"]\n\turi = https://evil.example/1-abcdef12.bundle\n\tcreationToken = 9\n'
    text += '[bundle "up"]\n\turi = ../1-abcdef12.bundle\n\tcreationToken = 8\n'
    assert [e.id for e in parse_list(text).entries] == ["1-abcdef12"]


def test_plans_and_pruning_are_decided_from_the_list_and_the_clock():
    now = 1_000_000.0
    chain = parse_list(render_list([BundleEntry("a", "999000-aaaaaaaa.bundle", 999_000),
                                    BundleEntry("b", "999500-bbbbbbbb.bundle", 999_500)]))
    assert plan_publish(None, now, 6, 86400).full
    assert not plan_publish(chain, now, 6, 86400).full
    assert plan_publish(chain, now, 1, 86400).full  # one increment already
    assert plan_publish(chain, now, 6, 500).full  # the full bundle is older than 500 s
    assert plan_publish(chain, now, 6, 86400, force_full=True).full
    stored = [("999000-aaaaaaaa.bundle", now - 7200), ("999000-aaaaaaaa.heads", now - 7200),
              ("999000-aaaaaaaa.retired", now - 7200),  # listed again: its mark goes
              ("998000-cccccccc.bundle", now - 7200), ("998000-cccccccc.heads", now - 7200),
              ("998000-cccccccc.retired", now - 3700),  # retired over an hour ago: deleted
              ("997000-dddddddd.bundle", now - 7200), ("997000-dddddddd.retired", now - 60),  # retired a minute ago
              ("996000-eeeeeeee.bundle", now - 9000),  # old but never seen unlisted: retired first
              ("995000-ffffffff.bundle", now - 60),  # young: another publisher's, its list not written yet
              ("bundle-list", now - 7200), (".tmp-1-ab-x.bundle", now - 7200), (".tmp-2-cd-y.bundle", now - 10)]
    plan = plan_prune(stored, {"999000-aaaaaaaa.bundle"}, now, 3600)
    assert plan.retire == ["996000-eeeeeeee.bundle"]
    assert plan.delete == [".tmp-1-ab-x.bundle", "998000-cccccccc.bundle", "998000-cccccccc.heads",
                           "998000-cccccccc.retired"]
    assert plan.relisted == ["999000-aaaaaaaa.retired"]


def test_a_token_of_non_ascii_digits_is_no_token():
    text = render_list([BundleEntry("1-abcdef12", "1-abcdef12.bundle", 1)]).replace("creationToken = 1", "creationToken = ²")
    assert parse_list(text).entries == ()


@pytest.mark.parametrize("raw, shown", [("s3://fleet-bundles/prod/", "s3://fleet-bundles/prod"),
                                        ("file:///srv/bundles/", "file:///srv/bundles"),
                                        ("https://cdn.example/bundles", "https://cdn.example/bundles"),
                                        ("off", None), ("", None)])
def test_bundle_locations(raw, shown):
    location = parse_bundle_uri(raw)
    assert (str(location) if location else None) == shown


def test_a_bad_location_names_the_setting():
    with pytest.raises(CheckoutCacheError) as caught:
        parse_bundle_uri("http://cdn.example/bundles")
    assert caught.value.code == "BAD_ARGUMENT" and "CHECKOUTCACHE_BUNDLE_URI" in caught.value.message


@pytest.mark.slow
def test_a_mirror_rebuilt_for_unreadable_objects_is_not_seeded_again(tmp_path, published):
    repo, url, store, in_bundles, _ = published
    node = str(tmp_path / "node")
    env = {"CHECKOUTCACHE_BUNDLE_URI": store}
    wait_ready(node, url, repo.shas[0], env=env)
    assert seed_record(node)["seeded"]
    mirror = only_repo(node).mirror
    # Every object loose, then one blob of the commit lost: the commit is there (no fetch
    # is needed), its checkout fails, and the mirror is rebuilt.
    packs = os.path.join(mirror, "objects", "pack")
    for name in sorted(os.listdir(packs)):
        if name.endswith(".pack"):
            os.rename(os.path.join(packs, name), str(tmp_path / name))
            for other in os.listdir(packs):
                if other.startswith(name[:-len(".pack")]):
                    os.unlink(os.path.join(packs, other))
            with open(tmp_path / name, "rb") as handle:
                subprocess.run(["git", "-C", mirror, "unpack-objects", "-q"], stdin=handle, check=True)
    blob = git("rev-parse", f"{in_bundles}:CHANGELOG", cwd=repo.path)
    os.unlink(os.path.join(mirror, "objects", blob[:2], blob[2:]))
    answer = wait_ready(node, url, in_bundles, env=env)
    assert_checkout_matches(answer["path"], repo.path, in_bundles)
    record = seed_record(node)
    assert not record["seeded"] and "unreadable" in record["why"] and record["reason"] == "rebuild", record


class _DrippingHttps(_Https):
    """Serves a bundle list naming one bundle, then that bundle one byte per half second."""

    def __init__(self, workdir: str):
        listing = render_list([BundleEntry("1-abcdef12", "1-abcdef12.bundle", 1)]).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path.endswith("/bundle-list"):
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(listing)))
                    self.end_headers()
                    self.wfile.write(listing)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(1 << 30))
                self.end_headers()
                try:
                    for _ in range(600):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.5)
                except OSError:
                    pass

        super().__init__(workdir, Handler)


@pytest.mark.slow
def test_a_store_that_drips_a_bundle_costs_its_own_budget_never_the_clone_timeout(tmp_path, served_upstream,
                                                                                  fake_git):
    """Regression: a slow store spent half the clone timeout, and a clone whose fetch needs
    more than the other half ended TIMEOUT where it succeeds without a store. Seeding now has
    its own budget (CHECKOUTCACHE_SEED_TIMEOUT), outside the clone timeout."""
    repo, url = served_upstream
    # Every upstream fetch takes 3 s of the clone's 5 s (the store never sends a whole bundle).
    slow_fetch = fake_git('case "$*" in *" fetch "*git://*) sleep 3;; esac')
    server = _DrippingHttps(str(tmp_path))
    try:
        node = str(tmp_path / "node")
        answer = wait_ready(node, url, repo.shas[-1], env={
            **slow_fetch, "SSL_CERT_FILE": server.ca_file, "CHECKOUTCACHE_CLONE_TIMEOUT": "5s",
            "CHECKOUTCACHE_SEED_TIMEOUT": "4s", "CHECKOUTCACHE_BUNDLE_URI": f"https://127.0.0.1:{server.port}/store"})
        assert_checkout_matches(answer["path"], repo.path, repo.shas[-1])
        record = seed_record(node)
        assert not record["seeded"] and "did not finish" in record["why"] and record["reason"] == "out-of-time", record
        assert record["seconds"] >= 3.9  # its whole budget went to the store, none of the clone's
    finally:
        server.stop()


# ---------------------------------------------------------------- found by review

def write_store(store_root, url: str, bundles: dict[str, bytes]) -> str:
    """A file:// store for url's repository holding these bundles (name -> content), listed in name order."""
    folder = os.path.join(str(store_root), bundle_key("default", url, False))
    os.makedirs(folder, exist_ok=True)
    entries = []
    for name, data in bundles.items():
        with open(os.path.join(folder, name), "wb") as handle:
            handle.write(data)
        token = int(name.split("-")[0])
        entries.append(BundleEntry(name[: -len(".bundle")], name, token))
    with open(os.path.join(folder, "bundle-list"), "w") as handle:
        handle.write(render_list(entries))
    return f"file://{store_root}"


def test_a_bundle_lacking_its_history_leaves_nothing_in_the_mirror(tmp_path, served_upstream):
    """Regression: git stores a bundle's pack before its connectivity check fails, so the
    commit (without its parents) looked present and was served with a broken history."""
    repo, url = served_upstream
    head = repo.shas[-1]
    objects = [head, git("rev-parse", f"{head}^{{tree}}", cwd=repo.path)]
    objects += [line.split()[2] for line in git("ls-tree", "-r", head, cwd=repo.path).splitlines()]
    pack = subprocess.run(["git", "-C", repo.path, "pack-objects", "--stdout"], input="\n".join(objects).encode(),
                          capture_output=True, check=True).stdout
    crafted = f"# v2 git bundle\n{head} refs/heads/main\n\n".encode() + pack  # no prerequisites named
    store = write_store(tmp_path / "store", url, {"100-abcdef12.bundle": crafted})
    node = str(tmp_path / "node")
    answer = wait_ready(node, url, head, env={"CHECKOUTCACHE_BUNDLE_URI": store})
    record = seed_record(node)
    assert not record["seeded"] and record["reason"] == "bundle-unusable", record
    assert git("log", "--format=%H", cwd=answer["path"]).split() == list(reversed(repo.shas))
    git("fsck", "--connectivity-only", "--no-dangling", cwd=only_repo(node).mirror)


@pytest.mark.parametrize("hostile", [".git", ".GIT", "git~1", ".git\u200c", ".gitmodules-link"])
def test_a_bundle_carrying_a_tree_git_refuses_leaves_nothing_in_the_mirror(tmp_path, served_upstream, hostile):
    """Regression (issue 27 review): git before 2.46 checks no object a fetch from a bundle
    brings, whatever fetch.fsckObjects says: a bundle store's tree with a `.git` entry (or its
    case, NTFS and HFS spellings, or a symlinked .gitmodules) landed in the mirror unchecked."""
    repo, url = served_upstream
    head = repo.shas[-1]
    evil = tmp_path / "evil"
    git("init", "-q", "--bare", str(evil), cwd=str(tmp_path))
    blob = subprocess.run(["git", "-C", str(evil), "hash-object", "-w", "--stdin"], input=b"x\n",
                          capture_output=True, check=True).stdout.decode().strip()
    entry = f"120000 blob {blob}\t.gitmodules" if hostile == ".gitmodules-link" else f"100644 blob {blob}\t{hostile}"
    tree = subprocess.run(["git", "-C", str(evil), "mktree"], input=(entry + "\n").encode(), capture_output=True,
                          check=True).stdout.decode().strip()
    commit = git("commit-tree", "-m", "hostile", tree, cwd=str(evil)).strip()
    git("update-ref", "refs/heads/main", commit, cwd=str(evil))
    git("bundle", "create", "-q", str(tmp_path / "evil.bundle"), "refs/heads/main", cwd=str(evil))
    store = write_store(tmp_path / "store", url, {"100-abcdef12.bundle": (tmp_path / "evil.bundle").read_bytes()})
    node = str(tmp_path / "node")
    answer = wait_ready(node, url, head, env={"CHECKOUTCACHE_BUNDLE_URI": store})
    record = seed_record(node)
    assert not record["seeded"] and record["reason"] == "bundle-unusable", record
    assert git("log", "--format=%H", cwd=answer["path"]).split() == list(reversed(repo.shas))
    mirror = only_repo(node).mirror
    present = subprocess.run(["git", "-C", mirror, "cat-file", "-e", tree], capture_output=True)
    assert present.returncode != 0, "the hostile tree reached the mirror"
    assert "refs/bundles/" not in git("for-each-ref", cwd=mirror)
    git("fsck", "--strict", "--no-dangling", cwd=mirror)


def test_a_bundle_with_a_quirk_git_clone_takes_is_still_taken_in(tmp_path, served_upstream):
    """The check of a bundle's packs keeps our fsck choices: a tree mode written 040000
    (pallets/flask has them) is taken in, as git's clone takes it."""
    repo, url = served_upstream
    quirky = tmp_path / "quirky"
    git("init", "-q", "--bare", str(quirky), cwd=str(tmp_path))

    def write(kind: str, data: bytes) -> str:
        return subprocess.run(["git", "-C", str(quirky), "hash-object", "-t", kind, "-w", "--literally", "--stdin"],
                              input=data, capture_output=True, check=True).stdout.decode().strip()

    blob = write("blob", b"x\n")
    sub = write("tree", b"100644 f\0" + bytes.fromhex(blob))
    tree = write("tree", b"040000 sub\0" + bytes.fromhex(sub))
    commit = git("commit-tree", "-m", "old converter", tree, cwd=str(quirky)).strip()
    git("update-ref", "refs/heads/main", commit, cwd=str(quirky))
    git("bundle", "create", "-q", str(tmp_path / "quirky.bundle"), "refs/heads/main", cwd=str(quirky))
    store = write_store(tmp_path / "store", url, {"100-abcdef12.bundle": (tmp_path / "quirky.bundle").read_bytes()})
    node = str(tmp_path / "node")
    wait_ready(node, url, repo.shas[-1], env={"CHECKOUTCACHE_BUNDLE_URI": store})
    assert seed_record(node)["seeded"], seed_record(node)
    git("cat-file", "-e", tree, cwd=only_repo(node).mirror)


@pytest.mark.parametrize("transport", ["cli", "pygit2"])
@pytest.mark.slow
def test_a_commit_a_bundle_planted_without_its_history_is_fetched_from_upstream(tmp_path, served_upstream,
                                                                               transport):
    """Regression: a bundle whose refs are sound but whose pack also carries commit X (tree and
    blobs) without X's parents passes `git bundle verify` and the take-in. X was then answered
    ready with a broken `git log`, and an ancestor of X failed UNKNOWN_COMMIT on every retry
    (X's keep-ref was offered to the upstream as a "have")."""
    repo, url = served_upstream
    first, middle, head = repo.shas
    listed = git("rev-list", "--objects", first, cwd=repo.path).splitlines()
    planted = git("rev-list", "--objects", "--no-walk", head, cwd=repo.path).splitlines()
    objects = sorted({line.split()[0] for line in listed + planted})
    pack = subprocess.run(["git", "-C", repo.path, "pack-objects", "--stdout"], input="\n".join(objects).encode(),
                          capture_output=True, check=True).stdout
    crafted = f"# v2 git bundle\n{first} refs/heads/main\n\n".encode() + pack
    store = write_store(tmp_path / "store", url, {"100-abcdef12.bundle": crafted})
    node = str(tmp_path / "node")
    env = {"CHECKOUTCACHE_BUNDLE_URI": store, "CHECKOUTCACHE_TRANSPORT": transport}
    answer = wait_ready(node, url, head, env=env)
    assert seed_record(node)["seeded"]  # the bundle itself was sound: taken in
    assert git("log", "--format=%H", cwd=answer["path"]).split() == [head, middle, first]
    code, report, _ = run_cli("verify", url, head, root=node, env=env)
    assert code == 0 and report["broken"] == 0
    ancestor = wait_ready(node, url, middle, env=env)
    assert git("log", "--format=%H", cwd=ancestor["path"]).split() == [middle, first]
    git("fsck", "--connectivity-only", "--no-dangling", cwd=only_repo(node).mirror)


@pytest.mark.slow
def test_a_long_chain_of_bundles_cannot_take_the_disk_the_clone_needs(tmp_path, served_upstream):
    """Regression: each download's disk share was bounded, not their total: a chain of four
    bundles for branches the node never needs filled a small disk, and the clone then failed
    where it succeeds without a store. The bundles seed the history now (the first answer is
    the commit alone): the history takes what the disk allows, or stops short of the reserve."""
    repo, url = served_upstream
    store = f"file://{tmp_path / 'store'}"
    publisher = str(tmp_path / "publisher")
    for side in range(4):
        git("checkout", "-q", "-b", f"side{side}", "main", cwd=repo.path)
        repo.commit({f"side{side}.bin": os.urandom(12 << 20)}, message=f"side {side}")
        git("checkout", "-q", "main", cwd=repo.path)
        publish(publisher, url, store)
    head = repo.commit({"needed.bin": os.urandom(28 << 20)}, message="needed")
    with small_filesystem(str(tmp_path / "small"), "100m") as mount:
        node = os.path.join(mount, "node")
        answer = _wait_ready(node, url, head, timeout=120, env={"CHECKOUTCACHE_BUNDLE_URI": store})
        assert_checkout_matches(answer["path"], repo.path, head)
        code, answer, out = run_cli("ensure", url, head, "--history", "full", "--wait", "120", root=node,
                                    env={"CHECKOUTCACHE_BUNDLE_URI": store})
        record = seed_record(node)
        assert record["seeded"] and 0 < len(record["bundles"]) < 4 and record["reason"] == "no-space", record
        if code != 0:  # the history itself found no room: it stopped above the reserve, the checkout is whole
            assert answer["error"] == "HISTORY_FAILED" and "DISK_FULL" in answer["message"], out
        assert_checkout_matches(only_repo(node).checkout(head), repo.path, head)


def test_a_file_store_never_follows_a_symlink_or_reads_a_device(tmp_path, served_upstream):
    repo, url = served_upstream
    store = write_store(tmp_path / "store", url, {})
    folder = os.path.join(store[len("file://"):], bundle_key("default", url, False))
    os.symlink("/dev/zero", os.path.join(folder, "100-abcdef12.bundle"))
    with open(os.path.join(folder, "bundle-list"), "w") as handle:
        handle.write(render_list([BundleEntry("100-abcdef12", "100-abcdef12.bundle", 100)]))
    node = str(tmp_path / "node")
    started = time.monotonic()
    wait_ready(node, url, repo.shas[-1], env={"CHECKOUTCACHE_BUNDLE_URI": store})
    assert time.monotonic() - started < 30
    record = seed_record(node)
    assert not record["seeded"] and "symbolic link" in record["why"], record


class _BrokenHttps(_Https):
    """Answers every request with a status line that is not HTTP."""

    def __init__(self, workdir: str):
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.wfile.write(b"garbage that is no status line\r\n\r\n")

        super().__init__(workdir, Handler)


def test_an_https_store_that_speaks_no_http_costs_speed_only(tmp_path, served_upstream):
    """Regression: http.client's errors are not OSErrors; they failed the clone (CLONE_FAILED)."""
    repo, url = served_upstream
    server = _BrokenHttps(str(tmp_path))
    try:
        node = str(tmp_path / "node")
        answer = wait_ready(node, url, repo.shas[-1], env={
            "SSL_CERT_FILE": server.ca_file, "CHECKOUTCACHE_BUNDLE_URI": f"https://127.0.0.1:{server.port}/s"})
        assert_checkout_matches(answer["path"], repo.path, repo.shas[-1])
        record = seed_record(node)
        assert not record["seeded"] and record["reason"] == "store-down", record
    finally:
        server.stop()


@pytest.mark.slow
def test_a_branch_deleted_upstream_leaves_the_next_bundles(tmp_path, served_upstream):
    """Regression: publishing fetched without pruning, so a deleted branch (a leaked
    secret, say) lived on in every bundle and was served to every seeded node."""
    repo, url = served_upstream
    git("branch", "leaked", repo.shas[0], cwd=repo.path)
    store = f"file://{tmp_path / 'store'}"
    publisher = str(tmp_path / "publisher")
    first = publish(publisher, url, store)
    assert "refs/heads/leaked" in git("bundle", "list-heads", os.path.join(store_dir(store), first["bundle"]))
    git("branch", "-D", "leaked", cwd=repo.path)
    second = publish(publisher, url, store, "--full")
    assert second["action"] == "full"
    heads = git("bundle", "list-heads", os.path.join(store_dir(store), second["bundle"]))
    assert "refs/heads/main" in heads and "leaked" not in heads


@pytest.mark.slow
def test_a_busy_mirror_fails_one_repository_and_the_others_are_published(tmp_path, daemon):
    """Regression: a held mirror lock (a clone running) aborted the whole run with INTERNAL_ERROR."""
    from checkoutcache.store.layout import RootPaths

    from .helpers import Upstream

    urls = []
    for name in ("busy-a", "free-b"):
        repo = Upstream(os.path.join(daemon.base, f"{name}-{uuid.uuid4().hex[:6]}"))
        repo.standard_history(1)
        urls.append(daemon.url(os.path.basename(repo.path)))
    publisher = str(tmp_path / "publisher")
    for url, repo_sha in zip(urls, [None, None]):
        code, _, out = run_cli("bundle", "publish", url, "--to", f"file://{tmp_path / 'store'}", root=publisher)
        assert code == 0, out
    busy = [k for k in RootPaths(publisher).repo_keys()
            if json.load(open(RootPaths(publisher).repo(k).repo_json))["url"] == urls[0]][0]
    with locks.mirror_write(RootPaths(publisher).repo(busy), timeout=5):
        code, answer, out = run_cli("bundle", "publish", *urls, "--to", f"file://{tmp_path / 'store'}",
                                    root=publisher, env={"CHECKOUTCACHE_CLONE_TIMEOUT": "2s"})
    assert code == 1, out
    reports = {r["repo"]: r for r in answer["published"]}
    assert reports[urls[0]]["action"] == "failed" and reports[urls[0]]["error"] == "BUNDLE_FAILED", reports
    assert "locked" in reports[urls[0]]["message"]
    assert reports[urls[1]]["action"] == "up to date", reports


@pytest.mark.slow
def test_an_s3_endpoint_on_plain_http_is_refused_unless_allowed(tmp_path, served_upstream, s3, bucket):
    repo, url = served_upstream
    store = f"s3://{bucket}/fleet"
    assert publish(str(tmp_path / "publisher"), url, store, env=s3.env)["action"] == "full"
    insecure = {k: v for k, v in s3.env.items() if k != "CHECKOUTCACHE_S3_ALLOW_HTTP"}
    node = str(tmp_path / "node")
    wait_ready(node, url, repo.shas[-1], env={**insecure, "CHECKOUTCACHE_BUNDLE_URI": store})
    record = seed_record(node)
    assert not record["seeded"] and "is not https://" in record["why"] and record["reason"] == "store-down", record
    code, answer, out = run_cli("bundle", "publish", url, "--to", store, root=str(tmp_path / "p2"), env=insecure)
    assert code == 1 and answer["published"][0]["error"] == "BUNDLE_STORE_FAILED", out


@pytest.mark.slow
def test_a_branch_replaced_by_a_deeper_one_between_bundles_seeds_a_sound_mirror(tmp_path, served_upstream):
    """Regression (found by review): `foo` in the full bundle and `foo/bar` in the
    increment clashed under one refs/bundles/; git updated the other refs, the pack was
    then removed, and the mirror kept refs to missing objects (later fetches failed)."""
    repo, url = served_upstream
    git("branch", "foo", cwd=repo.path)
    git("branch", "side", cwd=repo.path)
    store = f"file://{tmp_path / 'store'}"
    publisher = str(tmp_path / "publisher")
    publish(publisher, url, store)
    git("branch", "-D", "foo", cwd=repo.path)
    # A new commit on each, so the increment carries both refs.
    git("checkout", "-q", "-b", "foo/bar", cwd=repo.path)
    repo.commit({"foo-bar.txt": "foo/bar"})
    git("checkout", "-q", "side", cwd=repo.path)
    repo.commit({"side.txt": "side"})
    git("checkout", "-q", "main", cwd=repo.path)
    newest = repo.shas[-1]
    assert publish(publisher, url, store)["action"] == "increment"
    node = str(tmp_path / "node")
    wait_ready(node, url, newest, env={"CHECKOUTCACHE_BUNDLE_URI": store})
    record = seed_record(node)
    assert record["seeded"] and record["why"] is None and len(record["bundles"]) == 2, record
    mirror = only_repo(node).mirror
    git("fsck", "--connectivity-only", "--no-dangling", cwd=mirror)
    git("branch", "-D", "side", cwd=repo.path)
    later = repo.commit({"later.txt": "later"})
    code, answer, out = run_cli("ensure", url, later, "--wait", "60", root=node)
    assert code == 0 and answer["state"] == "ready", out  # the first attempt, not after a back-off
    git("gc", "--prune=now", "--quiet", cwd=mirror)


@pytest.mark.faults
def test_a_shallow_mirror_is_not_published(tmp_path, served_upstream, kill_log):
    """A mirror whose history has not arrived (its history process killed at its start) would
    make a bundle of commits whose parents no reader has: publish refuses it, and writes nothing;
    once its history is complete it publishes."""
    repo, url = served_upstream
    publisher = str(tmp_path / "publisher")
    answer = wait_ready(publisher, url, repo.shas[-1], env={"CHECKOUTCACHE_TEST_KILL_AT": "history-start"})
    assert answer["history"] == "shallow"
    wait_until(lambda: os.path.exists(kill_log) and open(kill_log).read().startswith("history-start "),
               what="the history's kill")
    wait_until(lambda: not locks.history_running(only_repo(publisher)), what="the killed history's lock freed")
    store = tmp_path / "store"
    code, answer, out = run_cli("bundle", "publish", url, "--to", f"file://{store}", root=publisher)
    assert code == 1 and answer["published"][0]["action"] == "failed", out
    assert answer["published"][0]["error"] == "BUNDLE_FAILED" and "shallow" in answer["published"][0]["message"]
    assert not store.exists() or not list(store.rglob("*.bundle"))
    wait_ready(publisher, url, repo.shas[-1], extra=("--history", "full"))
    assert publish(publisher, url, f"file://{store}")["action"] == "full"
