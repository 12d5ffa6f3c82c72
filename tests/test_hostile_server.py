"""A hostile server's output costs bounded log and memory: a git daemon whose
pack-objects floods `remote:` lines (and one endless line) on sideband 2."""

from __future__ import annotations

import os

import pytest

from checkoutcache.store.layout import CLONE_LOG_CAP, RootPaths

from .helpers import GitDaemon, Upstream, assert_checkout_matches, run_cli

FLOOD_BYTES = 24 << 20


@pytest.fixture
def flooding_daemon(tmp_path):
    hook = tmp_path / "flood-then-pack"
    hook.write_text("#!/bin/sh\n"
                    f"head -c {FLOOD_BYTES} /dev/zero | tr '\\0' 'x' | fold -w 120 >&2\n"
                    f"head -c {FLOOD_BYTES // 2} /dev/zero | tr '\\0' 'y' >&2\n"
                    'exec "$@"\n')
    hook.chmod(0o755)
    server_config = tmp_path / "server-gitconfig"
    server_config.write_text(f"[uploadpack]\n\tpackObjectsHook = {hook}\n")
    base = tmp_path / "served"
    base.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_GLOBAL=str(server_config), GIT_CONFIG_NOSYSTEM="1")
    served = GitDaemon(str(base), env=env)
    yield served
    served.stop()


@pytest.mark.slow
def test_a_flood_of_remote_output_is_capped_in_the_log(root, flooding_daemon):
    upstream = Upstream(os.path.join(flooding_daemon.base, "flood"))
    sha = upstream.standard_history()[0]
    url = flooding_daemon.url("flood")
    code, answer, err = run_cli("ensure", url, sha, "--wait", "120", root=root, timeout=180)
    assert code == 0, (answer, err)
    assert_checkout_matches(answer["path"], upstream.path, sha)
    (key,) = RootPaths(root).repo_keys()
    log = RootPaths(root).repo(key).clone_log(sha)
    size = os.path.getsize(log)
    assert size <= CLONE_LOG_CAP + 64 * 1024, f"the log grew to {size} bytes"
    text = open(log, errors="replace").read()
    assert "xxxxxxxx" in text, "the flood reached the worker"
    assert "later lines are dropped" in text and "published" in text.splitlines()[-1]
