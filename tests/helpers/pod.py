"""deploy/kubernetes.yaml's pod, run by podman as the kubelet would run it.

Each container of the pod spec becomes a podman container of the image, with
what the spec says: the uid and gid (and fsGroup as a supplementary group),
a read-only root, dropped capabilities, no privilege escalation, the memory
limit, the environment (secret references get the test's token), the command,
and the volume mounts (an emptyDir becomes a podman volume prepared as the
kubelet prepares one for an fsGroup: group fsGroup, setgid, 0777 | 02000;
/tmp a tmpfs). A field of a container this module does not translate fails
the test: the manifest cannot say more than what runs.

Where this machine differs from a cluster (and why): the pod's shared network
namespace is the host network (no CNI here; containers still have their own
PID namespaces), so the listening ports are replaced by free ones (the host
network is shared with the machine); probes are run by the test, by HTTP on
127.0.0.1, when it asks (`probe`); restarts are `start()` after `stop()`.
"""

from __future__ import annotations

import http.client
import json
import re

from .containers import Container, Containers, podman
from .daemons import free_port

TRANSLATED = {"name", "image", "imagePullPolicy", "restartPolicy", "env", "ports", "startupProbe",
              "readinessProbe", "livenessProbe", "resources", "securityContext", "volumeMounts", "command"}
PORT_SETTINGS = ("CHECKOUTCACHE_LISTEN", "CHECKOUTCACHE_HEALTH_LISTEN")


def podman_memory(quantity: str) -> str:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return f"{number}{unit[0].lower()}"


class ManifestPod:
    def __init__(self, containers: Containers, spec: dict, token: str):
        self.containers = containers
        self.spec = spec
        self.token = token
        self.grace = int(spec.get("terminationGracePeriodSeconds", 30))
        self.fs_group = spec.get("securityContext", {}).get("fsGroup")
        self.volumes: dict[str, str | None] = {}  # pod volume name -> podman volume (None: a tmpfs)
        for volume in spec.get("volumes", []):
            assert set(volume) == {"name", "emptyDir"}, volume
            # a /tmp of its own (a tmpfs per container), the cache a shared volume
            self.volumes[volume["name"]] = None if volume["name"].endswith("tmp") else self._empty_dir()
        # The ports serve listens on, replaced by free ones (shared host network).
        self.ports = {name: free_port() for name in PORT_SETTINGS}

    def _empty_dir(self) -> str:
        volume = self.containers.volume()
        if self.fs_group is not None:  # the kubelet's SetVolumeOwnership for an fsGroup
            podman("run", "--rm", "--user=0", "--no-healthcheck", "--entrypoint=sh", f"--volume={volume}:/v",
                   self.containers.image, "-c", f"chgrp {self.fs_group} /v && chmod 2777 /v")
        return volume

    def container_spec(self, name: str) -> dict:
        for container in self.spec.get("initContainers", []) + self.spec["containers"]:
            if container["name"] == name:
                return container
        raise KeyError(name)

    def env(self, container: dict) -> dict[str, str]:
        env = {}
        for item in container.get("env", []):
            if "valueFrom" in item:
                env[item["name"]] = self.token
            else:
                env[item["name"]] = str(item["value"])
        for setting in PORT_SETTINGS:
            if setting in env:
                host = env[setting].rpartition(":")[0]
                env[setting] = f"{host}:{self.ports[setting]}"
        if "CHECKOUTCACHE_API_URL" in env:
            env["CHECKOUTCACHE_API_URL"] = f"http://127.0.0.1:{self.ports['CHECKOUTCACHE_LISTEN']}"
        return env

    def run(self, name: str, *, as_name: str | None = None, uid: int | None = None,
            env: dict[str, str] | None = None) -> Container:
        """The pod's container NAME (as_name and uid: a second copy of it, as another uid);
        env: settings the test overrides."""
        spec = self.container_spec(name)
        untranslated = set(spec) - TRANSLATED
        assert not untranslated, f"{name}: the test does not run {sorted(untranslated)}"
        security = spec.get("securityContext", {})
        user = f"{uid if uid is not None else security['runAsUser']}:{security['runAsGroup']}"
        options = []
        if self.fs_group is not None:
            options.append(f"--group-add={self.fs_group}")
        if security.get("readOnlyRootFilesystem"):
            options.append("--read-only")
        if security.get("capabilities", {}).get("drop") == ["ALL"]:
            options.append("--cap-drop=all")
        if security.get("allowPrivilegeEscalation") is False:
            options.append("--security-opt=no-new-privileges")
        memory = spec.get("resources", {}).get("limits", {}).get("memory")
        if memory:
            options.append(f"--memory={podman_memory(memory)}")
        volumes = {}
        for mount in spec.get("volumeMounts", []):
            source = self.volumes[mount["name"]]
            if source is None:
                options.append(f"--tmpfs={mount['mountPath']}")
            else:
                volumes[source] = mount["mountPath"]
        command = spec.get("command")
        entrypoint = json.dumps(command) if command else None
        return self.containers.run(name=as_name or name, user=user, env={**self.env(spec), **(env or {})},
                                   volumes=volumes, entrypoint=entrypoint, options=tuple(options),
                                   healthcheck=command is None)

    def probe(self, container_name: str, kind: str) -> tuple[int, dict]:
        """The container's probe (startupProbe, readinessProbe, livenessProbe) as the kubelet runs
        it: an HTTP GET on the named port; (status, JSON body)."""
        spec = self.container_spec(container_name)
        get = spec[kind]["httpGet"]
        named = {p["name"]: p["containerPort"] for p in spec.get("ports", [])}
        assert named.get(get["port"]) is not None, get
        port = self.ports["CHECKOUTCACHE_HEALTH_LISTEN"]  # the named port, as replaced
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=spec[kind].get("timeoutSeconds", 1) + 4)
        try:
            conn.request("GET", get["path"])
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"{}")
        finally:
            conn.close()

    def mountpoint(self, volume_name: str) -> str:
        """Where the host sees a pod volume (for checks after the fact)."""
        source = self.volumes[volume_name]
        return podman("volume", "inspect", "--format", "{{.Mountpoint}}", source).stdout.strip()

