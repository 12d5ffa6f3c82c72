"""deploy/: the Kubernetes manifest and the compose file, checked without a
cluster: valid against Kubernetes' own schema (kubernetes-validate, strict), and
every setting they give is one the code reads, with a value it accepts; the
probes, the stop and the uids agree with the image and with serve.
test_deployment.py runs the manifest's pod with podman."""

from __future__ import annotations

import json
import os
import re

import pytest

from checkoutcache.client import Client
from checkoutcache.config import Config, ServeSettings
from checkoutcache.units import parse_duration

yaml = pytest.importorskip("yaml")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DEPLOY = os.path.join(REPO, "deploy")
PACKAGE = os.path.join(REPO, "checkoutcache")
DOCKERFILE = open(os.path.join(REPO, "Dockerfile")).read()
IMAGE_UID = int(re.search(r"useradd .*--uid (\d+)", DOCKERFILE).group(1))
IMAGE_GID = int(re.search(r"groupadd .*--gid (\d+)", DOCKERFILE).group(1))
IMAGE_SOCKET = re.search(r"CHECKOUTCACHE_UNIX_SOCKET=(\S+)", DOCKERFILE).group(1)
TOKEN = "deploy-test-token-0123456789abcdef"


def kubernetes_documents() -> list[dict]:
    with open(os.path.join(DEPLOY, "kubernetes.yaml")) as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def pod_spec() -> dict:
    (deployment,) = [d for d in kubernetes_documents() if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


def compose() -> dict:
    with open(os.path.join(DEPLOY, "compose.yaml")) as handle:
        return yaml.safe_load(handle)


def env_of(container: dict) -> dict[str, str]:
    """A container's environment as the kubelet gives it (secret references: the test's token)."""
    env = {}
    for item in container.get("env", []):
        if "valueFrom" in item:
            assert item["valueFrom"]["secretKeyRef"]["name"] == "checkoutcache-token", item
            env[item["name"]] = TOKEN
        else:
            env[item["name"]] = str(item["value"])
    return env


def names_the_code_reads() -> set[str]:
    found = set()
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as handle:
                    found |= set(re.findall(r"CHECKOUTCACHE_[A-Z0-9_]+", handle.read()))
    return {name for name in found if not name.startswith("CHECKOUTCACHE_TEST_")}


def sidecar_and_review() -> tuple[dict, dict]:
    spec = pod_spec()
    (sidecar,) = spec["initContainers"]
    (review,) = spec["containers"]
    return sidecar, review


def test_the_manifest_is_valid_kubernetes():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    documents = kubernetes_documents()
    assert documents
    for document in documents:
        kubernetes_validate.validate(document, "1.37.0", strict=True)  # raises on any error


def test_every_setting_in_deploy_is_one_the_code_reads_with_a_value_it_accepts():
    known = names_the_code_reads()
    sidecar, review = sidecar_and_review()
    services = compose()["services"]
    environments = [env_of(sidecar), env_of(review), *(
        {k: str(v) for k, v in s.get("environment", {}).items()} for s in services.values())]
    assert all(environments[:2]) and len(environments) == 4
    for env in environments:
        unknown = {name for name in env if name.startswith("CHECKOUTCACHE_")} - known
        assert not unknown, unknown
        ServeSettings.from_env(env, here=False)  # raises BAD_ARGUMENT naming the variable (paths are the container's)
        Config.from_env(env, here=False)


def test_the_probes_the_stop_and_the_uids_agree_with_the_image_and_serve():
    spec = pod_spec()
    sidecar, review = sidecar_and_review()
    settings = ServeSettings.from_env(env_of(sidecar), here=False)
    openapi = json.load(open(os.path.join(PACKAGE, "serve", "openapi.json")))
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert settings.health_listen and settings.health_listen.endswith(f":{ports['health']}")
    assert settings.health_listen.startswith("0.0.0.0:")  # the kubelet probes the pod's IP
    probes = [sidecar[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")]
    for probe in probes:
        assert probe["httpGet"]["port"] == "health" and probe["httpGet"]["path"] in openapi["paths"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: up before the review, down after it
    assert spec["terminationGracePeriodSeconds"] >= settings.stop_timeout + 5
    assert spec["securityContext"]["fsGroup"] == IMAGE_GID
    assert sidecar["securityContext"]["runAsUser"] == IMAGE_UID
    assert review["securityContext"]["runAsGroup"] == IMAGE_GID
    assert review["securityContext"]["runAsUser"] not in (IMAGE_UID, 0)
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (sidecar, review)}
    assert mounts["checkoutcache"]["/cache"] == mounts["review"]["/cache"]
    client = Client.from_env(env_of(review))
    assert client.token == TOKEN and settings.api_address.endswith(":8787")


def test_the_compose_file_is_the_same_deployment_on_one_host():
    services = compose()["services"]
    sidecar, review = services["checkoutcache"], services["review"]
    settings = ServeSettings.from_env({k: str(v) for k, v in sidecar["environment"].items()}, here=False)
    assert parse_duration(sidecar["stop_grace_period"]) >= settings.stop_timeout + 5
    assert "healthcheck" not in sidecar  # the image's own HEALTHCHECK
    uid, gid = (int(n) for n in review["user"].split(":"))
    assert gid == IMAGE_GID and uid not in (IMAGE_UID, 0)
    assert sidecar["volumes"] == review["volumes"] == ["cache:/cache"]
    assert review["environment"]["CHECKOUTCACHE_UNIX_SOCKET"] == IMAGE_SOCKET
    assert review["depends_on"]["checkoutcache"]["condition"] == "service_healthy"
    assert Client.from_env({k: str(v) for k, v in review["environment"].items()}).token is None


def test_no_two_containers_share_a_tmp():
    """The sidecar's git runs in private directories made in its TMPDIR (git/view.py): a /tmp
    another container's uid can rename entries of (an emptyDir has no sticky bit) must not be it."""
    sidecar, review = sidecar_and_review()
    tmp_volumes = [[m["name"] for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
                   for c in (sidecar, review)]
    assert all(len(found) == 1 for found in tmp_volumes), tmp_volumes
    assert tmp_volumes[0] != tmp_volumes[1], tmp_volumes
    services = compose()["services"]
    assert len(services) >= 2 and all("/tmp" in service.get("tmpfs", []) for service in services.values()), services
