"""The image itself, run by podman as its Dockerfile's own example says: the
sidecar with nothing but a volume and a limit serves on the volume's socket; a
review container of another uid in the image's group (which gives it the
socket, and nothing to write in the store), the volume mounted read-only,
with its own PID namespace and the default umask, gets the checkouts the
sidecar made and new ones (CLI and socket); the HEALTHCHECK passes as the
engine runs it; SIGTERM stops it without waiting for the kill. The image
carries its OCI labels and none of apt's caches or manuals. The parts that need no engine are in test_container.py;
the whole pod (deploy/kubernetes.yaml) is test_deployment.py."""

from __future__ import annotations

import json
import os

import pytest

from .helpers import GitDaemon, Upstream
from .helpers.containers import BUILT_FROM, podman

pytestmark = [pytest.mark.container, pytest.mark.slow]  # each builds on the image and runs containers

ENSURE_BY_SOCKET = ("import json, sys\nfrom checkoutcache.client import Client\n"
                    "print(json.dumps(Client.from_env().ensure(sys.argv[1], sys.argv[2], wait=120).to_json()))")
VERIFY = 'test "$(git -c safe.directory=* -C "$1" rev-parse HEAD)" = "$2" && ' \
         'test -z "$(git -c safe.directory=* --no-optional-locks -C "$1" status --porcelain)"'


@pytest.fixture
def served(tmp_path):
    (tmp_path / "served").mkdir()
    daemon = GitDaemon(str(tmp_path / "served"))
    upstream = Upstream(os.path.join(daemon.base, "project"))
    upstream.standard_history(3)
    yield upstream, daemon.url("project")
    daemon.stop()


def test_the_dockerfiles_example_with_a_review_container_of_another_uid(containers, served):
    """Regression: a review container of another uid in the image's group asking the CLI for a
    commit the sidecar had made ready got INTERNAL_ERROR (the sidecar wrote 0644 files and 0755
    directories); the Dockerfile's own example exited 2 (TCP needed a token)."""
    upstream, url = served
    volume = containers.volume()
    # docker run -v cache:/cache -e CHECKOUTCACHE_MAX_CHECKOUTS=20 checkoutcache
    sidecar = containers.run(name="sidecar", volumes={volume: "/cache"}, env={"CHECKOUTCACHE_MAX_CHECKOUTS": "20"})
    sidecar.wait_healthy(timeout=60)
    assert sidecar.exec("id", "-u").stdout.strip() == "10001"
    group = sidecar.exec("id", "-g").stdout.strip()
    # The sidecar's uid makes the first commit ready (a podman exec: umask 0022).
    made = sidecar.exec("checkoutcache", "--json", "ensure", url, upstream.shas[0], "--wait", "120")
    assert made.returncode == 0, made.stdout + made.stderr

    review = containers.run("infinity", name="review", user=f"10002:{group}", entrypoint="sleep",
                            volumes={volume: "/cache:ro"}, healthcheck=False,
                            env={"CHECKOUTCACHE_UNIX_SOCKET": "/cache/checkoutcache.sock"})
    assert review.processes()[0].pid == 1  # its own PID namespace
    for sha in upstream.shas[:2]:  # the sidecar's checkout, then one the review's own worker makes
        done = review.exec("checkoutcache", "--json", "ensure", url, sha, "--wait", "120")
        answer = json.loads(done.stdout)
        assert done.returncode == 0 and answer["state"] == "ready", (answer, done.stderr)
        assert review.exec("sh", "-c", VERIFY, "sh", answer["path"], sha).returncode == 0
    done = review.exec("python3", "-c", ENSURE_BY_SOCKET, url, upstream.shas[2])
    answer = json.loads(done.stdout)
    assert answer["state"] == "ready", (answer, done.stderr)
    assert review.exec("sh", "-c", VERIFY, "sh", answer["path"], upstream.shas[2]).returncode == 0
    status = json.loads(sidecar.exec("checkoutcache", "--json", "status").stdout)
    assert not status.get("problems") and status["totals"]["checkouts"] == 3, status

    sidecar.assert_no_zombie_stays()
    assert sidecar.stop(timeout=30) < 25  # SIGTERM ends serve; no SIGKILL after the timeout
    assert sidecar.exit_code() == 0, sidecar.logs()


def test_the_image_carries_its_labels_and_nothing_a_container_never_reads(containers):
    labels = json.loads(podman("image", "inspect", "--format", "{{json .Labels}}", containers.image).stdout)
    assert labels["org.opencontainers.image.revision"] == BUILT_FROM[containers.image], labels
    assert labels["org.opencontainers.image.licenses"] == "MIT" and labels["org.opencontainers.image.version"]
    assert "org.opencontainers.image.source" in labels
    # apt's downloads and indexes, and the manuals of what the image installed, are not in it.
    found = podman("run", "--rm", "--no-healthcheck", "--entrypoint=sh", containers.image, "-c",
                   "ls /var/cache/apt/archives/*.deb /var/cache/apt/*.bin /usr/share/man/man1/git.1.gz "
                   "/var/lib/apt/lists/*_Packages* 2>/dev/null; git --version && git lfs version", check=False)
    assert found.returncode == 0 and found.stdout.startswith("git version"), found.stdout + found.stderr
