"""Real git repositories made by the tests."""

from __future__ import annotations

import os
import subprocess

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Test", "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "Test", "GIT_COMMITTER_EMAIL": "test@example.invalid",
    "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent-home",
}


def git(*args: str, cwd: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_ENV)
    # safe.directory: checkouts made by another uid (tests/test_shared_uids.py) are inspected too.
    return subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=cwd, env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


class Upstream:
    """A repository with a few commits: nested files, an executable, a symlink, a binary file."""

    def __init__(self, path: str, init: bool = True):
        self.path = path
        self.shas: list[str] = []
        if init:
            git("init", "-q", "-b", "main", path)

    @classmethod
    def clone_of(cls, source: str, path: str) -> "Upstream":
        """A clone of another repository, to commit in without touching the source."""
        repo = cls(path, init=False)
        git("clone", "-q", source, path)
        return repo

    def commit(self, files: dict[str, bytes | str], message: str = "change",
               symlinks: dict[str, str] | None = None, executable: tuple[str, ...] = ()) -> str:
        for name, data in files.items():
            full = os.path.join(self.path, name)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as handle:
                handle.write(data.encode() if isinstance(data, str) else data)
            os.chmod(full, 0o755 if name in executable else 0o644)
        for name, target in (symlinks or {}).items():
            full = os.path.join(self.path, name)
            if os.path.lexists(full):
                os.unlink(full)
            os.symlink(target, full)
        git("add", "-A", cwd=self.path)
        git("commit", "-q", "--allow-empty", "-m", message, cwd=self.path)
        sha = git("rev-parse", "HEAD", cwd=self.path)
        self.shas.append(sha)
        return sha

    def standard_history(self, count: int = 3) -> list[str]:
        for number in range(count):
            self.commit({
                "README.md": f"# project\nversion {number}\n",
                f"src/module_{number}.py": f"VALUE = {number}\n",
                "src/deep/nested/file.txt": "x" * (100 + number),
                "bin/tool.sh": "#!/bin/sh\necho tool\n",
                "data/blob.bin": bytes(range(256)) * (number + 1),
            }, message=f"commit {number}", symlinks={"link-to-readme": "README.md"},
                executable=("bin/tool.sh",))
        return list(self.shas)
