"""Real containers for tests: the project's image run by podman (with runc), as
the deployment runs it (a sidecar and review containers sharing a volume).

This module owns: whether podman can run the image on this machine (else the
reason to skip), building the image once per session, pytest-xdist's workers
included (a file lock; podman's layer cache makes a rebuild after a Python
change take seconds), and every container and
volume a test makes. A `Containers` removes all of them in `cleanup()`, which
the `containers` fixture calls even when the test fails; names carry this
process's pid, so tests of two sessions on one machine never meet.

Facts of this machine that shape it (see ../shared/tools/container-base):
- No registry: the Dockerfile's base image must already be in podman's store. The
  Dockerfile pins it by digest, which a local stand-in (container-base imports one
  under the tag) cannot have: the build then gives the tag as BASE_IMAGE (`base_for_build`).
- cgroups v1 and no raising of rlimits: runc, and no `--ulimit` (any fails).
- No systemd: the image's HEALTHCHECK never runs by itself (podman logs
  "unable to get systemd connection"); `healthcheck()` runs it as the engine
  does, as the container's user with its environment, and records the result.
- `podman exec` starts with umask 0022 whatever `--umask` the container got.
- Containers share the host network with everything else on the machine: a
  test listens on `free_port()`, never on a fixed port.
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
IMAGE = "localhost/checkoutcache:test"
SETUP_HINT = "run ../shared/tools/container-base once (podman, runc and the base image)"


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """podman ARGS, text output captured. Its temporary files go to /var/tmp, not to
    the test's private TMPDIR (conftest.private_dirs), which may go before podman is done."""
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TMPDIR": "/var/tmp"})
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done


def base_image(dockerfile: str = os.path.join(REPO_ROOT, "Dockerfile")) -> str:
    """The base the Dockerfile names: BASE_IMAGE's default (name:tag@sha256:digest)."""
    with open(dockerfile) as handle:
        return re.search(r"^ARG\s+BASE_IMAGE=(\S+)", handle.read(), re.MULTILINE).group(1)


@functools.cache
def base_for_build() -> str | None:
    """The base to build on: the pinned image if podman has it, else the same name and tag
    without the digest (the local stand-in), else None."""
    pinned = base_image()
    for candidate in (pinned, pinned.partition("@")[0]):
        if podman("image", "exists", candidate, check=False).returncode == 0:
            return candidate
    return None


def revision() -> str:
    """The commit the image is built from (its org.opencontainers.image.revision label)."""
    done = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


@functools.cache
def podman_unusable() -> str | None:
    """Why containers cannot run here (a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "container tests run podman as root (CI does)"
    if shutil.which("podman") is None:
        return f"podman is not installed: {SETUP_HINT}"
    base = base_for_build()
    if base is None:
        return f"the base image {base_image()} is not in podman's store and no registry is reachable: {SETUP_HINT}"
    done = podman("run", "--rm", "--network", "host", base, "true", check=False, timeout=60)
    if done.returncode != 0:
        return f"podman cannot run a container here: {(done.stderr or done.stdout).strip()[-300:]}"
    return None


# tag -> the commit the session's image was built from (its revision label): HEAD may move
# while the session runs (another merge), so a test compares the label with this, not HEAD.
BUILT_FROM: dict[str, str] = {}


@functools.cache
def build_image(tag: str = IMAGE, context: str = REPO_ROOT, once_in: str | None = None) -> str:
    """The image built from the work tree, once per session (layers cached across sessions); its tag.

    once_in: a directory every process of the test session shares (pytest-xdist's workers): the
    first to get its file lock builds, the others wait on the lock and take that build, so two
    workers never build the same tag at once."""
    if once_in is None:
        BUILT_FROM[tag] = _build(tag, context)
        return tag
    with open(os.path.join(once_in, "image.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even if the build fails
        built = os.path.join(once_in, "image.built")
        record = open(built).read().split(" ") if os.path.exists(built) else []
        if record[:2] != [tag, context]:
            record = [tag, context, _build(tag, context)]
            with open(built, "w") as handle:
                handle.write(" ".join(record))
        BUILT_FROM[tag] = record[2]
    return tag


def _build(tag: str, context: str) -> str:
    """Build; the commit built from."""
    # --format docker: the OCI format drops HEALTHCHECK (with a warning), and the two formats
    # do not share cached layers.
    # --label as well as the build argument: podman 4.3's buildah reuses a cached LABEL step
    # whose ARG value changed (its cache key is the unexpanded instruction), so an image built
    # after a commit would carry the previous commit's revision.
    commit = revision()
    podman("build", "--format", "docker", "--network", "host", f"--build-arg=BASE_IMAGE={base_for_build()}",
           f"--build-arg=REVISION={commit}", f"--label=org.opencontainers.image.revision={commit}",
           "-t", tag, context, timeout=900)
    return commit


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    state: str  # /proc/<pid>/stat's state letter: R, S, D, Z (zombie), ...
    name: str


@dataclass
class Container:
    name: str
    stop_took: float | None = field(default=None)

    def exec(self, *command: str, user: str | None = None, env: dict[str, str] | None = None,
             umask: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """COMMAND in the running container (as USER, e.g. "10002:999"); never raises on its exit code.
        umask: set it first (exec'd processes start with 0022, not the container's --umask)."""
        if umask is not None:
            command = ("sh", "-c", f'umask {umask} && exec "$@"', "sh", *command)
        options = [f"--user={user}"] if user else []
        options += [f"--env={k}={v}" for k, v in (env or {}).items()]
        return podman("exec", *options, self.name, *command, timeout=timeout, check=False)

    def healthcheck(self) -> bool:
        """The image's HEALTHCHECK run once as the engine runs it; the result is recorded
        in the container's health state (`health()`)."""
        return podman("healthcheck", "run", self.name, check=False, timeout=60).returncode == 0

    def health(self) -> str:
        """starting, healthy or unhealthy (failures count only after the start period)."""
        return self.inspect("{{.State.Health.Status}}")

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthcheck():
            if time.monotonic() > deadline or not self.running():
                raise AssertionError(f"{self.name} not healthy within {timeout}s:\n{self.logs()}")
            time.sleep(0.5)

    def stop(self, timeout: int = 10) -> float:
        """`podman stop -t TIMEOUT`: the stop signal (SIGTERM) to PID 1, SIGKILL after TIMEOUT
        seconds. Returns how long the stop took (also kept in stop_took)."""
        started = time.monotonic()
        podman("stop", "-t", str(timeout), self.name, timeout=timeout + 60)
        self.stop_took = time.monotonic() - started
        return self.stop_took

    def start(self) -> None:
        """Start the stopped container again (its volumes, environment and command kept), as a
        kubelet restarts a container."""
        podman("start", self.name, timeout=120)

    def processes(self) -> list[Process]:
        """Every process in the container's PID namespace, read from /proc (the image has no ps)."""
        done = self.exec("sh", "-c", "cat /proc/[0-9]*/stat 2>/dev/null", user="0")
        processes = []
        for line in done.stdout.splitlines():
            head, _, tail = line.rpartition(")")  # the name may hold spaces and parentheses
            pid, _, name = head.partition(" (")
            if tail.split():
                state, ppid = tail.split()[:2]
                processes.append(Process(int(pid), int(ppid), state, name))
        return processes

    def zombies(self) -> list[Process]:
        return [p for p in self.processes() if p.state == "Z"]

    def assert_no_zombie_stays(self, timeout: float = 15) -> None:
        """Every process is a zombie for a moment after it exits; one nobody reaps stays one
        (serve reaps its reparented workers within about a second and a half)."""
        deadline = time.monotonic() + timeout
        while zombies := self.zombies():
            if time.monotonic() > deadline:
                raise AssertionError(f"zombies in {self.name} for {timeout}s: {zombies}")
            time.sleep(0.2)

    def logs(self) -> str:
        done = podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def running(self) -> bool:
        return self.inspect("{{.State.Running}}") == "true"

    def exit_code(self) -> int:
        return int(self.inspect("{{.State.ExitCode}}"))

    def inspect(self, template: str) -> str:
        return podman("inspect", "--format", template, self.name).stdout.strip()


class Containers:
    """The containers and volumes of one test, all removed by cleanup()."""

    def __init__(self, image: str = IMAGE):
        self.image = image
        self.prefix = f"cctest-{os.getpid()}-{secrets.token_hex(3)}"
        self.names: list[str] = []
        self.volumes: list[str] = []

    def _name(self, name: str | None, kind: str) -> str:
        return f"{self.prefix}-{name or kind}-{len(self.names) + len(self.volumes)}"

    def volume(self, name: str | None = None, mode: str | None = None) -> str:
        """A new named volume. Podman chowns it to the image's /cache owner (10001 and the
        image's group) at its first mount, mode 0755; mode (e.g. "2775": group-writable,
        setgid) is applied as root first."""
        volume = self._name(name, "volume")
        podman("volume", "create", volume)
        self.volumes.append(volume)
        if mode is not None:
            podman("run", "--rm", "--user=0", "--no-healthcheck", "--entrypoint=chmod",
                   f"--volume={volume}:/cache", self.image, mode, "/cache")
        return volume

    def run(self, *command: str, name: str | None = None, user: str | None = None,
            env: dict[str, str] | None = None, volumes: dict[str, str] | None = None,
            network: str = "host", entrypoint: str | None = None, umask: str | None = None,
            init: bool = False, healthcheck: bool = True, options: tuple[str, ...] = ()) -> Container:
        """A detached container of the image (its own PID namespace): COMMAND goes after the
        entrypoint. volumes maps a volume name or host path to a path in the container;
        user is "UID:GID" (a bare uid unknown to the image gets gid 0, not the image's group)."""
        container = Container(self._name(name, "ctr"))
        self.names.append(container.name)
        args = ["run", "--detach", f"--name={container.name}", f"--network={network}"]
        args += [f"--user={user}"] if user else []
        args += [f"--env={k}={v}" for k, v in (env or {}).items()]
        args += [f"--volume={source}:{target}" for source, target in (volumes or {}).items()]
        args += [f"--entrypoint={entrypoint}"] if entrypoint else []
        args += [f"--umask={umask}"] if umask else []
        args += ["--init"] if init else []
        args += [] if healthcheck else ["--no-healthcheck"]
        podman(*args, *options, self.image, *command)
        return container

    def cleanup(self) -> None:
        """Remove every container (killed at once) and volume made, whatever state they are in."""
        if self.names:
            podman("rm", "--force", "--ignore", "--volumes", "--time=0", *self.names, check=False, timeout=120)
        if self.volumes:
            podman("volume", "rm", "--force", *self.volumes, check=False)
        self.names, self.volumes = [], []
