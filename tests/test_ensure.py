"""ensure through the CLI and the library against real repositories: states,
answers, the checkout's content, both transports."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from checkoutcache import Cache
from checkoutcache.answers import Answer

from .helpers import (
    assert_checkout_matches,
    git,
    marker,
    only_repo,
    run_cli,
    settled,
    wait_ready,
)


def test_cli_answers_cloning_then_ready_with_a_complete_checkout(root, served_upstream):
    upstream, url = served_upstream
    sha = upstream.shas[1]
    code, answer, _ = run_cli("ensure", url, sha, root=root)
    assert code == 75 and answer["state"] == "cloning"
    assert answer["commit"] == sha and answer["repo"] == url
    assert isinstance(answer["pid"], int) and answer["started_at"].endswith("Z")
    assert "progress" in answer

    answer = wait_ready(root, url, sha)
    # The first answer of a cold node: its history follows in the background (and may be there already).
    assert answer == {"state": "ready", "commit": sha, "repo": url, "path": answer["path"],
                      "history": answer["history"]} and answer["history"] in ("shallow", "complete")
    assert answer["path"] == only_repo(root).checkout(sha)
    assert_checkout_matches(answer["path"], upstream.path, sha)

    code, again, _ = run_cli("ensure", url, sha, root=root)
    assert code == 0 and {**again, "history": None} == {**answer, "history": None}


@pytest.mark.parametrize("transport", ["cli", "pygit2"])
def test_both_transports_make_the_same_checkout(root, served_upstream, transport):
    upstream, url = served_upstream
    env = {"CHECKOUTCACHE_TRANSPORT": transport}
    for sha in (upstream.shas[0], upstream.shas[2]):
        answer = wait_ready(root, url, sha, env=env)
        assert_checkout_matches(answer["path"], upstream.path, sha)
    log = open(only_repo(root).clone_log(sha)).read()
    assert f"({transport})" in log


def test_pygit2_transport_falls_back_to_all_refs_when_fetch_by_id_is_refused(root, served_upstream):
    # libgit2 speaks protocol v0, where git daemon refuses unadvertised ids:
    # the fallback (fetch all refs, then look again) must find an older commit.
    upstream, url = served_upstream
    sha = upstream.shas[0]
    answer = wait_ready(root, url, sha, env={"CHECKOUTCACHE_TRANSPORT": "pygit2"})
    assert_checkout_matches(answer["path"], upstream.path, sha)
    log = open(only_repo(root).clone_log(sha)).read()
    assert "fetching all refs" in log


def test_cli_fallback_when_server_refuses_ids(root, served_upstream, fake_git):
    # Force protocol v0 on the CLI path too: the same fallback must apply.
    upstream, url = served_upstream
    env = fake_git('case "$*" in *fetch*) set -- -c protocol.version=0 "$@";; esac')
    answer = wait_ready(root, url, upstream.shas[0], env=env)
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[0])


def test_second_commit_reuses_the_mirror_without_a_network_call(root, served_upstream, fake_git, tmp_path):
    upstream, url = served_upstream
    wait_ready(root, url, upstream.shas[2])  # the tip first (depth 1), then its whole history in the background
    settled(root)
    calls = tmp_path / "git-calls"
    env = fake_git(f'echo "$*" >> {calls}')
    answer = wait_ready(root, url, upstream.shas[0], env=env)
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[0])
    # The wrapper ran (so the absence of a fetch means something), and never for a fetch.
    assert calls.exists() and "fetch" not in calls.read_text()


def test_library_api_returns_attrs_answers(root, upstream):
    cache = Cache(root)
    sha = upstream.shas[0]
    first = cache.ensure(upstream.path, sha)
    assert isinstance(first, Answer) and first.state == "cloning"  # no wait: the clone has only just started
    ready = cache.ensure(upstream.path, sha, wait=60)
    assert ready.state == "ready" and ready.exit_code == 0
    assert_checkout_matches(ready.path, upstream.path, sha)
    assert cache.ensure(upstream.path, sha) == ready


def test_local_path_forms_share_one_store(root, upstream, tmp_path):
    sha = upstream.shas[0]
    cache = Cache(root)
    by_path = cache.ensure(upstream.path, sha, wait=60)
    by_url = cache.ensure("file://" + upstream.path, sha)
    link = tmp_path / "link"
    link.symlink_to(upstream.path)
    by_link = cache.ensure(str(link), sha)
    assert by_path.path == by_url.path == by_link.path
    assert by_url.state == by_link.state == "ready"


def test_scopes_never_share_a_checkout(root, upstream):
    cache = Cache(root)
    sha = upstream.shas[0]
    a = cache.ensure(upstream.path, sha, wait=60, scope="tenant-a")
    b = cache.ensure(upstream.path, sha, wait=60, scope="tenant-b")
    assert a.state == b.state == "ready" and a.path != b.path


def test_ready_answer_records_last_use(root, upstream):
    cache = Cache(root)
    sha = upstream.shas[0]
    ready = cache.ensure(upstream.path, sha, wait=60)
    os.utime(marker(ready.path), (1_000_000, 1_000_000))
    assert cache.ensure(upstream.path, sha).state == "ready"
    assert os.stat(marker(ready.path)).st_mtime > 1_000_000


def test_checkout_is_a_working_repository(root, upstream):
    ready = Cache(root).ensure(upstream.path, upstream.shas[2], wait=60, history="full")
    assert ready.history == "complete"
    assert git("diff", "--stat", upstream.shas[0], "HEAD", cwd=ready.path)
    assert len(git("log", "--format=%H", cwd=ready.path).split()) == 3
    assert git("config", "core.autocrlf", cwd=ready.path) == "false"


def test_human_output_on_a_terminal(root, upstream):
    # A pseudo-terminal on stdout: the short text form, not JSON.
    sha = upstream.shas[0]
    Cache(root).ensure(upstream.path, sha, wait=60)
    done = subprocess.run(["script", "-qec", f"{sys.executable} -m checkoutcache --root {root} ensure "
                                            f"{upstream.path} {sha}", "/dev/null"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert done.stdout.strip().startswith("ready ") and "{" not in done.stdout


def test_wait_shows_cloning_progress_then_ready(root, upstream):
    sha = upstream.shas[1]
    seen = []
    answer = Cache(root).ensure(upstream.path, sha, wait=60, on_progress=seen.append)
    assert answer.state == "ready"
    assert seen, "a wait on a fresh commit reports progress at least once"
    assert all(a.state == "cloning" and a.pid for a in seen), [a for a in seen if not (a.state == "cloning" and a.pid)]


def test_demo_runs_without_setup(tmp_path):
    code, _, out = run_cli("--json", "demo", "--no-keep", root=str(tmp_path / "demo-root"))
    assert code == 0
    steps = [line for line in out.splitlines() if line.startswith("{")]
    import json
    records = [json.loads(s) for s in steps]
    states = [r["answer"]["state"] for r in records if "answer" in r]
    assert states[-1] == "ready" and states[1] == "ready"
    assert records[-1]["step"] == "done" and not os.path.exists(records[-1]["directory"])  # --no-keep


@pytest.mark.parametrize("transport", ["cli", "pygit2"])
def test_a_callers_git_environment_cannot_redirect_git(root, served_upstream, tmp_path, transport):
    # A review tool may run us with GIT_DIR and friends set for its own repository.
    upstream, url = served_upstream
    decoy = tmp_path / "decoy"
    git("init", "-q", str(decoy))
    env = {"GIT_DIR": str(decoy / ".git"), "GIT_WORK_TREE": str(decoy), "GIT_INDEX_FILE": str(decoy / "idx"),
           "GIT_OBJECT_DIRECTORY": str(decoy / ".git" / "objects"),
           "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(decoy / ".git" / "objects"),
           "GIT_CONFIG_PARAMETERS": "'core.autocrlf'='true'", "CHECKOUTCACHE_TRANSPORT": transport}
    answer = wait_ready(root, url, upstream.shas[1], env=env)
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[1])
    assert git("count-objects", cwd=str(decoy)).startswith("0 objects")
    assert not (decoy / "idx").exists()
