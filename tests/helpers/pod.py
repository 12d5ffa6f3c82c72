"""deploy/kubernetes.yaml's pod, run by podman as the kubelet would run it.

Why not `podman kube play`: podman 4.3 refuses the file ("cannot create an
init container that has either of lifecycle, livenessProbe, readinessProbe, or
startupProbe set"): a native sidecar (an init container with restartPolicy
Always) and its probes are newer than its kube support. So each container of
the pod spec becomes a podman container of the image, with what the spec says:
the uid and gid (and fsGroup, if any, as a supplementary group), a read-only
root, dropped and added capabilities, no privilege escalation, the memory
limit, the environment (secret references get the Secret's values), the command,
and the volume mounts, read-only where the spec says readOnly. The Secrets the
spec names are made as deploy/ says (`checkoutcache tokens --secret NAME`); a
secret volume becomes a host directory with a file per item, root's, with its
defaultMode, mounted read-only. An emptyDir
becomes a podman volume prepared as the kubelet prepares one: root's, 0777
(with an fsGroup: that group, 02777); a persistentVolumeClaim a volume as a
new PersistentVolume usually starts, root's and 0755 (or a volume the test
gives, to outlive the pod); a volume mounted at /tmp a tmpfs. An init
container without restartPolicy Always runs to its end (`run_init`) before
the test starts the others. A field this module does not translate fails the
test: the manifest cannot say more than what runs.

Where this machine differs from a cluster (and why): the pod's shared network
namespace is the host network (no CNI here; containers still have their own
PID namespaces), so the listening ports are replaced by free ones (the host
network is shared with the machine) and no NetworkPolicy applies; probes are
run by the test, by HTTP on 127.0.0.1, when it asks (`probe`); the allow-list
(`CHECKOUTCACHE_API_REPOS`, which the manifest says to edit) names the test's
repository; restarts are
`start()` after `stop()`; the test starts the containers (the sidecar first,
as a kubelet does) and may start more than one copy of a container, as
another uid; resource requests (cpu, ephemeral-storage) are not enforced.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import tempfile

from .containers import Container, Containers, podman
from .daemons import free_port

TRANSLATED = {"name", "image", "imagePullPolicy", "restartPolicy", "env", "ports", "startupProbe",
              "readinessProbe", "livenessProbe", "resources", "securityContext", "volumeMounts", "command"}
SECURITY_TRANSLATED = {"runAsUser", "runAsGroup", "runAsNonRoot", "allowPrivilegeEscalation",
                       "readOnlyRootFilesystem", "capabilities"}
PORT_SETTINGS = ("CHECKOUTCACHE_LISTEN", "CHECKOUTCACHE_HEALTH_LISTEN")


def podman_memory(quantity: str) -> str:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return f"{number}{unit[0].lower()}"


def shipped_secret(name: str = "checkoutcache-tokens") -> dict[str, str]:
    """The Secret as deploy/ says to make it (`checkoutcache tokens --secret NAME`): its keys."""
    done = subprocess.run([sys.executable, "-m", "checkoutcache", "tokens", "--secret", name], capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout)["stringData"]


class ManifestPod:
    def __init__(self, containers: Containers, spec: dict, secrets: dict[str, dict[str, str]] | None = None,
                 claims: dict[str, str] | None = None, where: str | None = None, repos: str | None = None):
        """secrets: Secret name -> its keys' values (default: each Secret the spec names, made as
        deploy/ says: shipped_secret); claims: persistentVolumeClaim name -> an existing podman
        volume (a cache that outlives a pod), a claim not given gets a new volume; where: a host
        directory for the secret volumes' files."""
        self.containers = containers
        self.spec = spec
        self.repos = repos  # CHECKOUTCACHE_API_REPOS as an operator edits it: the test's repositories
        names = {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        self.secrets = secrets if secrets is not None else {name: shipped_secret(name) for name in names}
        self.grace = int(spec.get("terminationGracePeriodSeconds", 30))
        self.fs_group = spec.get("securityContext", {}).get("fsGroup")
        self.volumes: dict[str, str | None] = {}  # pod volume name -> podman volume (None: a tmpfs)
        tmp_volumes = {m["name"] for c in self.all_containers() for m in c.get("volumeMounts", [])
                       if m["mountPath"] == "/tmp"}
        for volume in spec.get("volumes", []):
            name = volume["name"]
            if "secret" in volume:
                self.volumes[name] = self._secret_volume(name, volume["secret"], where)
                continue
            if "emptyDir" in volume:
                assert set(volume) == {"name", "emptyDir"}, volume
                self.volumes[name] = None if name in tmp_volumes else self._prepared("0:0", "0777")
            else:
                assert set(volume) == {"name", "persistentVolumeClaim"} and name not in tmp_volumes, volume
                claim = volume["persistentVolumeClaim"]["claimName"]
                given = (claims or {}).get(claim)
                self.volumes[name] = given if given is not None else self._prepared("0:0", "0755")
        # The ports serve listens on, replaced by free ones (shared host network).
        self.ports = {name: free_port() for name in PORT_SETTINGS}

    def _prepared(self, owner: str, mode: str) -> str:
        """A new podman volume whose root has this owner and mode (with the pod's fsGroup, the
        kubelet's SetVolumeOwnership: that group, setgid). Its first mount is this one, so podman
        copies nothing of the image's directory up into it."""
        volume = self.containers.volume()
        if self.fs_group is not None:
            owner, mode = f"0:{self.fs_group}", f"2{mode[-3:]}"
        podman("run", "--rm", "--user=0", "--no-healthcheck", "--entrypoint=sh", f"--volume={volume}:/v",
               self.containers.image, "-c", f"chown {owner} /v && chmod {mode} /v")
        return volume

    def _secret_volume(self, name: str, secret: dict, where: str | None) -> str:
        """A secret volume as the kubelet makes one: a file per item (key -> path) holding the
        key's value, root's, with defaultMode (0644 unless said); mounted read-only."""
        assert set(secret) <= {"secretName", "items", "defaultMode"}, secret
        values = self.secrets[secret["secretName"]]
        directory = tempfile.mkdtemp(prefix=f"secret-{name}-", dir=where)
        os.chmod(directory, 0o755)
        for item in secret.get("items") or [{"key": k, "path": k} for k in values]:
            assert set(item) == {"key", "path"} and "/" not in item["path"], item
            path = os.path.join(directory, item["path"])
            with open(path, "w") as handle:
                handle.write(values[item["key"]])
            os.chmod(path, secret.get("defaultMode", 0o644))
        return directory

    def all_containers(self) -> list[dict]:
        return self.spec.get("initContainers", []) + self.spec["containers"]

    def init_containers(self) -> list[str]:
        """The init containers that run to their end before the others (not native sidecars)."""
        return [c["name"] for c in self.spec.get("initContainers", []) if c.get("restartPolicy") != "Always"]

    def container_spec(self, name: str) -> dict:
        for container in self.all_containers():
            if container["name"] == name:
                return container
        raise KeyError(name)

    def env(self, container: dict) -> dict[str, str]:
        env = {}
        for item in container.get("env", []):
            if "valueFrom" in item:
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = self.secrets[ref["name"]][ref["key"]].strip()
            else:
                env[item["name"]] = str(item["value"])
        for setting in PORT_SETTINGS:
            if setting in env:
                host = env[setting].rpartition(":")[0]
                env[setting] = f"{host}:{self.ports[setting]}"
        if "CHECKOUTCACHE_API_REPOS" in env and self.repos is not None:
            env["CHECKOUTCACHE_API_REPOS"] = self.repos
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
        assert not set(security) - SECURITY_TRANSLATED, f"{name}: the test does not run {sorted(security)}"
        run_as_root = security["runAsUser"] == 0
        assert run_as_root or security.get("runAsNonRoot", True), name
        user = f"{uid if uid is not None else security['runAsUser']}:{security['runAsGroup']}"
        options = []
        if self.fs_group is not None:
            options.append(f"--group-add={self.fs_group}")
        if security.get("readOnlyRootFilesystem"):
            options.append("--read-only")
        capabilities = security.get("capabilities", {})
        assert set(capabilities) <= {"drop", "add"} and capabilities.get("drop") == ["ALL"], capabilities
        options.append("--cap-drop=all")
        options += [f"--cap-add={cap.lower()}" for cap in capabilities.get("add", [])]
        if security.get("allowPrivilegeEscalation") is False:
            options.append("--security-opt=no-new-privileges")
        memory = spec.get("resources", {}).get("limits", {}).get("memory")
        if memory:
            options.append(f"--memory={podman_memory(memory)}")
        volumes = {}
        for mount in spec.get("volumeMounts", []):
            assert set(mount) <= {"name", "mountPath", "readOnly"}, mount
            source = self.volumes[mount["name"]]
            if source is None:
                options.append(f"--tmpfs={mount['mountPath']}")
            else:
                volumes[source] = mount["mountPath"] + (":ro" if mount.get("readOnly") else "")
        secret_mounts = [m for m in spec.get("volumeMounts", []) if m["name"] in self.secret_volume_names()]
        assert all(m.get("readOnly") for m in secret_mounts), "the kubelet mounts secrets read-only"
        command = spec.get("command")
        entrypoint = json.dumps(command) if command else None
        return self.containers.run(name=as_name or name, user=user, env={**self.env(spec), **(env or {})},
                                   volumes=volumes, entrypoint=entrypoint, options=tuple(options),
                                   healthcheck=command is None)

    def run_init(self, name: str, timeout: float = 120) -> Container:
        """An init container (not a native sidecar), run to its end as the kubelet runs it before
        the pod's other containers; fails the test unless it exits 0."""
        container = self.run(name)
        code = podman("wait", container.name, timeout=timeout).stdout.strip()
        assert code == "0", f"{name} exited {code}:\n{container.logs()}"
        return container

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

    def secret_volume_names(self) -> set[str]:
        return {v["name"] for v in self.spec.get("volumes", []) if "secret" in v}

    def token(self, secret: str, key: str) -> str:
        """A Secret key's value as the pod's containers read it (a token: one line)."""
        return self.secrets[secret][key].strip()

    def tokens_file(self, secret: str = "checkoutcache-tokens") -> list[tuple[str, object]]:
        """The grants of the sidecar's tokens file (the Secret's `tokens` key)."""
        from checkoutcache.serve.policy import parse_tokens

        return list(parse_tokens(self.secrets[secret]["tokens"], "tokens"))

    def mountpoint(self, volume_name: str) -> str:
        """Where the host sees a pod volume (for checks after the fact)."""
        source = self.volumes[volume_name]
        return podman("volume", "inspect", "--format", "{{.Mountpoint}}", source).stdout.strip()

