"""A hostile review, run inside a review container (`python3 -c SOURCE ROOT ...`,
standard library only): code under review that tries to change what other
reviews of the same store are answered with. For every path beneath each
ROOT (walked without following symlinks) it tries every way a process without
privileges changes a tree:

- a directory: create a file, a directory, a symlink to / and a hard link in
  it; rename and remove each of its entries; replace each entry with a symlink
  (to / and to ..); chmod and utime it;
- a file: open it for writing, appending and truncating; chmod, utime and
  truncate it; rename it and remove it;
- a checkout (a directory with .git): `git checkout`/`git commit`-like writes
  are the file writes above; also `git update-ref HEAD` and a hook planted in
  .git/hooks (the directory case).

It prints one JSON object: how many attempts it made, which succeeded (path,
action, nothing else: a success is what the test fails on), and the errors
seen (errno names, counted). It undoes nothing: a success is left in place,
for the test to see what it changed.
"""

import collections
import errno
import json
import os
import subprocess
import sys

attempts = 0
succeeded: list[dict] = []
errors: collections.Counter = collections.Counter()


def attempt(path: str, action: str, call) -> None:
    global attempts
    attempts += 1
    try:
        call()
    except OSError as exc:
        errors[errno.errorcode.get(exc.errno, str(exc.errno))] += 1
    else:
        succeeded.append({"path": path, "action": action})


def open_for(path: str, flags: int) -> None:
    os.close(os.open(path, flags | os.O_NOFOLLOW))


def on_directory(path: str, entries: list[str]) -> None:
    probe = os.path.join(path, ".hostile")
    attempt(path, "create file", lambda: open_for(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    attempt(path, "mkdir", lambda: os.mkdir(probe + "-dir"))
    attempt(path, "symlink to /", lambda: os.symlink("/", probe + "-link"))
    attempt(path, "chmod 0777", lambda: os.chmod(path, 0o777))
    attempt(path, "utime", lambda: os.utime(path, (0, 0)))
    for name in entries:
        entry = os.path.join(path, name)
        attempt(entry, "rename", lambda: os.rename(entry, entry + ".moved"))
        attempt(entry, "symlink over it (/)", lambda: os.symlink("/", entry))
        attempt(entry, "replace by a symlink to ..", lambda: (os.symlink("..", entry + ".l"),
                                                              os.replace(entry + ".l", entry)))
        if os.path.isdir(entry) and not os.path.islink(entry):
            attempt(entry, "rmdir", lambda: os.rmdir(entry))
        else:
            attempt(entry, "unlink", lambda: os.unlink(entry))
            attempt(entry, "hard link", lambda: os.link(entry, probe + "-hard", follow_symlinks=False))


def on_file(path: str) -> None:
    attempt(path, "open for writing", lambda: open_for(path, os.O_WRONLY))
    attempt(path, "open for appending", lambda: open_for(path, os.O_WRONLY | os.O_APPEND))
    attempt(path, "open truncating", lambda: open_for(path, os.O_WRONLY | os.O_TRUNC))
    attempt(path, "truncate", lambda: os.truncate(path, 0))
    attempt(path, "chmod 0666", lambda: os.chmod(path, 0o666, follow_symlinks=False)
            if not os.path.islink(path) else os.chmod(path, 0o666))
    attempt(path, "utime", lambda: os.utime(path, (0, 0), follow_symlinks=False))


def on_checkout(path: str) -> None:
    def git(*args: str) -> None:
        done = subprocess.run(["git", "-c", "safe.directory=*", "-C", path, *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(errno.EPERM, done.stderr.strip()[:200])

    attempt(path, "git update-ref HEAD", lambda: git("update-ref", "HEAD", "HEAD~1"))
    attempt(path, "git rm", lambda: git("rm", "-q", "-r", "--cached", "."))


def main() -> None:
    for root in sys.argv[1:]:
        for folder, dirs, files in os.walk(root):
            entries = dirs + files
            on_directory(folder, entries)
            for name in files:
                on_file(os.path.join(folder, name))
            if ".git" in dirs and os.path.basename(os.path.dirname(folder)) == "checkouts":
                on_checkout(folder)
    print(json.dumps({"attempts": attempts, "succeeded": succeeded, "errors": dict(errors)}))


if __name__ == "__main__":
    main()
