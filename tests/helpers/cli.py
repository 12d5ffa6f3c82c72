"""The CLI run as a user runs it: a subprocess whose stdout is not a TTY (so JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_cli(*args: str, root: str | None = None, env: dict | None = None, timeout: float = 120,
            cwd: str | None = None) -> tuple[int, dict | None, str]:
    """Run the CLI; return (exit, json, stderr + stdout)."""
    cmd = [sys.executable, "-m", "checkoutcache"]
    if root is not None:
        cmd += ["--root", root]
    full_env = dict(os.environ)
    full_env.update(env or {})
    done = subprocess.run(cmd + list(args), capture_output=True, text=True, env=full_env, timeout=timeout,
                          cwd=cwd)
    try:
        parsed = json.loads(done.stdout) if done.stdout.strip() else None
    except ValueError:
        parsed = None
    return done.returncode, parsed, done.stderr + done.stdout


def wait_ready(root: str, repo: str, sha: str, timeout: float = 60, extra: tuple[str, ...] = (), **kw) -> dict:
    """ensure --wait, asserting the answer is ready; extra: more ensure options (--sparse DIR)."""
    code, answer, err = run_cli("ensure", repo, sha, "--wait", str(timeout), *extra, root=root, **kw)
    assert code == 0, (code, answer, err)
    return answer
