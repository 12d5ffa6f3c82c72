"""The deployment, for real: deploy/kubernetes.yaml's pod run by podman from
the image built from this tree (helpers/pod.py says how, and where this
machine differs from a cluster), against a real git daemon.

One writer: the sidecar (uid 10001) writes the store; two review containers
(uids 10002 and 10003, group 10002, outside the store's group, the cache
volume mounted read-only, each in its own PID namespace) work at once: three reviewers ask 20 times each over six commits, one
through the API with the token (hold, verify, release), one through `exec`
and one through `ensure` on the shared root, while the sidecar's gc runs every
second with at most two checkouts. Then the sidecar is stopped in the middle
of a clone (held at a gated proxy) while a review holds a checkout with
`exec`, and started again.

Pass: no INTERNAL_ERROR anywhere; every ready answer's tree is the commit's;
nothing answered ready (within the grace window) or held is lost; a pruned
checkout is cloned again; the stop ends within its bound, with exit 0; the
interrupted commit has no record or scratch left and is ready after the
restart; no zombie in the sidecar; the image's HEALTHCHECK and the manifest's
probes pass as the engine and the kubelet run them; the example review
container ends on SIGTERM (exit 0, not the grace period's SIGKILL).

Then, one test each: the LRU order sees reviews that only read (a checkout
asked again through the read-only mount outlives one asked before it); a
hostile review (another uid, outside the group, read-only mount) that tries
to write every path of the store, plant symlinks and change checkouts changes
nothing another review sees; the persistent variant's volume owner makes a
new root-owned volume the sidecar's, and its cache outlives the pod.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import threading
import time

import pytest
import yaml

from checkoutcache.store.layout import RootPaths

from .helpers import GitDaemon, Upstream, wait_until, writers_only
from .helpers.containers import podman
from .helpers.gate import GatedProxy
from .helpers.pod import ManifestPod

pytestmark = [pytest.mark.container, pytest.mark.slow]  # each builds on the image and runs containers

HERE = os.path.dirname(os.path.abspath(__file__))
REVIEWER = open(os.path.join(HERE, "helpers", "reviewer.py")).read()
HOSTILE = open(os.path.join(HERE, "helpers", "hostile.py")).read()
DEPLOY = os.path.join(HERE, "..", "deploy")
MANIFEST = os.path.join(DEPLOY, "kubernetes.yaml")
GRACE = 10.0
# Tight maintenance for the test; everything else is the manifest's.
TIGHT = {"CHECKOUTCACHE_GC_INTERVAL": "1s", "CHECKOUTCACHE_MAX_CHECKOUTS": "2", "CHECKOUTCACHE_GRACE": f"{GRACE:g}s"}
ASKS = 20
LIMIT_UNKNOWN = 1 << 30
# The tree is the commit's: HEAD, and nothing changed, deleted or added.
VERIFY = 'test "$(git -c safe.directory=* -C "$1" rev-parse HEAD)" = "$2" && ' \
         'test -z "$(git -c safe.directory=* --no-optional-locks -C "$1" status --porcelain --untracked-files=all)"'
ENSURE_WAIT = ("import json, sys\nfrom checkoutcache.client import Client\n"
               "print(json.dumps(Client.from_env(timeout=400).ensure(sys.argv[1], sys.argv[2], wait=300).to_json()))")
ENSURE_ONE = ("import json, sys\nfrom checkoutcache.client import Client\n"
              "print(json.dumps(Client.from_env().ensure(sys.argv[1], sys.argv[2]).to_json()))")


STORE_GID = 10001  # the image's group, the sidecar's


def pod_spec(manifest: str = MANIFEST) -> dict:
    with open(manifest) as handle:
        (deployment,) = [d for d in yaml.safe_load_all(handle) if d and d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


def assert_one_writer_review(review) -> None:
    """The review container as the manifest runs it: outside the store's group, the cache
    read-only for it (its root file system too), its workspaces writable."""
    groups = {int(g) for g in review.exec("id", "-G").stdout.split()}
    assert groups and STORE_GID not in groups, groups
    for path in ("/cache", "/cache/repos", "/"):
        tried = review.exec("touch", f"{path.rstrip('/')}/.review-was-here")
        assert tried.returncode != 0 and "Read-only file system" in tried.stderr, (path, tried.stderr)
    wrote = review.exec("sh", "-c", 'd=$(mktemp -d /workspaces/probe.XXXXXX) && rmdir "$d"')
    assert wrote.returncode == 0, wrote.stderr


def status_of(container) -> dict:
    done = container.exec("checkoutcache", "--json", "status")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def checkouts_of(status: dict) -> dict[str, dict]:
    return {c["commit"]: c for repo in status["repos"] for c in repo["checkouts"] if c["ready"]}


def client_ensure(container, url: str, sha: str) -> dict:
    """The Python client's ensure (the API, with the token) until ready; the tree verified."""
    done = container.exec("python3", "-c", ENSURE_WAIT, url, sha, timeout=400)
    answer = json.loads(done.stdout)
    assert answer["state"] == "ready", (answer, done.stderr)
    verified = container.exec("sh", "-c", VERIFY, "sh", answer["path"], sha)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    return answer


def cli_ensure(container, url: str, sha: str) -> dict:
    done = container.exec("checkoutcache", "--json", "ensure", url, sha, "--wait", "300", timeout=400)
    answer = json.loads(done.stdout)
    assert done.returncode == 0 and answer["state"] == "ready", (answer, done.stderr)
    verified = container.exec("sh", "-c", VERIFY, "sh", answer["path"], sha)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    return answer


@pytest.fixture
def served(tmp_path):
    (tmp_path / "served").mkdir()
    daemon = GitDaemon(str(tmp_path / "served"))
    upstream = Upstream(os.path.join(daemon.base, "project"))
    upstream.standard_history(6)
    proxy = GatedProxy(daemon.port)
    yield upstream, proxy.url("project"), proxy
    proxy.close()
    daemon.stop()


def serve_events(container) -> list[dict]:
    events = []
    for line in container.logs().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def probe_ok(pod: ManifestPod, kind: str) -> bool:
    try:
        return pod.probe("checkoutcache", kind)[0] == 200
    except OSError:
        return False


def start_sidecar_checked(pod: ManifestPod, sidecar) -> None:
    wait_until(lambda: probe_ok(pod, "startupProbe"), 60, "the startup probe to pass")
    sidecar.wait_healthy(timeout=60)  # the image's HEALTHCHECK, run as the engine runs it
    assert probe_ok(pod, "readinessProbe") and probe_ok(pod, "livenessProbe")


def reviewer(container, mode: str, url: str, shas: list[str], asks: int, seed: str) -> list[dict]:
    done = container.exec("python3", "-c", REVIEWER, mode, url, json.dumps(shas), str(asks), seed, timeout=900)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def assert_sound(results: list[dict]) -> None:
    assert results
    for result in results:
        assert result["state"] == "ready" and result.get("error") is None, result
        if result["problem"] is None:
            continue
        # Only a plain ensure's checkout may go, and only after its grace window.
        assert result["mode"] == "ensure" and result["problem"] == "gone", result
        assert result["seconds_after_answer"] >= GRACE, result


def test_the_pod_as_deployed_with_reviews_gc_a_stop_and_a_restart(containers, served):
    upstream, url, proxy = served
    shas = upstream.shas[:6]
    pod = ManifestPod(containers, pod_spec(), repos=url)
    sidecar = pod.run("checkoutcache", env=TIGHT)
    start_sidecar_checked(pod, sidecar)
    review_a = pod.run("review", as_name="review-a")  # uid 10002
    review_b = pod.run("review", as_name="review-b", uid=10003)
    assert review_a.exec("id", "-u").stdout.strip() == "10002" and review_b.exec("id", "-u").stdout.strip() == "10003"
    assert sidecar.exec("sh", "-c", "echo $$").stdout.strip() != review_a.exec("sh", "-c", "echo $$").stdout.strip() \
        or sidecar.processes()[0].pid == 1  # own PID namespaces: each container's first process is 1
    assert review_a.processes()[0].pid == 1 and review_b.processes()[0].pid == 1
    assert_one_writer_review(review_a)
    assert_one_writer_review(review_b)

    # Three reviewers at once, two uids, API and CLI, while gc keeps at most two checkouts.
    results: dict[str, list[dict]] = {}
    errors: list[BaseException] = []

    def run(name: str, container, mode: str) -> None:
        try:
            results[name] = reviewer(container, mode, url, shas, ASKS, name)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=args) for args in
               (("api", review_a, "api"), ("exec", review_b, "exec"), ("ensure", review_a, "ensure"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    assert not errors, errors
    assert sorted(results) == ["api", "ensure", "exec"]
    for name, answers in results.items():
        assert len(answers) == ASKS, name
        assert_sound(answers)
    assert {r["uid"] for r in results["api"] + results["ensure"]} == {10002} and results["exec"][0]["uid"] == 10003

    # gc must have evicted down to its limit, and a pruned checkout is cloned again.
    def evicted() -> list[dict]:
        # Down to the limit (a removal alone may be another's: a finished history's trash slot).
        return [e for e in serve_events(sidecar) if e.get("event") == "gc" and e.get("removed")
                and e.get("checkouts_after", LIMIT_UNKNOWN) <= 2]

    wait_until(evicted, 60, "the sidecar's gc to evict down to two checkouts")
    status = json.loads(review_b.exec("checkoutcache", "--json", "status").stdout)
    present = {c["commit"] for repo in status["repos"] for c in repo["checkouts"] if c["ready"]}
    pruned = [sha for sha in shas if sha not in present]
    assert pruned, present
    assert_sound(reviewer(review_a, "api", url, pruned[:1], 1, "again"))

    # A review holds a checkout with exec across the stop and the restart.
    held_sha = shas[0]
    holder = subprocess.Popen(
        ["podman", "exec", review_b.name, "checkoutcache", "exec", url, held_sha, "--wait", "300", "--", "sh", "-c",
         'echo held; while [ ! -e /tmp/release ]; do sleep 0.2; done; '
         'test "$(git -c safe.directory=* rev-parse HEAD)" = "$1" && '
         'test -z "$(git -c safe.directory=* --no-optional-locks status --porcelain --untracked-files=all)" '
         '&& echo verified', "sh", held_sha],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": "/var/tmp"})
    assert holder.stdout.readline().strip() == "held", holder.stderr.read()
    held_at = time.monotonic()

    # The sidecar is stopped while a clone is held in its fetch.
    interrupted = upstream.commit({"late.txt": "made while the sidecar runs\n"})
    proxy.shut()
    answer = json.loads(review_a.exec("python3", "-c", ENSURE_ONE, url, interrupted).stdout)
    assert answer["state"] == "cloning", answer
    wait_until(lambda: proxy.held, 60, "the interrupted clone's fetch to reach the gate")
    sidecar.assert_no_zombie_stays()
    took = sidecar.stop(timeout=pod.grace)
    settings_bound = 20.0  # the manifest's CHECKOUTCACHE_STOP_TIMEOUT
    assert took < settings_bound + 5, took
    assert sidecar.exit_code() == 0, sidecar.logs()[-3000:]
    assert "stopping_clones" in {e.get("event") for e in serve_events(sidecar)}
    root = RootPaths(pod.mountpoint("cache"))
    (key,) = root.repo_keys()
    paths = root.repo(key)
    for record in (paths.clone_record(interrupted), paths.failure_record(interrupted),
                   paths.deaths_record(interrupted)):
        assert not os.path.exists(record), record
    assert not [name for name in os.listdir(paths.scratch_dir) if name.startswith(".clone-")]

    # Started again (as a kubelet restarts it): the interrupted commit is cloned, the hold kept.
    proxy.open()
    serving_before = sum(e.get("event") == "serving" for e in serve_events(sidecar))
    sidecar.start()
    start_sidecar_checked(pod, sidecar)

    def gcs_after_restart() -> int:
        events = serve_events(sidecar)
        starts = [i for i, e in enumerate(events) if e.get("event") == "serving"]
        return sum(e.get("event") == "gc" for e in events[starts[-1]:]) if len(starts) > serving_before else 0

    wait_until(lambda: gcs_after_restart() >= 1, 60, "a gc of the restarted sidecar")
    wait_until(lambda: time.monotonic() - held_at > GRACE, GRACE + 5, "the hold to outlast the grace window")
    seen = gcs_after_restart()  # one more gc runs with the hold past its grace window: it keeps the checkout
    wait_until(lambda: gcs_after_restart() > seen, 30, "a gc after the grace window")
    assert_sound(reviewer(review_a, "api", url, [interrupted], 1, "after-restart"))
    review_b.exec("touch", "/tmp/release")
    out, err = holder.communicate(timeout=120)
    assert holder.returncode == 0 and out.strip() == "verified", (out, err)

    sidecar.assert_no_zombie_stays()
    logs = sidecar.logs()
    assert "INTERNAL_ERROR" not in logs and "Traceback" not in logs, logs[-3000:]
    assert podman("inspect", "--format", "{{.State.Health.Status}}", sidecar.name).stdout.strip() == "healthy"

    # The example review's PID 1 ends on SIGTERM: exit 0, where `sleep infinity` waited out the
    # grace period and got SIGKILL (137).
    review_a.stop(timeout=pod.grace)
    assert review_a.exit_code() == 0, review_a.exit_code()


def test_last_use_moves_when_only_read_only_reviews_ask(containers, served):
    """A checkout asked again through the read-only mount (CLI ensure and exec, no write
    possible there) is the more recently used: gc evicts the one asked before it."""
    upstream, url, _proxy = served
    first, second, third = upstream.shas[:3]
    grace = 3.0
    pod = ManifestPod(containers, pod_spec(), repos=url)
    sidecar = pod.run("checkoutcache", env={"CHECKOUTCACHE_GC_INTERVAL": "1s", "CHECKOUTCACHE_MAX_CHECKOUTS": "2",
                                            "CHECKOUTCACHE_GRACE": f"{grace:g}s"})
    start_sidecar_checked(pod, sidecar)
    review = pod.run("review")
    assert_one_writer_review(review)
    cli_ensure(review, url, first)  # new commits, handed to the writer
    cli_ensure(review, url, second)
    before = checkouts_of(status_of(sidecar))
    assert set(before) == {first, second}, before
    time.sleep(grace + 1)  # both out of their grace window

    cli_ensure(review, url, first)  # a ready answer, read through the read-only mount
    held = review.exec("checkoutcache", "exec", url, first, "--", "true")
    assert held.returncode == 0, held.stderr
    after = checkouts_of(status_of(review))
    assert after[first]["last_used"] > before[first]["last_used"], (before[first], after[first])
    assert after[second]["last_used"] == before[second]["last_used"], (before[second], after[second])
    time.sleep(grace + 1)  # both out of their grace window again; first used last

    cli_ensure(review, url, third)  # three checkouts, two allowed: the least recently used goes
    wait_until(lambda: second not in checkouts_of(status_of(sidecar)), 60, "gc to evict the older use")
    assert set(checkouts_of(status_of(review))) == {first, third}
    logs = sidecar.logs()
    assert "INTERNAL_ERROR" not in logs and "Traceback" not in logs, logs[-3000:]


def store_digest(root: str) -> dict[str, tuple]:
    """What a review can see of a store, from the host: every path's type, mode, owner and, for a
    file, its content (a symlink: its target). Files the sidecar itself keeps changing (its logs,
    journals, records, probe files) count by type, mode and owner only; markers' mtimes (last use)
    are not content."""
    churn = ("logs/", "serve/", "state/", "locks/")
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            info = os.lstat(path)
            kind = stat.S_IFMT(info.st_mode)
            entry: tuple = (kind, stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid)
            if stat.S_ISLNK(info.st_mode):
                entry += (os.readlink(path),)
            elif stat.S_ISREG(info.st_mode) and not any(f"/{part}" in f"/{rel}" for part in churn):
                with open(path, "rb") as handle:
                    entry += (hashlib.sha256(handle.read()).hexdigest(),)
            if name.startswith(".health-") or (rel.startswith("serve/") and name.endswith(".journal")):
                continue  # come and go with each probe and serve
            seen[rel] = entry
    return seen


def test_a_hostile_review_changes_nothing_another_review_sees(containers, served):
    upstream, url, _proxy = served
    shas = upstream.shas[:3]
    pod = ManifestPod(containers, pod_spec(), repos=url)
    sidecar = pod.run("checkoutcache", env={"CHECKOUTCACHE_GC_INTERVAL": "1h"})
    start_sidecar_checked(pod, sidecar)
    review = pod.run("review")
    for sha in shas:
        client_ensure(review, url, sha)
    root = pod.mountpoint("cache")
    before = store_digest(root)
    assert sum(1 for rel in before if "/checkouts/" in f"/{rel}") > 10, sorted(before)[:20]

    hostile = pod.run("review", as_name="hostile", uid=10666)
    assert_one_writer_review(hostile)
    done = hostile.exec("python3", "-c", HOSTILE, "/cache", timeout=900)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["succeeded"] == [], report["succeeded"][:20]
    # Ten tries at least per entry it can reach (the writers-only directories it cannot enter).
    reachable = [rel for rel in before if not writers_only(root, rel)]
    assert report["attempts"] > 10 * len(reachable), report["attempts"]
    assert report["errors"].get("EROFS"), report["errors"]
    # Its other doors: the socket is the store's group's; the API wants the token.
    knocked = hostile.exec("python3", "-c", "import socket; s = socket.socket(socket.AF_UNIX); "
                                            "s.connect('/cache/checkoutcache.sock')")
    assert knocked.returncode != 0 and "PermissionError" in knocked.stderr, knocked.stderr
    refused = hostile.exec("python3", "-c", ENSURE_ONE, url, shas[0], env={"CHECKOUTCACHE_API_TOKEN": "guessed"})
    assert "UNAUTHORIZED" in refused.stdout + refused.stderr, refused

    assert store_digest(root) == before

    # Beneath the root, the store's modes alone keep it: the same review with its cache mount
    # writable by mistake (the volume's own root, an emptyDir's 0777, is kept by readOnly alone).
    (mount,) = [m for m in pod.container_spec("review")["volumeMounts"] if m["mountPath"] == "/cache"]
    mount["readOnly"] = False
    careless = pod.run("review", as_name="hostile-rw", uid=10667)
    mount["readOnly"] = True
    done = careless.exec("python3", "-c", HOSTILE, "/cache/repos", timeout=900)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["succeeded"] == [], report["succeeded"][:20]
    assert report["attempts"] > 10 * len([rel for rel in reachable if rel.startswith("repos/")]), report["attempts"]
    # Refused by the modes (EACCES, EPERM), not by a read-only mount (EROFS): it was writable.
    assert "EROFS" not in report["errors"] and report["errors"].get("EACCES"), report["errors"]

    assert store_digest(root) == before
    for sha in shas:  # another review is answered with the commit's own tree, as before
        client_ensure(review, url, sha)
    logs = sidecar.logs()
    assert "INTERNAL_ERROR" not in logs and "Traceback" not in logs, logs[-3000:]


def test_the_persistent_variant_owns_a_new_volume_and_its_cache_outlives_the_pod(containers, served):
    upstream, url, _proxy = served
    spec = pod_spec(os.path.join(DEPLOY, "kubernetes-persistent.yaml"))
    pod = ManifestPod(containers, spec, repos=url)  # the claim: a new volume, root's and 0755, as a new PV
    claim = pod.volumes["cache"]
    info = os.stat(pod.mountpoint("cache"))
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o755)
    owner = pod.run_init("volume-owner")
    sidecar = pod.run("checkoutcache")
    start_sidecar_checked(pod, sidecar)
    review = pod.run("review")
    assert_one_writer_review(review)
    made = client_ensure(review, url, upstream.shas[0])
    info = os.stat(pod.mountpoint("cache"))
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (10001, 10001, 0o755)
    for container in (review, sidecar, owner):
        podman("rm", "--force", "--time=0", container.name)

    again = ManifestPod(containers, spec, pod.secrets, claims={"checkoutcache": claim}, repos=url)
    again.run_init("volume-owner")
    sidecar = again.run("checkoutcache")
    start_sidecar_checked(again, sidecar)
    review = again.run("review")
    assert client_ensure(review, url, upstream.shas[0])["path"] == made["path"]
    assert checkouts_of(status_of(sidecar)).keys() == {upstream.shas[0]}


def test_the_example_review_container_ends_at_once_on_sigterm(containers):
    """Regression: the example review ran `sleep infinity` as PID 1, which has no SIGTERM
    handler: each stop waited out the whole grace period and ended in SIGKILL (exit 137)."""
    pod = ManifestPod(containers, pod_spec())
    review = pod.run("review")
    wait_until(lambda: len(review.processes()) >= 2, 30, "the review's shell to start its sleep")
    review.stop(timeout=pod.grace)
    assert review.exit_code() == 0, (review.exit_code(), review.logs())


def test_a_review_writes_in_a_workspace_of_its_own_that_the_sidecar_counts(containers, served):
    """The review cannot write the shared checkout; `exec --writable` gives it a tree of its own
    on the workspaces volume (read-write for it, read-only for the sidecar, whose status lists it),
    gone when the command ends; the shared checkout stays the commit's."""
    upstream, url, _proxy = served
    sha = upstream.shas[0]
    pod = ManifestPod(containers, pod_spec(), repos=url)
    sidecar = pod.run("checkoutcache")
    start_sidecar_checked(pod, sidecar)
    review = pod.run("review")
    shared = cli_ensure(review, url, sha)["path"]
    wrote = review.exec("sh", "-c", 'echo changed > "$1/made-by-review"', "sh", shared)
    assert wrote.returncode != 0 and "Read-only file system" in wrote.stderr, wrote.stderr

    holder = subprocess.Popen(
        ["podman", "exec", review.name, "checkoutcache", "exec", "--writable", url, sha, "--wait", "300", "--",
         "sh", "-c", 'echo changed > made-by-review && git -c safe.directory=* status --porcelain '
                     '--untracked-files=all | grep -q made-by-review && pwd && '
                     'while [ ! -e /tmp/release ]; do sleep 0.2; done'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": "/var/tmp"})
    workspace = holder.stdout.readline().strip()
    assert workspace.startswith("/workspaces/"), (workspace, holder.stderr.read() if not workspace else "")
    listed = status_of(sidecar)["workspaces"]["workspaces"]
    assert [w["alive"] for w in listed if workspace.startswith(w["path"])] == [True], listed
    review.exec("touch", "/tmp/release")
    out, err = holder.communicate(timeout=120)
    assert holder.returncode == 0, (out, err)
    assert review.exec("test", "-e", workspace).returncode != 0  # removed when its command ended
    assert not [w for w in status_of(sidecar)["workspaces"]["workspaces"] if w["alive"]]
    cli_ensure(review, url, sha)  # the shared checkout is still the commit's own tree


# Every token-shaped string the review container can read: its environment, and the files of
# the places a secret would be (mounts under /run, /tmp, its home, /workspaces, /etc but the CA
# bundle), as code under review would look for them. Each is tried as a bearer token on what
# the review's token must never do: gc, every scope's status, a URL outside the allow-list.
FIND_TOKENS = r"""
import http.client, json, os, re, sys
shape = re.compile(r"[A-Za-z0-9_-]{32,64}")
found = set()
for value in os.environ.values():
    found.update(shape.findall(value))
for top in ("/run", "/tmp", "/workspaces", os.path.expanduser("~"), "/etc"):
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if os.path.join(folder, d) not in ("/etc/ssl", "/etc/ca-certificates")]
        for name in files:
            path = os.path.join(folder, name)
            try:
                if os.path.islink(path) or os.path.getsize(path) > 1 << 16:
                    continue
                with open(path, "rb") as handle:
                    found.update(shape.findall(handle.read().decode("utf-8", "replace")))
            except OSError:
                continue
port = int(sys.argv[1])
tried = {}
for token in sorted(found):
    answers = []
    for method, path, body in (("POST", "/v1/gc", {"max_checkouts": 0}), ("GET", "/v1/status", None),
                               ("POST", "/v1/ensure", {"repo": "git://127.0.0.1:9/anything", "commit": "a" * 40})):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request(method, path, body=json.dumps(body) if body else None,
                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        response = conn.getresponse()
        answers.append([response.status, json.loads(response.read() or b"{}").get("error")])
        conn.close()
    tried[token] = answers
print(json.dumps(tried))
"""


def test_the_review_container_holds_no_token_that_runs_gc_or_reaches_an_unlisted_url(containers, served):
    """Issue 33: the shipped pod gave the review container the sidecar's all-scope token. The pod
    as shipped (its Secret made as deploy/ says): whatever token the review container can read
    asks for its checkouts and nothing else."""
    upstream, url, _proxy = served
    pod = ManifestPod(containers, pod_spec(), repos=url)
    sidecar = pod.run("checkoutcache")
    start_sidecar_checked(pod, sidecar)
    review = pod.run("review")
    client_ensure(review, url, upstream.shas[0])  # its own token does what the review needs
    done = review.exec("python3", "-c", FIND_TOKENS, str(pod.ports["CHECKOUTCACHE_LISTEN"]), timeout=600)
    assert done.returncode == 0, done.stderr
    tried = json.loads(done.stdout)
    review_token = pod.token("checkoutcache-tokens", "review")
    assert review_token in tried, "the scan finds the token the review was given"
    operator = [t for t, _grant in pod.tokens_file() if t != review_token]
    assert operator and not set(operator) & set(tried), "the operator's token is not in the review container"
    for token, answers in tried.items():
        for status, error in answers:
            assert status in (401, 403), (token == review_token, answers)
    assert tried[review_token] == [[403, "FORBIDDEN_ENDPOINT"], [403, "FORBIDDEN_ENDPOINT"],
                                   [403, "FORBIDDEN_REPOSITORY"]], tried[review_token]
