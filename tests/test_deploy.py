"""deploy/: the Kubernetes manifests and the compose file, checked without a
cluster: valid against Kubernetes' own schema (kubernetes-validate, strict), and
every setting they give is one the code reads, with a value it accepts; the
probes, the stop and the uids agree with the image and with serve; one writer
(the review outside the store's group, the cache read-only for it); the health
port admitted only to the scraper; storage requested for what the volumes may
hold; the persistent variant the same pod but for its volume.
test_deployment.py runs the manifest's pod with podman."""

from __future__ import annotations

import copy
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


MANIFESTS = ("kubernetes.yaml", "kubernetes-persistent.yaml")


def kubernetes_documents(name: str = "kubernetes.yaml") -> list[dict]:
    with open(os.path.join(DEPLOY, name)) as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def of_kind(kind: str, name: str = "kubernetes.yaml") -> dict:
    (document,) = [d for d in kubernetes_documents(name) if d["kind"] == kind]
    return document


def pod_spec(name: str = "kubernetes.yaml") -> dict:
    return of_kind("Deployment", name)["spec"]["template"]["spec"]


def compose() -> dict:
    with open(os.path.join(DEPLOY, "compose.yaml")) as handle:
        return yaml.safe_load(handle)


def compose_env(service: dict) -> dict[str, str]:
    """A service's environment as compose gives it, ${VAR:?...} given the test's token."""
    return {k: re.sub(r"\$\{CHECKOUTCACHE_API_TOKEN:\?[^}]*\}", TOKEN, str(v))
            for k, v in service.get("environment", {}).items()}


def quantity(text: str) -> int:
    """Bytes of a Kubernetes quantity in the binary suffixes the manifests use."""
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", text).groups()
    return int(number) * 1024 ** ("KMGT".index(unit[0]) + 1)


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


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_manifest_is_valid_kubernetes(name):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    documents = kubernetes_documents(name)
    assert len(documents) >= 2
    for document in documents:
        kubernetes_validate.validate(document, "1.37.0", strict=True)  # raises on any error


def test_every_setting_in_deploy_is_one_the_code_reads_with_a_value_it_accepts():
    known = names_the_code_reads()
    sidecar, review = sidecar_and_review()
    services = compose()["services"]
    environments = [env_of(sidecar), env_of(review), *(compose_env(s) for s in services.values())]
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
    assert sidecar["securityContext"]["runAsUser"] == IMAGE_UID
    assert sidecar["securityContext"]["runAsGroup"] == IMAGE_GID
    assert review["securityContext"]["runAsUser"] not in (IMAGE_UID, 0)
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (sidecar, review)}
    assert mounts["checkoutcache"]["/cache"] == mounts["review"]["/cache"]
    client = Client.from_env(env_of(review))
    assert client.token is None and client.token_file == "/run/secrets/checkoutcache-review/token"
    assert settings.api_address.endswith(":8787")
    assert env_of(review)["CHECKOUTCACHE_API_URL"] == f"http://{settings.api_address}"


@pytest.mark.parametrize("name", MANIFESTS)
def test_one_writer_the_review_is_outside_the_group_and_reads_the_cache_read_only(name):
    """fsGroup would put every container of the pod, the review included, in the store's group."""
    spec = pod_spec(name)
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "checkoutcache"]
    (review,) = spec["containers"]
    pod_security = spec["securityContext"]
    assert "fsGroup" not in pod_security and IMAGE_GID not in pod_security.get("supplementalGroups", [])
    assert pod_security["runAsNonRoot"] is True
    assert review["securityContext"]["runAsGroup"] != IMAGE_GID
    assert review["securityContext"]["runAsUser"] not in (IMAGE_UID, 0)
    assert spec["automountServiceAccountToken"] is False
    mounts = {c["name"]: {m["mountPath"]: m for m in c["volumeMounts"]} for c in (sidecar, review)}
    assert mounts["review"]["/cache"].get("readOnly") is True
    assert not mounts["checkoutcache"]["/cache"].get("readOnly")
    # Writable workspaces: the review's own volume, read (to count and list) by the sidecar.
    workspaces = env_of(review)["CHECKOUTCACHE_WORKSPACES"]
    assert env_of(sidecar)["CHECKOUTCACHE_WORKSPACES"] == workspaces
    assert not mounts["review"][workspaces].get("readOnly")
    assert mounts["checkoutcache"][workspaces].get("readOnly") is True
    assert mounts["review"][workspaces]["name"] == mounts["checkoutcache"][workspaces]["name"]
    for container in (sidecar, review):
        assert env_of(container).get("CHECKOUTCACHE_SHARING", "writer") == "writer"
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] and security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
    # Every init container that runs as root (the persistent variant's volume owner) does one
    # thing to the cache's own directory, with CHOWN and FOWNER only, before anything else runs.
    for container in spec["initContainers"]:
        if container["securityContext"].get("runAsUser") == 0:
            assert container.get("restartPolicy") != "Always" and spec["initContainers"][0] is container
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
            assert [m["mountPath"] for m in container["volumeMounts"]] == ["/cache"]
            assert container["command"][-1] == f"chown {IMAGE_UID}:{IMAGE_GID} /cache && chmod 0755 /cache"


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_health_port_is_admitted_to_the_scraper_alone_and_announced_for_scraping(name):
    deployment, policy = of_kind("Deployment", name), of_kind("NetworkPolicy", name)
    sidecar, _review = sidecar_and_review()
    health = {p["name"]: p["containerPort"] for p in sidecar["ports"]}["health"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected and all(labels.get(k) == v for k, v in selected.items())
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": health}]
    assert rule["from"] and all(peer.get("podSelector", {}).get("matchLabels") and
                                peer.get("namespaceSelector", {}).get("matchLabels") for peer in rule["from"])
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    openapi = json.load(open(os.path.join(PACKAGE, "serve", "openapi.json")))
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(health)
    assert annotations["prometheus.io/path"] == "/metrics" and "/metrics" in openapi["paths"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_pod_requests_the_ephemeral_storage_its_volumes_may_hold(name):
    """An emptyDir counts against the node's ephemeral storage: without a request the scheduler
    may place the pod where its sizeLimits do not fit, and the kubelet evicts it when they fill."""
    spec = pod_spec(name)
    limits = [quantity(v["emptyDir"]["sizeLimit"]) for v in spec["volumes"] if "emptyDir" in v]
    assert len(limits) == len([v for v in spec["volumes"] if "emptyDir" in v]) >= 3
    requested = sum(quantity(c["resources"]["requests"]["ephemeral-storage"])
                    for c in spec["initContainers"] + spec["containers"]
                    if "ephemeral-storage" in c["resources"].get("requests", {}))
    assert requested >= sum(limits), (requested, sum(limits))


def test_the_persistent_variant_is_the_same_pod_with_a_claim_for_the_cache():
    default, persistent = kubernetes_documents(), kubernetes_documents("kubernetes-persistent.yaml")
    (claim,) = [d for d in persistent if d["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert of_kind("NetworkPolicy") == of_kind("NetworkPolicy", "kubernetes-persistent.yaml")
    same, other = of_kind("Deployment"), copy.deepcopy(of_kind("Deployment", "kubernetes-persistent.yaml"))
    # One pod at a time mounts a ReadWriteOnce claim: the old pod goes before the new one starts.
    assert other["spec"].pop("strategy") == {"type": "Recreate"} and "strategy" not in same["spec"]
    spec, other_spec = same["spec"]["template"]["spec"], other["spec"]["template"]["spec"]
    owner = other_spec["initContainers"].pop(0)
    assert owner["name"] == "volume-owner" and owner["securityContext"]["runAsUser"] == 0
    volumes = {v["name"]: v for v in other_spec["volumes"]}
    assert volumes["cache"] == {"name": "cache", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}
    volumes["cache"] = {v["name"]: v for v in spec["volumes"]}["cache"]
    other_spec["volumes"] = [volumes[v["name"]] for v in other_spec["volumes"]]
    # The cache is not ephemeral storage there: the sidecar requests its /tmp's only.
    for spec_ in (spec, other_spec):
        spec_["initContainers"][0]["resources"]["requests"].pop("ephemeral-storage")
    assert other == same


def test_the_compose_file_is_the_same_deployment_on_one_host():
    services = compose()["services"]
    sidecar, review = services["checkoutcache"], services["review"]
    settings = ServeSettings.from_env(compose_env(sidecar), here=False)
    assert parse_duration(sidecar["stop_grace_period"]) >= settings.stop_timeout + 5
    assert "healthcheck" not in sidecar  # the image's own HEALTHCHECK
    uid, gid = (int(n) for n in review["user"].split(":"))
    assert gid != IMAGE_GID and uid not in (IMAGE_UID, 0)  # outside the store's group
    workspaces = compose_env(review)["CHECKOUTCACHE_WORKSPACES"]
    assert compose_env(sidecar)["CHECKOUTCACHE_WORKSPACES"] == workspaces
    assert sidecar["volumes"] == ["cache:/cache", f"workspaces:{workspaces}:ro"]
    assert review["volumes"] == ["cache:/cache:ro", f"workspaces:{workspaces}"]
    # The pod's network namespace on one host: the API on 127.0.0.1 with the review's token alone.
    assert review["network_mode"] == "service:checkoutcache"
    assert settings.api_address.startswith("127.0.0.1:")
    assert sidecar["secrets"] == ["tokens"] and review["secrets"] == ["review"]
    made = compose()["secrets"]
    assert made == {"tokens": {"file": "./tokens/tokens"}, "review": {"file": "./tokens/review"}}
    assert settings.token_file == "/run/secrets/tokens"
    assert Client.from_env(compose_env(review)).token_file == "/run/secrets/review"
    assert settings.allow_repo and "*" not in settings.allow_repo
    assert compose_env(review)["CHECKOUTCACHE_API_URL"] == f"http://{settings.api_address}"
    assert review["depends_on"]["checkoutcache"]["condition"] == "service_healthy"
    assert sidecar["environment"].get("CHECKOUTCACHE_UNIX_SOCKET", IMAGE_SOCKET) == IMAGE_SOCKET


def test_the_example_review_container_stops_on_sigterm():
    """`sleep infinity` as PID 1 has no SIGTERM handler: every stop waited out the grace period
    (tests/test_deployment.py stops the running one)."""
    _sidecar, review = sidecar_and_review()
    for command in (review["command"], compose()["services"]["review"]["entrypoint"]):
        assert command[:2] == ["sh", "-c"] and "trap 'exit 0' TERM" in command[2], command


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


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_review_container_is_given_the_reviews_token_alone(name, tmp_path):
    """Issue 33: the shipped pod gave the review container (code under review) the sidecar's one
    token, valid for every scope and endpoint, and set no allow-list. Now the Secret that
    `checkoutcache tokens --secret` makes holds two roles; the review container mounts the
    review's token only, which may ensure and hold in one scope of the allowed repositories."""
    import subprocess
    import sys

    from checkoutcache.serve.policy import parse_tokens

    spec = pod_spec(name)
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "checkoutcache"]
    (review,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for container in (sidecar, review):
        assert not [i for i in container.get("env", []) if "valueFrom" in i], "no token in an environment"
    review_secrets = [m for m in review["volumeMounts"] if "secret" in volumes[m["name"]]]
    (mount,) = review_secrets
    secret = volumes[mount["name"]]["secret"]
    assert secret["items"] == [{"key": "review", "path": "token"}] and mount.get("readOnly") is True
    assert env_of(review)["CHECKOUTCACHE_API_TOKEN_FILE"] == f"{mount['mountPath']}/token"
    (sidecar_mount,) = [m for m in sidecar["volumeMounts"] if "secret" in volumes[m["name"]]]
    sidecar_secret = volumes[sidecar_mount["name"]]["secret"]
    assert sidecar_secret["secretName"] == secret["secretName"]
    assert sidecar_secret["items"] == [{"key": "tokens", "path": "tokens"}]
    settings = ServeSettings.from_env(env_of(sidecar), here=False)
    assert settings.token_file == f"{sidecar_mount['mountPath']}/tokens"
    assert settings.allow_repo and not [p for p in settings.allow_repo if p.startswith("*")], settings.allow_repo
    # The Secret as the documented command makes it.
    done = subprocess.run([sys.executable, "-m", "checkoutcache", "tokens", "--secret", secret["secretName"]],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    made = json.loads(done.stdout)
    assert made["metadata"]["name"] == secret["secretName"] and set(made["stringData"]) == {"tokens", "review"}
    grants = dict(parse_tokens(made["stringData"]["tokens"], "tokens"))
    review_token = made["stringData"]["review"].strip()
    assert len(grants) == 2 and review_token in grants
    mine = grants[review_token]
    assert mine.can and mine.can <= {"ensure", "hold"} and mine.scopes == {"default"}, mine
    (operator,) = [t for t in grants if t != review_token]
    assert "gc" in grants[operator].can and operator not in made["stringData"]["review"]
