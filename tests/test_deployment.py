"""The deployment, for real: deploy/kubernetes.yaml's pod run by podman from
the image built from this tree (helpers/pod.py says how, and where this
machine differs from a cluster), against a real git daemon.

The sidecar (uid 10001) and two review containers (uids 10002 and 10003, all
in group 10001 by the pod's fsGroup, each in its own PID namespace, one
volume) work at once: three reviewers ask 20 times each over six commits, one
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
probes pass as the engine and the kubelet run them.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time

import pytest
import yaml

from checkoutcache.store.layout import RootPaths

from .helpers import GitDaemon, Upstream, wait_until
from .helpers.containers import podman
from .helpers.gate import GatedProxy
from .helpers.pod import ManifestPod

pytestmark = [pytest.mark.container, pytest.mark.slow]  # each builds on the image and runs containers

HERE = os.path.dirname(os.path.abspath(__file__))
REVIEWER = open(os.path.join(HERE, "helpers", "reviewer.py")).read()
MANIFEST = os.path.join(HERE, "..", "deploy", "kubernetes.yaml")
TOKEN = "deployment-" + secrets.token_hex(16)
GRACE = 10.0
# Tight maintenance for the test; everything else is the manifest's.
TIGHT = {"CHECKOUTCACHE_GC_INTERVAL": "1s", "CHECKOUTCACHE_MAX_CHECKOUTS": "2", "CHECKOUTCACHE_GRACE": f"{GRACE:g}s"}
ASKS = 20
ENSURE_ONE = ("import json, sys\nfrom checkoutcache.client import Client\n"
              "print(json.dumps(Client.from_env().ensure(sys.argv[1], sys.argv[2]).to_json()))")


def pod_spec() -> dict:
    with open(MANIFEST) as handle:
        (deployment,) = [d for d in yaml.safe_load_all(handle) if d and d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


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
    pod = ManifestPod(containers, pod_spec(), TOKEN)
    sidecar = pod.run("checkoutcache", env=TIGHT)
    start_sidecar_checked(pod, sidecar)
    review_a = pod.run("review", as_name="review-a")  # uid 10002
    review_b = pod.run("review", as_name="review-b", uid=10003)
    assert review_a.exec("id", "-u").stdout.strip() == "10002" and review_b.exec("id", "-u").stdout.strip() == "10003"
    assert sidecar.exec("sh", "-c", "echo $$").stdout.strip() != review_a.exec("sh", "-c", "echo $$").stdout.strip() \
        or sidecar.processes()[0].pid == 1  # own PID namespaces: each container's first process is 1
    assert review_a.processes()[0].pid == 1 and review_b.processes()[0].pid == 1

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
        return [e for e in serve_events(sidecar) if e.get("event") == "gc" and e.get("removed")]

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

    def gc_after_restart() -> bool:
        events = serve_events(sidecar)
        starts = [i for i, e in enumerate(events) if e.get("event") == "serving"]
        return len(starts) > serving_before and any(e.get("event") == "gc" for e in events[starts[-1]:])

    wait_until(gc_after_restart, 60, "a gc of the restarted sidecar")
    wait_until(lambda: time.monotonic() - held_at > GRACE, GRACE + 5, "the hold to outlast the grace window")
    wait_until(gc_after_restart, 10, "another gc")
    assert_sound(reviewer(review_a, "api", url, [interrupted], 1, "after-restart"))
    review_b.exec("touch", "/tmp/release")
    out, err = holder.communicate(timeout=120)
    assert holder.returncode == 0 and out.strip() == "verified", (out, err)

    sidecar.assert_no_zombie_stays()
    logs = sidecar.logs()
    assert "INTERNAL_ERROR" not in logs and "Traceback" not in logs, logs[-3000:]
    assert podman("inspect", "--format", "{{.State.Health.Status}}", sidecar.name).stdout.strip() == "healthy"
