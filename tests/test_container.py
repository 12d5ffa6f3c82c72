"""The image's parts that can be tested without a container engine: the
entrypoint, the health check against a real serve in every listen form, the
cron script under cron's PATH, and the Dockerfile's promises. The image itself,
run by podman, is test_container_image.py and test_deployment.py."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .helpers import Serve, free_port, wait_ready

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DOCKERFILE = open(os.path.join(REPO, "Dockerfile")).read()
CRON_PATH = "/usr/bin:/bin"  # crontab(5): cron's default PATH


def private_env() -> dict:
    """A clean environment with the test's private TMPDIR and HOME (conftest.private_dirs)."""
    return {name: os.environ[name] for name in ("PATH", "TMPDIR", "HOME", "XDG_CACHE_HOME")}


def shim(directory, name: str = "checkoutcache", body: str | None = None) -> None:
    """A `checkoutcache` command in directory: this checkout's package (or body)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as handle:
        handle.write(body or f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m checkoutcache "$@"\n')
    os.chmod(path, 0o755)


@pytest.mark.parametrize("args,expected", [
    ((), ["serve"]),
    (("--grace", "10m"), ["serve", "--grace", "10m"]),
    (("status",), ["status"]),
    (("ensure", "https://example.com/r", "a" * 40), ["ensure", "https://example.com/r", "a" * 40]),
])
def test_the_entrypoint_runs_serve_or_the_command_given(tmp_path, args, expected):
    shim(tmp_path / "bin", body='#!/bin/sh\nprintf "%s\\n" "$@"\n')
    done = subprocess.run(["sh", os.path.join(SCRIPTS, "docker-entrypoint.sh"), *args],
                          env={**private_env(), "PATH": f"{tmp_path / 'bin'}:{CRON_PATH}"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == expected


def healthcheck(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, "docker-healthcheck")], env=env,
                          capture_output=True, text=True, timeout=30)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


FORMS = {
    "unix": lambda port, tmp: {"CHECKOUTCACHE_UNIX_SOCKET": str(tmp / "cc.sock")},
    ":port": lambda port, tmp: {"CHECKOUTCACHE_LISTEN": f":{port}"},
    "host:port": lambda port, tmp: {"CHECKOUTCACHE_LISTEN": f"127.0.0.1:{port}"},
    "[v6]:port": lambda port, tmp: {"CHECKOUTCACHE_LISTEN": f"[::1]:{port}"},
    "unix and tcp": lambda port, tmp: {"CHECKOUTCACHE_UNIX_SOCKET": str(tmp / "cc.sock"),
                                       "CHECKOUTCACHE_LISTEN": f"127.0.0.1:{port}"},
    "health port, wildcard": lambda port, tmp: {"CHECKOUTCACHE_LISTEN": f"127.0.0.1:{free_port()}",
                                                "CHECKOUTCACHE_HEALTH_LISTEN": f"0.0.0.0:{port}"},
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.slow
def test_the_healthcheck_finds_serve_in_every_listen_form(root, tmp_path, form):
    """Regression: docker-healthcheck reported unhealthy when CHECKOUTCACHE_LISTEN was `:PORT`."""
    if "v6" in form and not ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    settings = FORMS[form](free_port(), tmp_path)
    env = {**os.environ, "CHECKOUTCACHE_ROOT": root, "CHECKOUTCACHE_API_TOKEN": "health-token-0123456789", **settings}
    assert healthcheck(env).returncode == 1  # nothing serving yet
    running = Serve(root, tmp_path, listen=None, env=env, tokens="")
    try:
        done = healthcheck(env)
        assert done.returncode == 0, done.stderr
    finally:
        assert running.stop() == 0
    done = healthcheck(env)
    assert done.returncode == 1 and done.stderr.startswith("unhealthy: "), done.stderr


def test_the_gc_cron_script_works_under_crons_path(root, tmp_path, upstream):
    """Regression: the cron example failed with "checkoutcache: command not found" under cron's
    PATH. Installed as pip installs it, the command sits next to the script, not on that PATH."""
    wait_ready(root, upstream.path, upstream.shas[0])
    bindir = tmp_path / "venv-bin"
    shim(bindir)
    script = bindir / "checkoutcache-gc-cron"
    script.write_bytes(open(os.path.join(SCRIPTS, "checkoutcache-gc-cron"), "rb").read())
    script.chmod(0o755)
    log = tmp_path / "gc.log"
    cron_env = {"PATH": CRON_PATH, "HOME": os.environ["HOME"], "SHELL": "/bin/sh", "CHECKOUTCACHE_ROOT": root,
                "CHECKOUTCACHE_MAX_CHECKOUTS": "0", "CHECKOUTCACHE_GRACE": "0", "CHECKOUTCACHE_GC_LOG": str(log)}
    done = subprocess.run(["/bin/sh", "-c", str(script)], env=cron_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(log.read_text().splitlines()[-1])
    assert [r["reason"] for r in report["removed"]] == ["lru"]  # it ran gc with the environment's limits
    example = open(os.path.join(SCRIPTS, "crontab.example")).read()
    entries = [line.lstrip("# ") for line in example.splitlines()]
    commands = [line.split(None, 5)[5] for line in entries if re.match(r"[\d*]", line) and len(line.split()) > 5]
    assert commands and all(c.startswith("/") for c in commands), commands  # full paths: cron's PATH is short


def test_the_container_refuses_tcp_without_a_token(tmp_path):
    shim(tmp_path / "bin")
    env = {**private_env(), "PATH": f"{tmp_path / 'bin'}:{CRON_PATH}", "CHECKOUTCACHE_ROOT": str(tmp_path / "cache"),
           "CHECKOUTCACHE_LISTEN": f"127.0.0.1:{free_port()}"}
    done = subprocess.run(["sh", os.path.join(SCRIPTS, "docker-entrypoint.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "needs a bearer token" in done.stdout + done.stderr


def test_the_dockerfile_keeps_its_promises():
    assert "USER checkoutcache" in DOCKERFILE
    assert "--uid 10001 --gid 10001" in DOCKERFILE and "--gid 10001 checkoutcache" in DOCKERFILE
    # A new volume starts as the writer's alone; /workspaces is for any review uid (sticky).
    assert "chown checkoutcache:checkoutcache /cache && chmod 0755 /cache" in DOCKERFILE
    assert "mkdir /workspaces && chmod 1777 /workspaces" in DOCKERFILE
    assert "/nonexistent" not in DOCKERFILE and "--create-home" in DOCKERFILE
    assert 'VOLUME ["/cache"]' in DOCKERFILE and '"/src[s3]"' in DOCKERFILE
    assert "CHECKOUTCACHE_UNIX_SOCKET=/cache/checkoutcache.sock" in DOCKERFILE
    assert "HEALTHCHECK" in DOCKERFILE and "docker-healthcheck" in DOCKERFILE
    assert 'ENTRYPOINT ["tini", "--", "docker-entrypoint.sh"]' in DOCKERFILE
    for name in ("docker-entrypoint.sh", "docker-healthcheck", "checkoutcache-gc-cron"):
        assert f"scripts/{name}" in DOCKERFILE and os.access(os.path.join(SCRIPTS, name), os.X_OK)


def test_the_base_is_pinned_by_digest_and_the_image_carries_its_oci_labels():
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.MULTILINE).group(1)
    assert re.fullmatch(r"docker\.io/library/python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", base), base
    (from_line,) = re.findall(r"^FROM .*$", DOCKERFILE, re.MULTILINE)
    assert from_line == "FROM ${BASE_IMAGE}"
    labels = dict(re.findall(r'org\.opencontainers\.image\.(\w+)="([^"]*)"', DOCKERFILE))
    assert {"source", "version", "revision", "licenses"} <= set(labels), labels
    project = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]
    assert re.search(r"^ARG VERSION=(\S+)$", DOCKERFILE, re.MULTILINE).group(1) == project["version"]
    assert labels["licenses"] == project["license"]["text"]
    # Last: a new revision rebuilds no layer.
    assert DOCKERFILE.rindex("ARG REVISION") > DOCKERFILE.rindex("RUN ")


def constraints() -> dict[str, str]:
    pins = {}
    for line in open(os.path.join(REPO, "constraints.txt")):
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_every_dependency_is_pinned_and_the_image_installs_pyprojects_own():
    """The image installs pyproject's dependencies (at constraints.txt's versions) in a layer of
    their own, then the project with --no-deps (pip check in the build: nothing missing)."""
    project = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]
    pins = constraints()
    wanted = [*project["dependencies"], *project["optional-dependencies"]["s3"],
              *project["optional-dependencies"]["test"]]
    for text in wanted:
        requirement = Requirement(text)
        assert requirement.specifier.contains(pins[canonicalize_name(requirement.name)]), (text, pins.get(
            canonicalize_name(requirement.name)))
    assert '["dependencies"] + p["optional-dependencies"]["s3"]' in DOCKERFILE
    assert "-c /src/constraints.txt -r /src/requirements.txt" in DOCKERFILE
    assert '--no-deps "/src[s3]"' in DOCKERFILE and "pip check" in DOCKERFILE
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'" in ci
    assert "pip install -c constraints.txt -e '.[test]' && python -m pytest" in readme


def test_the_pinned_set_is_what_this_environment_runs():
    """CI installs with -c constraints.txt: every pinned distribution installed here has the pinned
    version (a machine that installed without it reports what differs)."""
    pins = constraints()
    differ = {}
    for name, version in pins.items():
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if found != version:
            differ[name] = (version, found)
    assert len(pins) > 20 and not differ, differ
