"""The image itself, run by podman as the deployment runs it: `serve` as the
image's user answers /healthz inside the container, the image's HEALTHCHECK
passes, and it stops on SIGTERM without waiting for the kill. The parts that
need no engine are in test_container.py."""

from __future__ import annotations

import json

import pytest

from .helpers import free_port

pytestmark = pytest.mark.container

HEALTHZ = "import json, sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


def test_serve_answers_healthz_inside_the_image(containers):
    listen = f"127.0.0.1:{free_port()}"  # the host network is shared with the machine
    env = {"CHECKOUTCACHE_LISTEN": listen, "CHECKOUTCACHE_API_TOKEN": "container-token-0123456789"}
    sidecar = containers.run(name="sidecar", volumes={containers.volume(): "/cache"}, env=env)
    sidecar.wait_healthy(timeout=60)
    assert sidecar.health() == "healthy"

    done = sidecar.exec("python3", "-c", HEALTHZ, f"http://{listen}/healthz")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
    assert sidecar.exec("id", "-u").stdout.strip() == "10001"
    assert sidecar.zombies() == []

    assert sidecar.stop(timeout=20) < 15  # SIGTERM ends serve; no SIGKILL after the timeout
    assert sidecar.exit_code() == 0, sidecar.logs()
