"""Generate a reproducible test repository with git fast-import.

    python benchmarks/make_repo.py OUT [--commits 300] [--files 3000] [--file-size 8192]
                                       [--depth 4] [--changes 12] [--seed 1]

The defaults make a medium repository: thousands of files, tens of MB of
content, hundreds of commits of history. The same seed gives the same commits
(the same ids), so runs on different machines compare like with like.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys

WORDS = ("alpha beta gamma delta review commit branch merge tree blob cache mirror fetch "
         "checkout lock scratch evict grace limit worker clone ready failed absent").split()


def file_content(rng: random.Random, size: int) -> bytes:
    lines = []
    total = 0
    while total < size:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + f" {rng.getrandbits(32):08x}\n"
        lines.append(line)
        total += len(line)
    return "".join(lines).encode()


def file_paths(rng: random.Random, count: int, depth: int) -> list[str]:
    paths = set()
    while len(paths) < count:
        parts = [f"d{rng.randint(0, 9)}" for _ in range(rng.randint(0, depth))]
        paths.add("/".join(parts + [f"f{len(paths)}.{rng.choice(['py', 'txt', 'md', 'c'])}"]))
    return sorted(paths)


def generate(out: str, commits: int, files: int, file_size: int, depth: int, changes: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    subprocess.run(["git", "init", "-q", "-b", "main", out], check=True)
    paths = file_paths(rng, files, depth)
    proc = subprocess.Popen(["git", "fast-import", "--quiet", "--done"], cwd=out, stdin=subprocess.PIPE)
    write = proc.stdin.write
    when = 1_700_000_000
    for number in range(commits):
        touched = paths if number == 0 else rng.sample(paths, min(changes, len(paths)))
        message = f"commit {number}".encode()
        write(b"commit refs/heads/main\n")
        write(f"mark :{number + 1}\n".encode())
        write(f"committer Bench <bench@example.invalid> {when + number * 60} +0000\n".encode())
        write(b"data %d\n%s\n" % (len(message), message))
        if number:
            write(f"from :{number}\n".encode())
        for path in touched:
            data = file_content(rng, rng.randint(file_size // 2, file_size * 3 // 2))
            write(f"M 100644 inline {path}\n".encode())
            write(b"data %d\n%s\n" % (len(data), data))
    write(b"done\n")
    proc.stdin.close()
    if proc.wait() != 0:
        raise SystemExit("git fast-import failed")
    subprocess.run(["git", "checkout", "-q", "-f", "main"], cwd=out, check=True)
    shas = subprocess.run(["git", "rev-list", "--reverse", "main"], cwd=out, check=True, capture_output=True,
                          text=True).stdout.split()
    return shas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--commits", type=int, default=300)
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--file-size", type=int, default=8192)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--changes", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if os.path.exists(args.out):
        sys.exit(f"{args.out} exists")
    shas = generate(args.out, args.commits, args.files, args.file_size, args.depth, args.changes, args.seed)
    print(f"{len(shas)} commits, tip {shas[-1]}")


if __name__ == "__main__":
    main()
