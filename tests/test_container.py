"""The container's parts that can be tested without a Docker engine: the
entrypoint's command line and environment, the health check, the Dockerfile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from .helpers import free_port

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
# A clean environment, but with the test's private TMPDIR and HOME (see conftest.private_dirs):
# serve's journal goes to TMPDIR.
def private_env() -> dict:
    return {name: os.environ[name] for name in ("PATH", "TMPDIR", "HOME", "XDG_CACHE_HOME")}


DOCKERFILE = open(os.path.join(os.path.dirname(__file__), "..", "Dockerfile")).read()


def run_entrypoint(tmp_path, env: dict, *args: str) -> str:
    fake = tmp_path / "fake-checkoutcache"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\necho "MAX=$CHECKOUTCACHE_MAX_CHECKOUTS"\n')
    fake.chmod(0o755)
    done = subprocess.run(["sh", os.path.join(SCRIPTS, "docker-entrypoint.sh"), *args],
                          env={**private_env(), "CHECKOUTCACHE_BIN": str(fake), **env},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_entrypoint_builds_the_serve_command_from_the_environment(tmp_path):
    out = run_entrypoint(tmp_path, {"CHECKOUTCACHE_ROOT": "/cache", "CHECKOUTCACHE_MAX_CHECKOUTS": "20",
                                    "CHECKOUTCACHE_GC_INTERVAL": "2m"}, "--grace", "10m").split("\n")
    assert out[:8] == ["--root", "/cache", "serve", "--gc-interval", "2m", "--listen", "127.0.0.1:8787", "--grace"]
    assert "MAX=20" in out
    out = run_entrypoint(tmp_path, {"CHECKOUTCACHE_ROOT": "/c", "CHECKOUTCACHE_UNIX_SOCKET": "/c/cc.sock"})
    assert "--unix\n/c/cc.sock" in out


def test_entrypoint_refuses_to_start_without_a_root(tmp_path):
    done = subprocess.run(["sh", os.path.join(SCRIPTS, "docker-entrypoint.sh")], env=private_env(),
                          capture_output=True, text=True)
    assert done.returncode != 0 and "CHECKOUTCACHE_ROOT" in done.stderr


def test_entrypoint_and_healthcheck_against_a_real_server(tmp_path):
    listen = f"127.0.0.1:{free_port()}"
    token_file = tmp_path / "checkoutcache-token"  # as the platform mounts a secret
    token_file.write_text("container-token-0123456789\n")
    env = {**private_env(), "CHECKOUTCACHE_ROOT": str(tmp_path / "cache"),
           "CHECKOUTCACHE_LISTEN": listen, "CHECKOUTCACHE_BIN": f"{sys.executable} -m checkoutcache",
           "CHECKOUTCACHE_API_TOKEN_FILE": str(token_file),
           "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..")}
    health = [sys.executable, os.path.join(SCRIPTS, "docker-healthcheck")]
    assert subprocess.run(health, env=env, capture_output=True).returncode == 1  # nothing listening yet
    server = subprocess.Popen(["sh", os.path.join(SCRIPTS, "docker-entrypoint.sh")], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(health, env=env, capture_output=True).returncode != 0:
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.2)
    finally:
        server.send_signal(signal.SIGTERM)  # exec'd: the signal reaches serve itself
        assert server.wait(30) == 0


def test_dockerfile_runs_serve_as_non_root_with_git_a_volume_and_a_healthcheck():
    assert "USER checkoutcache" in DOCKERFILE and "useradd" in DOCKERFILE
    assert "git" in DOCKERFILE and 'VOLUME ["/cache"]' in DOCKERFILE
    assert '"/src[s3]"' in DOCKERFILE  # s3:// bundle stores (boto3) work in the image
    assert "HEALTHCHECK" in DOCKERFILE and "docker-healthcheck" in DOCKERFILE
    assert 'ENTRYPOINT ["tini", "--", "docker-entrypoint.sh"]' in DOCKERFILE
    for name in ("docker-entrypoint.sh", "docker-healthcheck", "checkoutcache-gc-cron"):
        assert f"scripts/{name}" in DOCKERFILE and os.access(os.path.join(SCRIPTS, name), os.X_OK)


def test_the_container_refuses_tcp_without_a_token(tmp_path):
    env = {**private_env(), "CHECKOUTCACHE_ROOT": str(tmp_path / "cache"),
           "CHECKOUTCACHE_LISTEN": f"127.0.0.1:{free_port()}", "CHECKOUTCACHE_BIN": f"{sys.executable} -m checkoutcache",
           "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..")}
    done = subprocess.run(["sh", os.path.join(SCRIPTS, "docker-entrypoint.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "needs a bearer token" in done.stdout + done.stderr
