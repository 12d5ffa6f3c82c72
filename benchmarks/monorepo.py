"""A generated monorepo and the plain-git anchor for partial clones with sparse checkouts.

    python benchmarks/monorepo.py --quick [--json-out mono.json]      # ~5,000 files, 40 commits (seconds)
    python benchmarks/monorepo.py [--work DIR] [--keep] [--json-out mono.json]
        # 50,000 files (~200 MB tree), 200 commits of 300 changed files each (~1-2 min to generate)

The product's variants (measure_product: a full mirror, a partial mirror, a
partial mirror with a sparse checkout of the same cone), each a cold root,
measured through the CLI against the anchor below on the same repository,
daemon and proxy, in one run: ratios and the issue's bars (BARS), a chart
with --plot.

The repository (make_monorepo), deterministic from its seed (same seed and
shape, same commit ids): `git fast-import` is fed a tree of projects under
services/, libs/, apps/, tools/ and third_party/ (project sizes skewed, as in
real monorepos: a few big ones, many small ones), each project a tree of
directories a few levels deep, plus a few files at the root. File sizes are
log-normal (median ~2.5 KiB, mean ~4 KiB, at most 256 KiB). A file is a list
of lines drawn from a shared pool of generated code-like lines, so two
versions of one file share all but the lines an edit touched (git deltifies
them as it would real edits), while two different files share almost nothing.
Every commit after the first edits `changes` files picked uniformly over the
whole tree (a few lines replaced, inserted or deleted in each), adds a few
files and deletes one. A `git repack -a -d -F` then gives the upstream the
deltas a real server would have (fast-import's own pack deltifies blobs only
against the previous blob in its stream, so it writes them uncompressed and
undeltified first: the fastest way on 2 cores, ~45 s for the full shape).

Served by `git daemon` on 127.0.0.1 (a free port) with uploadpack.allowFilter
(serve), behind the counting TCP proxy of countingproxy.py, which counts what
the upstream sends per phase.

The anchor (measure_anchor): what plain git does for one sparse review of a
monorepo:
    git clone --filter=blob:none --no-checkout URL DIR
    git -C DIR sparse-checkout set --cone DIRS...     (cone_dirs: ~5% of the tree's bytes)
    git -C DIR checkout --detach FIRST
    git -C DIR checkout --detach SECOND               (a second commit of the same review)
each step timed and its upstream bytes, connections and objects counted; then
the disk of the clone (.git and work tree apart, allocated and apparent bytes)
and the size of the cone itself at the first commit.
"""

from __future__ import annotations

import argparse
import array
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from countingproxy import CountingProxy
from gitdaemon import GitDaemon


@dataclass(frozen=True)
class Shape:
    files: int = 50_000  # files in the first commit
    commits: int = 200
    changes: int = 300  # files edited by each commit after the first
    adds: int = 3  # files added by each commit after the first
    deletes: int = 1  # files deleted by each commit after the first
    mean_size: int = 4096  # bytes; log-normal, sigma 1 (median ~ mean / 1.65)
    projects: int = 100  # project directories under the top-level areas
    pool_lines: int = 200_000  # distinct lines the files are made of


SHAPES = {
    "full": Shape(),
    "quick": Shape(files=5_000, commits=40, changes=60, mean_size=2048, projects=30, pool_lines=50_000),
}
AREAS = (("services", 0.35), ("libs", 0.30), ("apps", 0.15), ("tools", 0.10), ("third_party", 0.10))
EXTENSIONS = {"services": ("go", "go", "proto", "yaml", "md"), "libs": ("py", "py", "py", "pyi", "md"),
              "apps": ("ts", "tsx", "ts", "css", "json"), "tools": ("sh", "py", "go", "md"),
              "third_party": ("c", "h", "c", "h", "txt")}
ROOT_FILES = ("README.md", "WORKSPACE", "BUILD.bazel", ".gitignore", ".editorconfig", "CODEOWNERS",
              "LICENSE", "Makefile")
SUBDIRS = ("src", "tests", "docs", "internal", "pkg", "proto", "testdata")
MAX_SIZE = 256 * 1024
LINE_BYTES = 51  # the pool's mean line length (about)
COMMITTER = b"Mono Bench <bench@example.invalid>"
EPOCH = 1_700_000_000
SYLLABLES = ["ka", "ri", "to", "mo", "na", "shi", "ve", "lo", "pa", "du", "re", "xi", "an", "el", "or", "us", "im",
             "ta", "co", "ge", "fu", "be", "ly", "ne", "zo", "qu", "st", "tr", "pl", "gr", "ch", "th", "br", "cl",
             "dr", "fl"]
KEYWORDS = ["def", "return", "if", "else", "for", "while", "import", "from", "class", "struct", "func", "var",
            "let", "const", "self", "nil", "None", "true", "false", "err", "ctx", "int", "str", "bytes", "list",
            "map", "void", "static", "public"]


@dataclass
class MonoRepo:
    """What make_monorepo made: a bare repository at `path` (its `main` at the last commit)."""

    path: str
    seed: int
    shape: Shape
    commits: list[str]  # oldest first
    projects: list[str]  # project directories, e.g. "services/svc007"
    files: int  # files at the tip
    tree_bytes: int  # bytes of the tip's tree (sum of blob sizes)
    pack_bytes: int  # the repository's packs on disk
    seconds: dict = field(default_factory=dict)  # generate, fast_import, repack

    def describe(self) -> dict:
        out = asdict(self)
        out["commits"] = {"count": len(self.commits), "first": self.commits[0], "tip": self.commits[-1]}
        out["projects"] = len(self.projects)
        return out


def _git(*args: str, cwd: str | None = None, env: dict | None = None, input: bytes | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, env=env if env is not None else clean_env(), input=input,
                          capture_output=True, check=check)


def clean_env(extra: dict | None = None) -> dict:
    """Our environment without any git configuration of the caller's (no ~/.gitconfig, no system
    config, no GIT_* variables), so the measurements do not depend on who runs them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # An installed package has its bytecode compiled (pip does it): a caller's
    # PYTHONDONTWRITEBYTECODE would make each run compile every module it changed anew.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C",
                "GIT_TERMINAL_PROMPT": "0"})
    env.update(extra or {})
    return env


# -- the repository ---------------------------------------------------------------------------

def _line_pool(rng: random.Random, count: int) -> list[bytes]:
    # Words Zipf-distributed over a small vocabulary, indentation and punctuation: zlib packs a
    # file about 3.5x, as it does real source code (~3-4.5x).
    vocab = sorted({"".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(1500)}) + KEYWORDS
    rng.shuffle(vocab)
    cum, total = [], 0.0
    for rank in range(len(vocab)):
        total += 1.0 / (rank + 1)
        cum.append(total)
    lengths = [rng.randint(2, 10) for _ in range(count)]
    words = rng.choices(vocab, cum_weights=cum, k=sum(lengths))
    indents = rng.choices((0, 4, 4, 8, 8, 12, 16), k=count)
    tails = rng.choices((b"\n", b"\n", b"\n", b":\n", b";\n", b" {\n", b")\n", b",\n"), k=count)
    pool, at = [], 0
    for i in range(count):
        text = " ".join(words[at:at + lengths[i]])
        at += lengths[i]
        if i % 8 == 0:  # an identifier or a number now and then
            text += f" = x{rng.getrandbits(16):04x}"
        pool.append(b" " * indents[i] + text.encode() + tails[i])
    return pool


def _project_layout(rng: random.Random, shape: Shape) -> tuple[list[str], list[float]]:
    """Project directories and their shares of the files (skewed: Zipf-like with exponent 0.8)."""
    projects = []
    for area, share in AREAS:
        prefix = {"services": "svc", "libs": "lib", "apps": "app", "tools": "tool", "third_party": "pkg"}[area]
        for n in range(max(1, round(shape.projects * share))):
            projects.append(f"{area}/{prefix}{n:03d}")
    weights = [1.0 / (rank + 1) ** 0.8 for rank in range(len(projects))]
    rng.shuffle(weights)  # big projects anywhere, not all in the first area
    total = sum(weights)
    return projects, [w / total for w in weights]


def _project_dirs(rng: random.Random, project: str, files: int) -> list[str]:
    dirs = [f"{project}/{sub}" for sub in rng.sample(SUBDIRS, k=min(len(SUBDIRS), rng.randint(2, 5)))]
    for _ in range(max(0, files // 12 - len(dirs))):  # ~12 files a directory
        parent = rng.choice(dirs)
        if parent.count("/") < 7:
            dirs.append(f"{parent}/{''.join(rng.choices(SYLLABLES, k=rng.randint(2, 3)))}")
    return dirs


def _file_paths(rng: random.Random, shape: Shape) -> tuple[list[str], list[str]]:
    projects, shares = _project_layout(rng, shape)
    paths: set[str] = set(ROOT_FILES)
    counts = [max(1, int(share * (shape.files - len(ROOT_FILES)))) for share in shares]
    while sum(counts) < shape.files - len(ROOT_FILES):
        counts[rng.randrange(len(counts))] += 1
    for project, count in zip(projects, counts):
        area = project.split("/")[0]
        dirs = _project_dirs(rng, project, count)
        made = 0
        while made < count:
            name = f"{''.join(rng.choices(SYLLABLES, k=rng.randint(2, 4)))}_{rng.randrange(1000)}"
            path = f"{rng.choice(dirs)}/{name}.{rng.choice(EXTENSIONS[area])}"
            if path not in paths:
                paths.add(path)
                made += 1
    return sorted(paths), projects


def _new_file(rng: random.Random, shape: Shape) -> array.array:
    mu = math.log(shape.mean_size) - 0.5  # sigma 1: mean = exp(mu + 1/2)
    size = min(MAX_SIZE, max(64, int(rng.lognormvariate(mu, 1.0))))
    lines = array.array("I", rng.choices(range(shape.pool_lines), k=max(1, size // LINE_BYTES)))
    for at in range(1, len(lines)):  # a third of a file's lines repeat one of its earlier lines, as in code
        if rng.random() < 0.33:
            lines[at] = lines[rng.randrange(at)]
    return lines


def _edit(rng: random.Random, lines: array.array, pool_lines: int) -> None:
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(lines))
        what = rng.random()
        if what < 0.6:
            lines[at] = rng.randrange(pool_lines)
        elif what < 0.85 or len(lines) < 2:
            lines.insert(at, rng.randrange(pool_lines))
        else:
            del lines[at]


def make_monorepo(out: str, shape: Shape = SHAPES["full"], seed: int = 1, repack: bool = True,
                  log=print) -> MonoRepo:
    """Generate the monorepo as a bare repository at `out` (which must not exist)."""
    if os.path.exists(out):
        raise FileExistsError(out)
    started = time.monotonic()
    rng = random.Random(seed)
    env = clean_env()
    _git("init", "-q", "--bare", "-b", "main", out, env=env)
    pool = _line_pool(rng, shape.pool_lines)
    paths, projects = _file_paths(rng, shape)
    contents = {path: _new_file(rng, shape) for path in paths}
    # With a repack to follow, fast-import stores objects uncompressed and without deltas (its deltas,
    # against the previous blob in the stream, are useless here): 12 s instead of 45 s for the full
    # shape; the repack (-F: every object compressed and deltified anew) then takes ~30 s.
    fast = ["-c", "pack.compression=0", "fast-import", "--depth=0"] if repack else ["fast-import"]
    proc = subprocess.Popen(["git", "-C", out, *fast, "--quiet", "--done"], stdin=subprocess.PIPE, env=env)
    write = proc.stdin.write
    join = b"".join
    tree_bytes = 0
    for number in range(shape.commits):
        if number == 0:
            touched, deleted = paths, []
        else:
            live = sorted(contents)
            touched = rng.sample(live, min(shape.changes, len(live)))
            for path in touched:
                _edit(rng, contents[path], shape.pool_lines)
            for _ in range(shape.adds):
                base = rng.choice(live)
                new = f"{base.rsplit('/', 1)[0]}/{''.join(rng.choices(SYLLABLES, k=3))}_{number}.{base.rsplit('.', 1)[1]}"
                if new not in contents:
                    contents[new] = _new_file(rng, shape)
                    touched.append(new)
            deleted = [p for p in rng.sample(live, shape.deletes) if p not in touched and p not in ROOT_FILES]
            for path in deleted:
                del contents[path]
        message = f"commit {number}: {len(touched)} files changed\n".encode()
        write(b"commit refs/heads/main\n")
        write(b"mark :%d\n" % (number + 1))
        write(b"committer %s %d +0000\n" % (COMMITTER, EPOCH + number * 600))
        write(b"data %d\n%s" % (len(message), message))
        if number:
            write(b"from :%d\n" % number)
        for path in touched:
            data = join(map(pool.__getitem__, contents[path]))
            write(b"M 100644 inline %s\ndata %d\n" % (path.encode(), len(data)))
            write(data)
            write(b"\n")
        for path in deleted:
            write(b"D %s\n" % path.encode())
    write(b"done\n")
    proc.stdin.close()
    if proc.wait() != 0:
        raise RuntimeError("git fast-import failed")
    imported = time.monotonic()
    if repack:
        _git("-C", out, "-c", "pack.threads=0", "repack", "-a", "-d", "-F", "-q", env=env)
    repacked = time.monotonic()
    commits = _git("-C", out, "rev-list", "--reverse", "main", env=env).stdout.decode().split()
    sizes = _git("-C", out, "ls-tree", "-r", "-l", "-z", "main", env=env).stdout.split(b"\0")
    tree_bytes = sum(int(entry.split(None, 4)[3]) for entry in sizes if entry)
    pack_dir = os.path.join(out, "objects", "pack")
    pack_bytes = sum(os.path.getsize(os.path.join(pack_dir, n)) for n in os.listdir(pack_dir) if n.endswith(".pack"))
    repo = MonoRepo(path=out, seed=seed, shape=shape, commits=commits, projects=projects,
                    files=len([e for e in sizes if e]), tree_bytes=tree_bytes, pack_bytes=pack_bytes,
                    seconds={"generate_and_fast_import": round(imported - started, 1),
                             "repack": round(repacked - imported, 1), "total": round(repacked - started, 1)})
    log(f"monorepo: {repo.files} files, {tree_bytes / 2**20:.0f} MiB tree, {len(commits)} commits, "
        f"{pack_bytes / 2**20:.0f} MiB packed, {repo.seconds['total']} s")
    return repo


# -- cones --------------------------------------------------------------------------------------

def in_cone(path: str, dirs: list[str]) -> bool:
    """Whether cone-mode sparse checkout of `dirs` writes `path`: files at the root, files directly in
    an ancestor directory of a listed one, and everything under a listed one."""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    for d in dirs:
        d = d.strip("/")
        if path.startswith(d + "/") or parent == "" or d == parent or d.startswith(parent + "/"):
            return True
    return False


def cone_pathspecs(dirs: list[str]) -> list[str]:
    """Pathspecs that select exactly the cone's files for `git rev-list --objects --no-walk SHA -- ...`
    (which, with --missing=print, lists the cone's missing blobs as `?<id>`): root files, files directly
    in each ancestor of a listed directory, and the listed directories recursively. Glob characters in
    names are escaped. (`git ls-tree` refuses the glob magic.)"""
    def glob_escape(text: str) -> str:
        return "".join("\\" + c if c in "*?[]\\" else c for c in text)

    specs = {":(glob)*"}
    for d in dirs:
        parts = d.strip("/").split("/")
        for i in range(1, len(parts)):
            specs.add(f":(glob){glob_escape('/'.join(parts[:i]))}/*")
        specs.add(f":(literal){'/'.join(parts)}/")
    return sorted(specs)


def tree_entries(repo: str, sha: str, sizes: bool = True) -> list[tuple[str, str, int]]:
    """(path, blob id, size) of every blob of the commit's tree. In a partial clone pass sizes=False
    (size -1): `ls-tree -l` reads every blob, and a missing one means a lazy fetch or an error."""
    out = _git("-C", repo, "ls-tree", "-r", *(["-l"] if sizes else []), "-z", "--full-tree", sha).stdout.split(b"\0")
    entries = []
    for entry in filter(None, out):
        meta, _, path = entry.partition(b"\t")
        fields = meta.split()
        if fields[1] == b"blob":
            entries.append((path.decode(), fields[2].decode(), int(fields[3]) if sizes else -1))
    return entries


def cone_dirs(repo: MonoRepo, fraction: float = 0.05, seed: int | None = None) -> list[str]:
    """Project directories whose files make about `fraction` of the tip's bytes (picked at random from
    the seed, small projects added last to come close to the fraction without passing it by much)."""
    rng = random.Random(repo.seed if seed is None else seed)
    sizes: dict[str, int] = {}
    for path, _, size in tree_entries(repo.path, repo.commits[-1]):
        project = "/".join(path.split("/")[:2])
        if project in repo.projects:
            sizes[project] = sizes.get(project, 0) + size
    target = fraction * repo.tree_bytes
    order = sorted(sizes)
    rng.shuffle(order)
    chosen, total = [], 0
    for project in order:
        if total + sizes[project] <= target * 1.2:
            chosen.append(project)
            total += sizes[project]
        if total >= target * 0.9:
            break
    return sorted(chosen)


def cone_size(repo: str, sha: str, dirs: list[str]) -> dict:
    """Files and bytes of the cone at the commit (what a sparse checkout writes)."""
    entries = [e for e in tree_entries(repo, sha) if in_cone(e[0], dirs)]
    return {"files": len(entries), "bytes": sum(e[2] for e in entries), "blobs": len({e[1] for e in entries})}


# -- serving and measuring -----------------------------------------------------------------------

def serve(repo: MonoRepo | str, allow_filter: bool = True) -> GitDaemon:
    """git daemon on 127.0.0.1 (a free port) serving the repository's parent directory; with
    uploadpack.allowFilter unless allow_filter is False. Stop it with .stop()."""
    path = repo.path if isinstance(repo, MonoRepo) else repo
    extra = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "uploadpack.allowFilter",
             "GIT_CONFIG_VALUE_0": "true" if allow_filter else "false"}
    return GitDaemon(os.path.dirname(os.path.abspath(path)), env=clean_env(extra))


def disk_usage(path: str) -> dict:
    """Allocated (st_blocks) and apparent bytes under path, .git apart from the work tree."""
    out = {"git_bytes": 0, "git_apparent": 0, "tree_bytes": 0, "tree_apparent": 0, "tree_files": 0}
    for top, dirs, files in os.walk(path):
        inside_git = top == os.path.join(path, ".git") or top.startswith(os.path.join(path, ".git") + os.sep)
        for name in files:
            try:
                st = os.lstat(os.path.join(top, name))
            except FileNotFoundError:
                continue
            key = "git" if inside_git else "tree"
            out[f"{key}_bytes"] += st.st_blocks * 512
            out[f"{key}_apparent"] += st.st_size
            if not inside_git:
                out["tree_files"] += 1
    return out


def _step(proxy: CountingProxy | None, label: str, args: list[str], env: dict) -> dict:
    if proxy is not None:
        proxy.label = label
    started = time.monotonic()
    done = subprocess.run(["git", *args], env=env, capture_output=True, cwd="/", check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args[:4])}... failed: {done.stderr.decode(errors='replace')[-500:]}")
    result = {"seconds": round(seconds, 3)}
    if proxy is not None:
        proxy.wait_idle()
        tally = proxy.tally(label)
        result.update(bytes=tally["bytes"], connections=tally["connections"], objects=tally["objects"])
    return result


def measure_anchor(url: str, dest: str, dirs: list[str], first: str, second: str,
                   proxy: CountingProxy | None = None, repo: str | None = None, tag: str = "") -> dict:
    """Plain git's sparse review: clone --filter=blob:none --no-checkout, sparse-checkout set --cone,
    checkout of `first`, then of `second`. `url` should go through `proxy` (its labels are the steps);
    `repo` (the upstream's path) adds the cone's own size at `first`."""
    env = clean_env()
    steps = {
        "clone": _step(proxy, f"anchor-clone{tag}", ["clone", "-q", "--filter=blob:none", "--no-checkout", url, dest], env),
        "sparse_set": _step(proxy, f"anchor-sparse-set{tag}", ["-C", dest, "sparse-checkout", "set", "--cone", *dirs], env),
        "checkout": _step(proxy, f"anchor-checkout{tag}", ["-C", dest, "-c", "advice.detachedHead=false", "checkout", "-q",
                                                     "--detach", first], env),
    }
    steps["disk_after_first"] = disk_usage(dest)
    steps["second_checkout"] = _step(proxy, f"anchor-second{tag}", ["-C", dest, "-c", "advice.detachedHead=false",
                                                              "checkout", "-q", "--detach", second], env)
    steps["disk_after_second"] = disk_usage(dest)
    steps["status"] = _step(proxy, f"anchor-status{tag}", ["-C", dest, "status", "--porcelain"], env)
    total = [steps[k] for k in ("clone", "sparse_set", "checkout")]
    steps["first_ready"] = {"seconds": round(sum(s["seconds"] for s in total), 3),
                            "bytes": sum(s.get("bytes", 0) for s in total)}
    if repo is not None:
        steps["cone"] = cone_size(repo, first, dirs)
    return steps


def measure_full_clone(url: str, dest: str, proxy: CountingProxy | None = None) -> dict:
    """`git clone --mirror` of everything: the reference for bytes and time."""
    result = _step(proxy, "full-clone", ["clone", "-q", "--mirror", url, dest], clean_env())
    result["disk"] = disk_usage(dest)["tree_bytes"]  # a bare repository: everything is "tree" here
    return result


VARIANTS = {  # name: (CHECKOUTCACHE_FILTER, sparse, more environment)
    "full mirror": (None, False, {}),
    "partial mirror": ("blob:none", False, {}),
    "partial + sparse": ("blob:none", True, {}),
    # The same without git's check of every fetched object (CHECKOUTCACHE_FSCK, on by
    # default), which plain git does not run: what that check costs on a tree-heavy fetch.
    "partial + sparse, fsck off": ("blob:none", True, {"CHECKOUTCACHE_FSCK": "off"}),
}
REPO_ROOT = os.path.dirname(HERE)


def _ensure(proxy: CountingProxy | None, label: str, root: str, url: str, sha: str, dirs: list[str],
            filter: str | None, extra_env: dict | None = None) -> dict:
    """One `checkoutcache ensure --wait` as a review pipeline runs it: timed, its upstream bytes counted."""
    env = clean_env({"CHECKOUTCACHE_ROOT": root, "PYTHONPATH": REPO_ROOT,
                     **({"CHECKOUTCACHE_FILTER": filter} if filter else {}), **(extra_env or {})})
    if proxy is not None:
        proxy.label = label
    cmd = [sys.executable, "-m", "checkoutcache", "--json", "ensure", url, sha, "--wait", "1800",
           *[arg for d in dirs for arg in ("--sparse", d)]]
    started = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, cwd="/", check=False)
    seconds = time.monotonic() - started
    answer = json.loads(done.stdout or b"{}")
    if done.returncode != 0 or answer.get("state") != "ready":
        raise RuntimeError(f"ensure failed: {done.stdout[-500:]!r} {done.stderr[-500:]!r}")
    result = {"seconds": round(seconds, 3), "path": answer["path"]}
    if proxy is not None:
        proxy.wait_idle()
        tally = proxy.tally(label)
        result.update(bytes=tally["bytes"], connections=tally["connections"], objects=tally["objects"])
    return result


def measure_product(name: str, url: str, root: str, dirs: list[str], first: str, second: str,
                    proxy: CountingProxy | None = None, tag: str = "") -> dict:
    """The cache's cold first ready (mirror made, checkout published) and a second commit of the
    same review (mirror warm), each with its upstream bytes; the disk of one checkout and of the
    mirror."""
    filter, sparse, extra_env = VARIANTS[name]
    cone = dirs if sparse else []
    label = name.replace(" ", "-").replace("+", "and").replace(",", "") + tag
    first_ready = _ensure(proxy, f"{label}-first", root, url, first, cone, filter, extra_env)
    second_ready = _ensure(proxy, f"{label}-second", root, url, second, cone, filter, extra_env)
    mirror = os.path.join(os.path.dirname(os.path.dirname(first_ready["path"])), "mirror.git")
    return {"first_ready": first_ready, "second_checkout": second_ready,
            "checkout_disk": disk_usage(first_ready["path"]), "mirror_disk": disk_usage(mirror)["tree_bytes"]}


def ratios(report: dict) -> dict:
    """The issue's bars, as ratios of figures measured in this one run."""
    anchor, product = report["anchor"], report["product"]
    sparse, full = product["partial + sparse"], product["full mirror"]
    cone_disk = anchor["disk_after_first"]["tree_bytes"]  # the cone as plain git writes it
    disk = sparse["checkout_disk"]
    return {
        "sparse_first_ready_time_vs_anchor": round(sparse["first_ready"]["seconds"] / anchor["first_ready"]["seconds"], 3),
        "sparse_first_ready_bytes_vs_anchor": round(sparse["first_ready"]["bytes"] / anchor["first_ready"]["bytes"], 3),
        "sparse_first_ready_bytes_vs_full_mirror": round(sparse["first_ready"]["bytes"] / full["first_ready"]["bytes"], 3),
        "sparse_checkout_disk_vs_cone": round((disk["tree_bytes"] + disk["git_bytes"]) / cone_disk, 3),
        "sparse_second_checkout_time_vs_anchor": round(sparse["second_checkout"]["seconds"]
                                                       / anchor["second_checkout"]["seconds"], 3),
        "partial_first_ready_time_vs_full_mirror": round(product["partial mirror"]["first_ready"]["seconds"]
                                                         / full["first_ready"]["seconds"], 3),
        "sparse_fsck_off_first_ready_time_vs_anchor": round(
            product["partial + sparse, fsck off"]["first_ready"]["seconds"] / anchor["first_ready"]["seconds"], 3),
        "anchor_first_ready_bytes_vs_full_mirror": round(anchor["first_ready"]["bytes"] / full["first_ready"]["bytes"],
                                                         3),
    }


SPARSE_VARIANT = "partial + sparse"


def median_run(runs: list[dict], key) -> dict:
    return sorted(runs, key=key)[len(runs) // 2]


BARS = {"sparse_first_ready_time_vs_anchor": 1.2, "sparse_first_ready_bytes_vs_anchor": 1.2,
        "sparse_first_ready_bytes_vs_full_mirror": 0.2, "sparse_checkout_disk_vs_cone": 1.1}


def plot(report: dict, out: str) -> None:
    """Time to first ready and upstream bytes per variant, the anchor first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["plain git (anchor)", *VARIANTS]
    runs = [report["anchor"]["first_ready"], *(report["product"][n]["first_ready"] for n in VARIANTS)]
    # (medians of --repeat runs for the anchor and the sparse variant)
    seconds = [r["seconds"] for r in runs]
    mib = [r["bytes"] / 2**20 for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colors = ["#888888", "#c0504d", "#4f81bd", "#9bbb59", "#8064a2"]
    left.bar(range(len(names)), seconds, color=colors)
    left.set_title("first ready (s)")
    right.bar(range(len(names)), mib, color=colors)
    right.set_title("bytes from the upstream (MiB)")
    for axis in (left, right):
        axis.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    repo = report["repo"]
    fig.suptitle(f"monorepo: {repo['files']} files, {repo['tree_bytes'] / 2**20:.0f} MiB tree, "
                 f"{repo['commits']['count']} commits; cone {report['anchor']['cone']['files']} files")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller repository (5,000 files, 40 commits)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--files", type=int, help="override the shape's file count")
    parser.add_argument("--commits", type=int, help="override the shape's commit count")
    parser.add_argument("--changes", type=int, help="override the files edited per commit")
    parser.add_argument("--cone-fraction", type=float, default=0.05)
    parser.add_argument("--second-back", type=int, default=5,
                        help="the second checkout is this many commits before the first (the tip)")
    parser.add_argument("--work", help="work directory (default: a new temporary one)")
    parser.add_argument("--repo", help="reuse this generated repository (made there if missing)")
    parser.add_argument("--full-clone", action="store_true", help="also time a `git clone --mirror`")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--json-out")
    parser.add_argument("--plot", help="write the chart of first ready time and bytes here (a .png)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="cold runs of the anchor and of the sparse variant (their medians are compared)")
    args = parser.parse_args(argv)

    shape = SHAPES["quick" if args.quick else "full"]
    overrides = {k: v for k, v in (("files", args.files), ("commits", args.commits), ("changes", args.changes))
                 if v is not None}
    shape = Shape(**{**asdict(shape), **overrides})
    work = args.work or tempfile.mkdtemp(prefix="monorepo-")
    os.makedirs(work, exist_ok=True)
    repo_path = args.repo or os.path.join(work, "upstream", "mono.git")
    os.makedirs(os.path.dirname(repo_path), exist_ok=True)
    if os.path.exists(repo_path):
        repo = load_monorepo(repo_path, shape, args.seed)
    else:
        repo = make_monorepo(repo_path, shape, args.seed)
    dirs = cone_dirs(repo, args.cone_fraction)
    first, second = repo.commits[-1], repo.commits[-1 - min(args.second_back, len(repo.commits) - 1)]
    daemon = serve(repo)
    proxy = CountingProxy(daemon.port, "upstream")
    url = f"git://127.0.0.1:{proxy.port}/{os.path.basename(repo.path)}"
    try:
        report = {"machine": {"cores": os.cpu_count(), "git": _git("--version").stdout.decode().strip(),
                              "python": platform.python_version()},
                  "repo": repo.describe(), "cone_dirs": dirs, "first": first, "second": second}
        report["product"] = {}
        for number, name in enumerate(VARIANTS):
            if name == SPARSE_VARIANT:
                continue
            root = os.path.join(work, f"cache-{number}")
            shutil.rmtree(root, ignore_errors=True)
            report["product"][name] = measure_product(name, url, root, dirs, first, second, proxy)
        # The anchor and the sparse variant, the two the time bar compares, alternate --repeat
        # times (each cold); the run of median first-ready time of each is the one compared.
        anchors, sparse_runs = [], []
        for attempt in range(args.repeat):
            clone_dir = os.path.join(work, f"anchor-{attempt}")
            shutil.rmtree(clone_dir, ignore_errors=True)
            anchors.append(measure_anchor(url, clone_dir, dirs, first, second, proxy, repo.path, tag=f"-{attempt}"))
            root = os.path.join(work, f"cache-sparse-{attempt}")
            shutil.rmtree(root, ignore_errors=True)
            sparse_runs.append(measure_product(SPARSE_VARIANT, url, root, dirs, first, second, proxy,
                                               tag=f"-{attempt}"))
        report["anchor"] = median_run(anchors, lambda r: r["first_ready"]["seconds"])
        report["product"][SPARSE_VARIANT] = median_run(sparse_runs, lambda r: r["first_ready"]["seconds"])
        report["repeats"] = {"anchor_first_ready_seconds": [r["first_ready"]["seconds"] for r in anchors],
                             "sparse_first_ready_seconds": [r["first_ready"]["seconds"] for r in sparse_runs]}
        report["ratios"] = ratios(report)
        report["bars"] = {k: {"bar": v, "ratio": report["ratios"][k], "met": report["ratios"][k] <= v}
                          for k, v in BARS.items()}
        if args.full_clone:
            mirror = os.path.join(work, "full.git")
            shutil.rmtree(mirror, ignore_errors=True)
            report["full_clone"] = measure_full_clone(url, mirror, proxy)
    finally:
        proxy.stop()
        daemon.stop()
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print_report(report)
    if args.plot:
        plot(report, args.plot)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


def load_monorepo(path: str, shape: Shape, seed: int) -> MonoRepo:
    """A repository make_monorepo made earlier (its shape and seed as given: not checked)."""
    commits = _git("-C", path, "rev-list", "--reverse", "main").stdout.decode().split()
    entries = tree_entries(path, commits[-1])
    projects = sorted({"/".join(p.split("/")[:2]) for p, _, _ in entries if p.count("/") >= 2})
    pack_dir = os.path.join(path, "objects", "pack")
    return MonoRepo(path=path, seed=seed, shape=shape, commits=commits, projects=projects, files=len(entries),
                    tree_bytes=sum(e[2] for e in entries),
                    pack_bytes=sum(os.path.getsize(os.path.join(pack_dir, n)) for n in os.listdir(pack_dir)
                                   if n.endswith(".pack")))


def print_report(report: dict) -> None:
    repo, anchor = report["repo"], report["anchor"]

    def mib(n: int) -> str:
        return f"{n / 2**20:.1f} MiB"

    print(f"repo: {repo['files']} files, {mib(repo['tree_bytes'])} tree, {repo['commits']['count']} commits, "
          f"{mib(repo['pack_bytes'])} packed")
    cone = anchor.get("cone", {})
    print(f"cone: {len(report['cone_dirs'])} dirs, {cone.get('files')} files, {mib(cone.get('bytes', 0))}")
    for step in ("clone", "sparse_set", "checkout", "second_checkout", "status"):
        s = anchor[step]
        print(f"  {step:16} {s['seconds']:8.2f} s  {mib(s.get('bytes', 0)):>10}  {s.get('objects', 0):7} objects")
    for key in ("disk_after_first", "disk_after_second"):
        d = anchor[key]
        print(f"  {key:18} .git {mib(d['git_bytes'])}, work tree {mib(d['tree_bytes'])} ({d['tree_files']} files)")
    if "full_clone" in report:
        f = report["full_clone"]
        print(f"  full clone --mirror {f['seconds']:.2f} s, {mib(f.get('bytes', 0))}, disk {mib(f['disk'])}")
    for name, run in report.get("product", {}).items():
        first, second, disk = run["first_ready"], run["second_checkout"], run["checkout_disk"]
        print(f"{name:18} first ready {first['seconds']:7.2f} s {mib(first.get('bytes', 0)):>10}; second "
              f"{second['seconds']:6.2f} s {mib(second.get('bytes', 0)):>10}; checkout .git "
              f"{mib(disk['git_bytes'])} + tree {mib(disk['tree_bytes'])}; mirror {mib(run['mirror_disk'])}")
    for key, bar in report.get("bars", {}).items():
        print(f"  {key:42} {bar['ratio']:6.3f}  (bar {bar['bar']}: {'met' if bar['met'] else 'MISSED'})")
    for key, value in report.get("ratios", {}).items():
        if key not in report.get("bars", {}):
            print(f"  {key:42} {value:6.3f}")


if __name__ == "__main__":
    sys.exit(main())
