"""At the terminal: the progress bar in an 80-column pane, options where a person
types them, usage errors that show the usage, hints for repository arguments
that are almost right, gc and status on a root that is not there, the cause of
an unreachable repository, the demo's directory, shell completion. Real
processes on real terminals (a pty of a set size) and real repositories."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time

import pytest

from .helpers import run_cli, wait_until
from .helpers.gate import GatedProxy

SHA = "a" * 40


def on_a_terminal(args: list[str], columns: int = 80, env: dict | None = None, while_running=None,
                  timeout: float = 60) -> tuple[int, str]:
    """Run the CLI with stdin, stdout and stderr on a pty of `columns` columns; (exit code,
    everything it wrote). while_running(proc) runs once the process has started."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "checkoutcache", *args], stdin=slave, stdout=slave,
                            stderr=slave, env={**os.environ, **(env or {})}, close_fds=True)
    os.close(slave)
    chunks = []
    if while_running is not None:
        while_running(proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the process closed its side
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(10), b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.slow
def test_the_progress_bar_fits_an_80_column_pane_and_never_scrolls(root, daemon, served_upstream):
    """Regression: the bar was 94 columns wide and scrolled 215 lines in an 80-column pane."""
    repo, url = served_upstream
    proxy = GatedProxy(daemon.port)
    try:
        url = proxy.url(url.rsplit("/", 1)[1])
        assert run_cli("ensure", url, repo.shas[0], "--wait", "60", root=root)[0] == 0  # the mirror is made
        proxy.shut()

        def while_running(_proc) -> None:  # the clone waits at the gate while the bar is drawn
            wait_until(lambda: proxy.held, 30, "the fetch to reach the gate")
            time.sleep(1.0)
            proxy.open()

        new = repo.commit({"more.txt": "more\n"})
        code, out = on_a_terminal(["--root", root, "ensure", url, new, "--wait", "60"], 80,
                                  while_running=while_running)
    finally:
        proxy.close()
    assert code == 0, out
    drawn, _, answer = out.replace("\r\n", "\n").rpartition("\r")
    assert "\n" not in drawn, "the bar scrolled"
    segments = [s for s in drawn.split("\r") if s.strip()]
    assert segments and any(s.startswith("[") and "]" in s for s in segments), out[:500]
    assert max(len(s) for s in segments) <= 79, max(segments, key=len)
    assert answer.strip().startswith("ready "), answer


def test_the_bar_moves_through_gits_phases():
    from checkoutcache.cli.output import describe_progress, fraction

    steps = [{"phase": "remote: counting objects", "done": 5, "total": 10},
             {"phase": "remote: compressing objects", "done": 10, "total": 10},
             {"phase": "receiving objects", "objects": 50, "total_objects": 100},
             {"phase": "resolving deltas", "deltas": 2, "total_deltas": 2},
             {"phase": "checking out", "files": 10, "total_files": 10}]
    positions = [fraction(step) for step in steps]
    assert positions == sorted(positions) and 0 < positions[0] < positions[-1] == 1.0
    assert describe_progress(steps[0]) == "remote: counting objects 5/10"


@pytest.mark.slow
def test_json_and_root_are_taken_after_the_command_too(root, upstream):
    sha = upstream.shas[0]
    done = subprocess.run([sys.executable, "-m", "checkoutcache", "ensure", upstream.path, sha, "--wait", "60",
                           "--root", root, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["path"].startswith(root)
    for command in (["status"], ["gc", "--dry-run"]):
        done = subprocess.run([sys.executable, "-m", "checkoutcache", *command, "--root", root, "--json"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and json.loads(done.stdout), (command, done.stderr)
    # After `--`, they are exec's command's own arguments.
    done = subprocess.run([sys.executable, "-m", "checkoutcache", "exec", upstream.path, sha, "--root", root, "--",
                           "echo", "--json", "--root", "x"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "--json --root x", (done.stdout, done.stderr)


def test_a_usage_error_shows_the_usage_and_the_help_hint(root):
    code, out = on_a_terminal(["--root", root, "ensure", "only-one-argument"])
    assert code == 2
    assert "Usage: checkoutcache ensure [OPTIONS] REPO COMMIT" in out and "Try 'checkoutcache ensure --help'" in out, out
    code, answer, _ = run_cli("ensure", "x", root=root)  # a program gets the answer, the usage in `next`
    assert code == 2 and answer["error"] == "BAD_ARGUMENT" and answer["next"].startswith("Usage: "), answer


@pytest.mark.parametrize("repo,code,says", [
    ("github.com/org/repo", "BAD_REPO", "https://github.com/org/repo"),
    ("git@github.com/org/repo", "BAD_REPO", "git@github.com:org/repo"),
    ("htps://github.com/org/repo", "BAD_REPO", "did you mean https://"),
    ("http://github.com/org/repo", "UNSAFE_TRANSPORT", "'http'"),
])
def test_almost_right_repository_arguments_get_a_hint(root, repo, code, says):
    """Regression: a URL without its scheme was "not a git repository", and a typo in a scheme
    could not be told from a refused transport."""
    exit_code, answer, _ = run_cli("ensure", repo, SHA, root=root)
    assert exit_code == 2 and answer["error"] == code and says in answer["message"], answer
    assert not os.path.exists(root)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["gc"], ["status"]])
def test_gc_and_status_on_a_root_that_is_not_there_exit_2(tmp_path, command):
    """Regression: a misspelled CHECKOUTCACHE_ROOT made cron's gc a silent no-op, exit 0."""
    missing = str(tmp_path / "no-such-root")
    code, answer, _ = run_cli(*command, root=missing)
    assert code == 2 and answer["error"] == "ROOT_UNUSABLE" and "no such directory" in answer["message"], answer
    assert not os.path.exists(missing)
    code, answer, _ = run_cli(*command, env={"CHECKOUTCACHE_ROOT": missing})
    assert code == 2 and answer["error"] == "ROOT_UNUSABLE"


def test_an_unreachable_repository_says_why(root):
    """Regression: the message kept only git's last `fatal:` line, not the cause after it."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        code, answer, _ = run_cli("ensure", f"git://127.0.0.1:{port}/repo", SHA, "--wait", "30", root=root)
    assert code == 1 and answer["error"] == "UNREACHABLE" and "Connection refused" in answer["message"], answer


@pytest.mark.slow
def test_the_demo_says_where_its_directory_was_and_removes_it_unless_kept(tmp_path):
    done = subprocess.run([sys.executable, "-m", "checkoutcache", "demo"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    last = json.loads(done.stdout.splitlines()[-1])
    assert last["step"] == "done" and last["kept"] is False and not os.path.exists(last["directory"])
    code, out = on_a_terminal(["demo", "--keep"], env={"TMPDIR": str(tmp_path)})
    assert code == 0, out
    kept = re.search(r"the demo's files are in ([^\s;]+)", out)
    assert kept and os.path.isdir(kept.group(1)), out


def test_shell_completion_completes_commands_and_options():
    env = {**os.environ, "_CHECKOUTCACHE_COMPLETE": "bash_complete", "COMP_WORDS": "checkoutcache en",
           "COMP_CWORD": "1"}
    done = subprocess.run([sys.executable, "-m", "checkoutcache"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert "ensure" in done.stdout, done.stdout + done.stderr
    source = subprocess.run([sys.executable, "-m", "checkoutcache"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "_CHECKOUTCACHE_COMPLETE": "bash_source"})
    assert "_checkoutcache_completion" in source.stdout


@pytest.mark.parametrize("command", [["verify"], ["bundle", "publish", "--to", "file:///nowhere"]])
def test_verify_and_publishing_every_repository_of_a_missing_root_exit_2(tmp_path, command):
    missing = str(tmp_path / "no-such-root")
    code, answer, _ = run_cli(*command, root=missing)
    assert code == 2 and answer["error"] == "ROOT_UNUSABLE", answer
    assert not os.path.exists(missing) and not os.path.exists("/nowhere")
