"""Writable workspaces (issue 26 item 4): a review's own tree of a commit, made from
the shared objects, living and dying with its owner (SIGKILL included), counted by
gc, listed by status; through the CLI (`exec --writable`, `workspace`), the library
and the HTTP API's client, against real repositories and real processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from checkoutcache.cache import Cache
from checkoutcache.store.layout import WorkspacePaths, default_workspaces
from checkoutcache.workspaces import make_workspace

from .helpers.cli import run_cli, wait_ready
from .helpers.repos import git
from .helpers.serve import Serve
from .helpers.store import assert_checkout_matches, make_idle, settled
from .helpers.tree import walk
from .helpers.waiting import pid_alive, wait_until
from .test_read_only_reader import reader, snapshot_but_markers, through, writer  # noqa: F401 (a fixture)


def store_state(root: str) -> dict:
    """Every entry of the store with its mode, size, inode and mtime (markers' mtimes aside:
    a use is recorded there), to prove a workspace's git wrote nothing into it. A mirror
    pack's mtime aside too: git "freshens" (utime) the pack of an object it would write and
    finds there, which only the writer's own uid can (the test runs as it; a reader's
    read-only mount refuses it, test_exec_writable_through_a_read_only_mount...)."""
    state = {}
    for entry in walk(root):
        if entry.rel.endswith("checkoutcache-ready") or "/locks/" in entry.rel or entry.rel.startswith("workspaces") \
                or entry.rel.startswith("holds"):  # a hold registered while the copy is made (store/holds.py)
            continue
        info = os.lstat(entry.path)
        freshened = "/mirror.git/objects/pack/" in entry.rel and entry.rel.endswith(".pack")
        state[entry.rel] = (info.st_mode, info.st_size, info.st_ino, None if freshened else info.st_mtime_ns)
    return state


def workspaces_of(root: str) -> list[str]:
    base = os.path.join(root, "workspaces")
    return sorted(os.listdir(base)) if os.path.isdir(base) else []


def test_exec_writable_runs_in_its_own_tree_commits_there_and_removes_it(root, upstream, tmp_path):
    sha = upstream.shas[-1]
    checkout = wait_ready(root, upstream.path, sha)["path"]
    settled(root)  # the worker's own tidying after its publish is not the command's write
    before = store_state(root)
    script = tmp_path / "review.sh"
    script.write_text(
        "set -e\n"
        "pwd > \"$OUT/pwd\"\n"
        "git status --porcelain > \"$OUT/status\"\n"
        "git config --get lfs.storage > \"$OUT/lfs\"\n"
        "echo patched >> README.md\n"
        "echo new > built.txt\n"
        "git -c user.name=r -c user.email=r@example.invalid commit -qam patched\n"
        "git log --format=%H > \"$OUT/log\"\n"
        "exit 7\n")
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run_cli("exec", "--writable", upstream.path, sha, "--", "sh", str(script), root=root,
                           env={"OUT": str(out)})
    assert code == 7, err  # the command's status passed through
    ran_in = (out / "pwd").read_text().strip()
    assert ran_in.startswith(os.path.join(root, "workspaces") + "/") and ran_in != checkout
    assert (out / "status").read_text() == "", "the copy is clean for git as made"
    assert (out / "lfs").read_text().strip() == os.path.join(ran_in, ".git", "lfs")
    log = (out / "log").read_text().split()
    assert log[1] == sha and len(log) == len(upstream.shas) + 1  # a commit of its own on the commit's history
    assert not os.path.exists(ran_in) and workspaces_of(root) == [], "removed once the command ended"
    assert store_state(root) == before, "nothing in the store was written"
    assert_checkout_matches(checkout, upstream.path, sha)
    assert not os.path.exists(os.path.join(checkout, "built.txt"))


def test_exec_writable_of_a_commit_that_cannot_be_made_runs_nothing(root, upstream, tmp_path):
    code, _, err = run_cli("exec", "--writable", "--wait", "30", upstream.path, "0" * 40, "--",
                           "touch", str(tmp_path / "ran"), root=root)
    assert code == 125 and "UNKNOWN_COMMIT" in err
    assert not (tmp_path / "ran").exists() and workspaces_of(root) == []


def start_owner() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "1000"])


@pytest.mark.slow
def test_a_workspace_lives_as_long_as_its_owner_and_goes_when_it_is_killed(root, upstream):
    sha = upstream.shas[0]
    owner = start_owner()
    try:
        code, made, err = run_cli("workspace", "create", "--owner-pid", str(owner.pid), upstream.path, sha,
                                  root=root)
        assert code == 0, err
        path, keeper = made["path"], made["keeper"]
        assert made["owner_pid"] == owner.pid and pid_alive(keeper)
        assert git("status", "--porcelain", cwd=path) == ""
        assert git("rev-parse", "HEAD", cwd=path) == sha
        assert_checkout_matches(made["source"], upstream.path, sha)
        code, status, _ = run_cli("status", root=root)
        assert [(w["path"], w["alive"], w["pid"]) for w in status["workspaces"]["workspaces"]] == \
            [(path, True, keeper)]
        assert status["totals"]["workspaces"] == 1
        # gc cannot take it, nor the checkout it was made from (the keeper holds it).
        make_idle(made["source"], 3600)
        code, report, _ = run_cli("gc", "--max-checkouts", "0", "--grace", "0", root=root)
        assert code == 0 and [k["why"] for k in report["kept_over_limit"]] == ["held"], report
        assert report["workspaces"]["live"] == 1 and os.path.isdir(path)
    finally:
        owner.kill()
        assert owner.wait(10) == -signal.SIGKILL  # the kill happened
    wait_until(lambda: not os.path.exists(path), 30, "the keeper to remove the workspace")
    wait_until(lambda: not pid_alive(keeper), 30, "the keeper to exit")
    assert workspaces_of(root) == []


@pytest.mark.slow
def test_workspace_remove_asks_the_keeper_and_bad_paths_are_refused(root, upstream, tmp_path):
    sha = upstream.shas[0]
    owner = start_owner()
    try:
        code, made, err = run_cli("workspace", "create", "--owner-pid", str(owner.pid), upstream.path, sha,
                                  root=root)
        assert code == 0, err
        for wrong in (str(tmp_path), "/etc", os.path.dirname(made["source"])):
            code, answer, _ = run_cli("workspace", "remove", wrong, root=root)
            assert code == 2 and answer["error"] == "UNKNOWN_WORKSPACE", answer
        assert os.path.isdir(made["path"])
        code, answer, err = run_cli("workspace", "remove", made["path"], root=root)
        assert code == 0 and answer["done"] and answer["by"] == "keeper", (answer, err)
        assert not os.path.exists(made["path"])
        wait_until(lambda: not pid_alive(made["keeper"]), 30, "the keeper to exit")
    finally:
        owner.kill()
        owner.wait(10)


def test_a_bad_owner_or_directory_is_bad_argument_and_writes_nothing(root, upstream, tmp_path):
    sha = upstream.shas[0]
    wait_ready(root, upstream.path, sha)
    dead = subprocess.Popen(["true"])
    dead.wait()
    code, answer, _ = run_cli("workspace", "create", "--owner-pid", str(dead.pid), upstream.path, sha, root=root)
    assert code == 2 and answer["error"] == "BAD_ARGUMENT", answer
    code, answer, _ = run_cli("workspace", "create", upstream.path, sha, root=root,
                              env={"CHECKOUTCACHE_WORKSPACES": "relative/dir"})
    assert code == 2 and answer["error"] == "BAD_ARGUMENT", answer
    assert workspaces_of(root) == [] and not os.path.exists("relative")


@pytest.mark.slow
def test_a_killed_keeper_leaves_a_dead_workspace_the_next_workspace_call_reaps(root, upstream):
    sha = upstream.shas[0]
    owner = start_owner()
    try:
        code, made, err = run_cli("workspace", "create", "--owner-pid", str(owner.pid), upstream.path, sha,
                                  root=root)
        assert code == 0, err
        os.kill(made["keeper"], signal.SIGKILL)
        wait_until(lambda: not pid_alive(made["keeper"]), 30, "the keeper to die")  # the kill happened
        assert os.path.isdir(made["path"]), "a killed keeper cannot clean up"
        code, listed, _ = run_cli("workspace", "list", root=root)
        assert [(w["path"], w["alive"]) for w in listed["workspaces"]] == [(made["path"], False)]
        code, second, err = run_cli("workspace", "create", "--owner-pid", str(owner.pid), upstream.path, sha,
                                    root=root)
        assert code == 0, err
        assert not os.path.exists(made["path"]), "reaped by the next workspace call"
        assert os.path.isdir(second["path"])
    finally:
        owner.kill()
        owner.wait(10)
    wait_until(lambda: workspaces_of(root) == [], 30, "the second keeper to clean up")


LIBRARY_OWNER = """
import sys, time
from checkoutcache.cache import Cache
from checkoutcache.workspaces import make_workspace
made = make_workspace(Cache(sys.argv[1]), sys.argv[2], sys.argv[3], wait=60)
assert made.made, made.answer
print(made.path, flush=True)
time.sleep(1000)
"""


@pytest.mark.slow
def test_a_library_owner_killed_by_sigkill_leaves_a_workspace_gc_reaps(root, upstream):
    sha = upstream.shas[0]
    proc = subprocess.Popen([sys.executable, "-c", LIBRARY_OWNER, root, upstream.path, sha],
                            stdout=subprocess.PIPE, text=True)
    try:
        path = proc.stdout.readline().strip()
        assert os.path.isdir(path) and git("rev-parse", "HEAD", cwd=path) == sha
        code, report, _ = run_cli("gc", root=root)
        assert code == 0 and report["workspaces"]["live"] == 1 and os.path.isdir(path), "a live one stays"
    finally:
        proc.kill()
        assert proc.wait(10) == -signal.SIGKILL  # the kill happened
    code, report, _ = run_cli("gc", root=root)
    assert code == 0, report
    assert [r["reason"] for r in report["removed"]] == ["dead-workspace"], report
    assert report["workspaces"]["live"] == 0
    assert not os.path.exists(path) and workspaces_of(root) == []


@pytest.mark.slow
def test_gc_counts_live_workspaces_against_max_bytes_and_evicts_checkouts_for_them(root, upstream, monkeypatch):
    first, second = upstream.shas[0], upstream.shas[1]
    paths = {sha: wait_ready(root, upstream.path, sha)["path"] for sha in (first, second)}
    sizes = {c["commit"]: c["size"] for r in run_cli("status", root=root)[1]["repos"] for c in r["checkouts"]}
    limit = f"{sizes[first] + sizes[second]}B"
    for path in paths.values():
        make_idle(path, 3600)
    code, report, _ = run_cli("gc", "--max-bytes", limit, "--grace", "0", "--dry-run", root=root)
    assert code == 0 and report["removed"] == [], "within the limit without a workspace"
    monkeypatch.setenv("CHECKOUTCACHE_ROOT", root)
    with make_workspace(Cache(root), upstream.path, first) as made:
        assert made.made, made.answer
        make_idle(paths[first], 3600)
        code, report, _ = run_cli("gc", "--max-bytes", limit, "--grace", "0", root=root)
        assert code == 0, report
        assert report["workspaces"]["live"] == 1 and report["workspaces"]["bytes"] > 0
        assert [(r["name"], r["limit"]) for r in report["removed"]] == [(second, "max-bytes")], report
        assert os.path.isdir(made.path) and os.path.isdir(paths[first]), "the workspace and its source stay"
        assert not os.path.exists(paths[second])
    assert workspaces_of(root) == []


def test_the_client_makes_a_workspace_on_its_side_and_the_api_lists_it(root, upstream, tmp_path):
    sha = upstream.shas[-1]
    serve = Serve(root, tmp_path, "--allow-local")
    try:
        client = serve.client()
        with client.workspace(upstream.path, sha, wait=60) as made:
            assert made.made and made.path.startswith(os.path.join(root, "workspaces"))
            with open(os.path.join(made.path, "new.txt"), "w") as handle:
                handle.write("mine\n")
            git("add", "new.txt", cwd=made.path)
            git("commit", "-qm", "mine", cwd=made.path)
            assert git("rev-parse", "HEAD~1", cwd=made.path) == sha
            listed = client.workspaces()
            assert [(w["path"], w["alive"], w["commit"]) for w in listed["workspaces"]] == [(made.path, True, sha)]
            status = client.status()
            assert status.totals.workspaces == 1 and status.workspaces["workspaces"][0]["path"] == made.path
            assert_checkout_matches(made.source, upstream.path, sha)
        assert client.workspaces()["workspaces"] == [] and workspaces_of(root) == []
        client.close()
    finally:
        serve.stop()


def test_without_a_writable_root_workspaces_go_to_the_users_cache(tmp_path):
    root = str(tmp_path / "root")
    assert default_workspaces(root, True) == os.path.join(root, "workspaces")
    assert default_workspaces(root, False, {"XDG_CACHE_HOME": str(tmp_path / "c")}) == \
        os.path.realpath(str(tmp_path / "c" / "checkoutcache-workspaces"))
    assert WorkspacePaths(root).tree(os.path.join(root, "ws-1-abcdefabcdef")).endswith("/ws-1-abcdefabcdef/tree")


def test_a_shell_that_asks_in_command_substitution_owns_the_workspace(root, upstream, tmp_path):
    """The default owner is the command's caller: `WS=$(checkoutcache workspace create --path ...)`
    returns at once (the keeper leaves the pipe) and the workspace lives as long as that shell."""
    sha = upstream.shas[0]
    wait_ready(root, upstream.path, sha)
    out = tmp_path / "ws"
    script = (f'WS=$("{sys.executable}" -m checkoutcache --root "{root}" workspace create --path '
              f'"{upstream.path}" {sha}) && git -C "$WS" status --porcelain && echo "$WS" > "{out}" && exec sleep 1000')
    shell = subprocess.Popen(["sh", "-c", script])
    try:
        wait_until(lambda: out.exists() and out.read_text().strip(), 60, "the shell to get its workspace")
        path = out.read_text().strip()
        assert os.path.isdir(path) and git("rev-parse", "HEAD", cwd=path) == sha
        listed = run_cli("workspace", "list", root=root)[1]["workspaces"]
        assert [(w["path"], w["alive"], w["owner_pid"]) for w in listed] == [(path, True, shell.pid)]
    finally:
        shell.kill()
        assert shell.wait(10) == -signal.SIGKILL  # the kill happened
    wait_until(lambda: not os.path.exists(path), 30, "the keeper to remove the workspace")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a read-only view of the root needs root (CI runs as root) and unshare")
def test_exec_writable_through_a_read_only_mount_writes_only_the_readers_own_directory(writer, served_upstream,
                                                                                       tmp_path):
    """The one-writer topology: the review sees the root read-only; its workspace goes to
    its own directory (the default when it may not write the root), and the store is
    unchanged but for the uses the writer records."""
    upstream, url = served_upstream
    sha = upstream.shas[0]
    status, body = writer.request("POST", "/v1/ensure", {"repo": url, "commit": sha, "wait": 60})
    assert status == 200, body
    settled(writer.root)
    before = snapshot_but_markers(writer.root)
    out = tmp_path / "pwd"
    code, _, err = reader(writer.root, "exec", "--writable", url, sha, "--", "sh", "-c",
                          f'pwd > "{out}" && echo patched >> README.md && '
                          f'git -c user.name=r -c user.email=r@example.invalid commit -qam patched', env=through(writer))
    assert code == 0, err
    ran_in = out.read_text().strip()
    assert ran_in.startswith(os.path.join(os.environ["XDG_CACHE_HOME"], "checkoutcache-workspaces") + "/"), ran_in
    assert not os.path.exists(ran_in), "removed once the command ended"
    assert snapshot_but_markers(writer.root) == before


@pytest.mark.slow
def test_a_killed_exec_writable_leaves_the_workspace_to_its_command_then_gc_reaps_it(root, upstream, tmp_path):
    """The command inherits the workspace's owner lock: SIGKILL of `exec --writable` leaves the
    workspace exactly as long as its command runs; then it is dead and gc reaps it."""
    sha = upstream.shas[0]
    wait_ready(root, upstream.path, sha)
    out, pid_file = tmp_path / "pwd", tmp_path / "pid"
    wrapper = subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", root, "exec", "--writable",
                                upstream.path, sha, "--", "sh", "-c",
                                f'pwd > "{out}" && echo $$ > "{pid_file}" && exec sleep 1000'])
    command = None
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 60, "the command to run")
        command = int(pid_file.read_text())
        path = out.read_text().strip()
        wrapper.kill()
        assert wrapper.wait(10) == -signal.SIGKILL  # the kill happened
        code, report, _ = run_cli("gc", root=root)
        assert code == 0 and report["workspaces"]["live"] == 1 and os.path.isdir(path), report
    finally:
        if command is not None:
            os.kill(command, signal.SIGKILL)
        wrapper.kill()
        wrapper.wait(10)
    wait_until(lambda: not pid_alive(command), 30, "the command to die")
    code, report, _ = run_cli("gc", root=root)
    assert [r["reason"] for r in report["removed"]] == ["dead-workspace"], report
    assert not os.path.exists(path) and workspaces_of(root) == []


def test_a_peers_symlinked_git_config_in_a_checkout_is_never_written_through(root, upstream, tmp_path):
    """Regression (issue 26 adversarial review): in the trusted-peers mode a peer may write a
    published checkout; it swapped the checkout's .git/config for a symlink to a file of
    another user's, and that user's `exec --writable` appended the workspace's settings to it
    (the copy keeps the symlink; make_own opened it by name, following it)."""
    shared = {"CHECKOUTCACHE_SHARING": "group"}
    sha = upstream.shas[-1]
    checkout = wait_ready(root, upstream.path, sha, env=shared)["path"]
    victim = tmp_path / "victims.gitconfig"
    victim.write_text("[user]\n\tname = victim\n")
    config = os.path.join(checkout, ".git", "config")
    victim_copy = open(config).read()
    os.unlink(config)
    os.symlink(str(victim), config)
    ran = tmp_path / "ran"
    code, _, err = run_cli("exec", "--writable", upstream.path, sha, "--", "touch", str(ran), root=root,
                           env=shared)
    assert victim.read_text() == "[user]\n\tname = victim\n", "written through the peer's symlink"
    assert code == 125 and "WORKSPACE_FAILED" in err, err
    assert not ran.exists() and [n for n in workspaces_of(root) if not n.startswith(".")] == []
    assert victim_copy  # (the checkout had a config of its own before the swap)


def test_workspace_remove_signals_only_the_keeper_that_holds_the_workspace(root, upstream):
    """Regression (issue 26 adversarial review): `workspace remove` sent SIGTERM to whatever pid
    owner.json named once that pid's start time matched. In the trusted-peers mode the record
    is a group-writable file in a group-writable directory: a peer rewrote it to name a process
    of the remover's uid (root's, if root removes), and that process was killed."""
    shared = {"CHECKOUTCACHE_SHARING": "group"}
    sha = upstream.shas[0]
    owner, bystander = start_owner(), start_owner()
    try:
        code, made, err = run_cli("workspace", "create", "--owner-pid", str(owner.pid), upstream.path, sha,
                                  root=root, env=shared)
        assert code == 0, err
        record_path = os.path.join(made["path"], "..", "owner.json")
        assert os.stat(record_path).st_mode & 0o020, "the record is the group's to write in this mode"
        with open(record_path) as handle:
            record = json.load(handle)
        from checkoutcache.store.liveness import process_start_time
        record.update(pid=bystander.pid, start_time=process_start_time(bystander.pid), keeper=True)
        with open(record_path, "w") as handle:
            json.dump(record, handle)
        code, answer, err = run_cli("workspace", "remove", made["path"], root=root, env=shared)
        assert bystander.poll() is None, "a process that is not the keeper was signalled"
        assert code != 0 and answer["error"] == "WORKSPACE_OWNED", (answer, err)
        assert os.path.isdir(made["path"]) and pid_alive(made["keeper"])
    finally:
        owner.kill()
        bystander.kill()
        owner.wait(10)
        bystander.wait(10)
    wait_until(lambda: not os.path.exists(made["path"]), 30, "the keeper to remove the workspace")


def test_the_client_copies_only_the_stores_checkout_of_the_commit_a_server_answers(root, upstream, tmp_path):
    """A sidecar (or whatever listens at the client's URL) answers a path: the client copies it
    into a workspace only when it is shaped as the store's checkout of the very commit asked
    for. A directory elsewhere, even one with a ready marker, is refused and nothing is written."""
    import http.server
    import threading

    from checkoutcache.client import Client, HoldFailed, NotTheWriter

    sha = upstream.shas[-1]
    secret = tmp_path / "home" / "secrets"
    (secret / ".git").mkdir(parents=True)
    (secret / "id_rsa").write_text("not for a workspace\n")
    real = wait_ready(root, upstream.path, sha)["path"]
    shutil.copy(os.path.join(real, ".git", "checkoutcache-ready"), secret / ".git" / "checkoutcache-ready")
    lying = [str(secret), real.replace(sha, upstream.shas[0]), real + "/../" + os.path.basename(real)]
    answers = iter(lying)
    released = []

    class Lying(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.path == "/v1/release":
                released.append(1)
                body = {}
            else:
                body = {"state": "ready", "path": next(answers), "commit": sha, "repo": upstream.path,
                        "hold": "h-1", "expires_in": 60}
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    def home() -> list[tuple]:  # what was written there (a look may move an atime)
        return sorted((e.rel, e.info.st_mode, e.info.st_size, e.info.st_mtime_ns) for e in walk(str(tmp_path / "home")))

    before = home()
    assert len(before) == 4
    try:
        # With a token, no answer it cannot prove is taken at all (signing.py): not even the hold.
        signed = Client(f"http://127.0.0.1:{server.server_address[1]}", token="t" * 32, root=root)
        with pytest.raises(NotTheWriter):
            signed.workspace(upstream.path, sha, wait=5)
        signed.close()
        answers = iter(lying)
        # Without one (a socket's caller), each path is checked against this root's own checkout.
        client = Client(f"http://127.0.0.1:{server.server_address[1]}", root=root)
        for path in lying:
            with pytest.raises(HoldFailed) as refused:
                client.workspace(upstream.path, sha, wait=5)
            assert refused.value.answer.error == "NO_WRITER", refused.value.answer
            assert "not this root's checkout" in refused.value.answer.message, refused.value.answer
        client.close()
    finally:
        server.shutdown()
    assert len(released) == len(lying), "each hold was given back"
    assert home() == before, "nothing written beside the path it was given"
    assert not os.path.exists(os.path.join(root, "workspaces")) or os.listdir(os.path.join(root, "workspaces")) == []
