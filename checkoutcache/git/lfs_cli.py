"""The LFS half of the git CLI backend (mixed into GitCliBackend, as git/shallow.py's
ShallowOps is: it uses the backend's git, _bytes, _stream, _run and partial_filter).

Which files are LFS is what git's attributes say (filter=lfs), read from the commit's
blobs, never from a work tree; git-lfs downloads exactly the objects a checkout needs,
listed in a commit of its own made in a private view (never in the mirror), from the
endpoint the repository URL implies (no .lfsconfig sends a download elsewhere), each
download cut at its pointer's size (RLIMIT_FSIZE, die_with_file_size_limit).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from checkoutcache.cones import Cone, matcher
from checkoutcache.credentials import Credential, redact, secrets_of
from checkoutcache.git.backend import (
    LFS_POINTER_MAX,
    LFS_PROGRAM,
    LfsPointer,
    Log,
    Progress,
    lfs_endpoint,
    lfs_failure,
    lfs_fetch_batches,
    lfs_pointer_text,
    parse_lfs_pointer,
)
from checkoutcache.git.env import OPERATOR_CONFIG_VAR, git_env
from checkoutcache.git.messages import last_meaningful_line
from checkoutcache.git.view import private_view
from checkoutcache.units import format_bytes

# Who made the commit that lists a download's LFS files for git-lfs (it never leaves the view).
LISTING_IDENTITY = {"GIT_AUTHOR_NAME": "checkoutcache", "GIT_AUTHOR_EMAIL": "checkoutcache@localhost",
                    "GIT_COMMITTER_NAME": "checkoutcache", "GIT_COMMITTER_EMAIL": "checkoutcache@localhost",
                    "GIT_AUTHOR_DATE": "@0 +0000", "GIT_COMMITTER_DATE": "@0 +0000"}

def operator_lfs_filters() -> dict[str, str]:
    """lfs.fetchinclude and lfs.fetchexclude as the operator's git config says (empty when
    unset): passed on the command line, they override a repository's .lfsconfig."""
    found = {"fetchinclude": "", "fetchexclude": ""}
    path = os.environ.get(OPERATOR_CONFIG_VAR)
    if path:
        for name in found:
            done = subprocess.run(["git", "config", "--file", path, "--get", f"lfs.{name}"], capture_output=True,
                                  text=True, env=git_env(), cwd="/")
            found[name] = done.stdout.strip() if done.returncode == 0 else ""
    return found


# A download cut by the file size limit (EFBIG): the server sent more than the pointer says.
_FILE_TOO_LARGE = re.compile(r"file too large", re.I)
# git-lfs's closing advice, never the cause of a failure.
_LFS_ADVICE = re.compile(r"git lfs logs last|failed to fetch some objects from", re.I)


def lfs_failure_line(output: str) -> str:
    """What a failed `git lfs fetch` says, without its closing advice."""
    telling = "\n".join(line for line in output.splitlines() if not _LFS_ADVICE.search(line))
    return last_meaningful_line(telling or output)



class LfsOps:
    """The LFS half of the git CLI backend."""

    def lfs_unsupported(self) -> str | None:
        if shutil.which(LFS_PROGRAM) is None:
            return f"{LFS_PROGRAM} is not installed (not on PATH)"
        return None

    def lfs_objects(self, mirror: str, sha: str) -> list[str]:
        return sorted({pointer.oid for pointer in self.lfs_pointers(mirror, sha)})

    def lfs_pointers(self, mirror: str, sha: str, cone: Cone = ()) -> list[LfsPointer]:
        # Which files are LFS is what git's attributes say (filter=lfs), every .gitattributes
        # of the tree counting, exactly as the checkout's filter will see them: never a
        # pointer-shaped text file no attribute routes, as `git lfs ls-files` would list.
        # A commit whose .gitattributes name no LFS filter costs one ls-tree. With a cone,
        # only its files (every .gitattributes that applies to one is in the cone too).
        listed = self._bytes(["-C", mirror, "ls-tree", "-r", "-z", "--full-tree", sha])
        if b".gitattributes" not in listed:
            return []  # no attributes anywhere: no LFS file (a 50,000-file tree costs no parse)
        in_cone = matcher(cone)
        entries = []  # (blob, path) of regular files
        attributes = []
        for entry in filter(None, listed.split(b"\0")):
            meta, _, path = entry.partition(b"\t")
            mode, kind, oid = meta.split()
            if kind == b"blob" and mode in (b"100644", b"100755") and in_cone(path):
                entries.append((oid, path))
                if path == b".gitattributes" or path.endswith(b"/.gitattributes"):
                    attributes.append(oid)
        if not attributes or b"filter=lfs" not in self._bytes(["-C", mirror, "cat-file", "--batch"],
                                                              b"".join(oid + b"\n" for oid in attributes)):
            return []
        index = os.path.join(mirror, f"checkoutcache-attributes.{os.getpid()}.{os.urandom(4).hex()}.index")
        try:
            self._bytes(["-C", mirror, "read-tree", sha], env={"GIT_INDEX_FILE": index})
            routed = self._bytes(["-C", mirror, "check-attr", "--cached", "-z", "--stdin", "filter"],
                                 b"".join(path + b"\0" for _oid, path in entries), env={"GIT_INDEX_FILE": index})
        finally:
            try:
                os.unlink(index)
            except FileNotFoundError:
                pass
        fields = routed.split(b"\0")
        lfs_paths = {fields[i] for i in range(0, len(fields) - 2, 3) if fields[i + 2] == b"lfs"}
        candidates = [(oid, path) for oid, path in entries if path in lfs_paths]
        sizes = self._bytes(["-C", mirror, "cat-file", "--batch-check=%(objectsize)"],
                            b"".join(oid + b"\n" for oid, _path in candidates)).split()
        small = [(oid, path) for (oid, path), size in zip(candidates, sizes) if size.isdigit()
                 and int(size) <= LFS_POINTER_MAX]
        pointers = []
        contents = self._bytes(["-C", mirror, "cat-file", "--batch"], b"".join(oid + b"\n" for oid, _ in small))
        for oid, path in small:
            header, _, contents = contents.partition(b"\n")
            if header.endswith(b" missing"):
                continue  # not in the mirror (a partial one): not a pointer we can read
            size = int(header.split()[2])
            data, contents = contents[:size], contents[size + 1:]
            parsed = parse_lfs_pointer(data)
            if parsed is not None:
                pointers.append(LfsPointer(path, *parsed))
        return pointers

    def lfs_fetch(self, mirror: str, url: str, is_local: bool, pointers: list[LfsPointer], store: str,
                  credential: Credential | None, on_progress: Progress, log: Log,
                  keep_fds: tuple[int, ...] = ()) -> None:
        # lfs.storage goes to the repository's config (the private view's), not our command
        # line: git-lfs hands its command line on to the file:// transfer agent, which would
        # look for a local upstream's objects in our store.
        endpoint = lfs_endpoint(url, is_local)
        secrets = secrets_of(credential)
        # On our command line, over anything a repository's .lfsconfig says: the endpoint
        # from the repository URL (no .lfsconfig sends the download elsewhere), and which
        # paths to fetch, the operator's choice alone (CHECKOUTCACHE_GIT_CONFIG), never the
        # default branch's. Credentials: git-lfs asks git's credential helpers, so the one
        # scoped to the URL's host (git_env) applies.
        pinned = [f"lfs.url={endpoint}"] if endpoint else []
        pinned += [f"lfs.{name}={value}" for name, value in operator_lfs_filters().items()]
        with private_view(mirror, self.partial_filter(mirror), {"lfs.storage": store}, own_objects=True) as view:
            for limit, batch in lfs_fetch_batches(pointers):
                # git-lfs is given a commit of its own, made in the view (never in the mirror),
                # whose tree holds exactly these pointers at their paths: it scans that, never
                # the checkout's commit, whose pointers outside a cone a partial mirror lacks,
                # and no include pattern can match more than the objects named.
                listing = self._listing_commit(view, batch)
                cmd = [*[arg for pair in pinned for arg in ("-c", pair)],
                       "lfs", "fetch", endpoint if is_local and endpoint else url, listing]
                log("$ git " + redact(" ".join(cmd), secrets) + f" ({len(batch)} object(s), each cut at "
                    f"{format_bytes(limit)})")
                code, output = self._stream(["-C", view, *cmd], git_env(credential=credential, url=url),
                                            on_progress, log, secrets, keep_fds, file_size_limit=limit)
                if code != 0:
                    detail = lfs_failure_line(output)
                    if _FILE_TOO_LARGE.search(output):
                        detail = (f"the LFS server sent more bytes than an object's pointer says (the download "
                                  f"was cut at {format_bytes(limit)})")
                    raise lfs_failure(output, detail, secrets)

    def _listing_commit(self, view: str, pointers: list[LfsPointer]) -> str:
        """A commit in the view's own objects whose tree holds these pointer files at their paths."""
        # One fast-import writes every pointer blob into one pack (loose objects, one file
        # each, cost 1.5 ms apiece: 14 s for 10,000 pointers on a busy machine, 1.8 s so).
        unique = list({p.oid: p for p in pointers}.values())
        marks = os.path.join(view, "checkoutcache-lfs.marks")
        self._bytes(["-C", view, "fast-import", "--quiet", f"--export-marks={marks}"],
                    b"".join(b"blob\nmark :%d\ndata %d\n%s\n" % (number, len(text), text)
                             for number, text in enumerate((lfs_pointer_text(p) for p in unique), 1)))
        with open(marks, "rb") as handle:
            by_mark = dict(line.split() for line in handle.read().splitlines())
        blob_of = {p.oid: by_mark[b":%d" % number] for number, p in enumerate(unique, 1)}
        index = os.path.join(view, "checkoutcache-lfs.index")
        listed = {p.path: blob_of[p.oid] for p in pointers}
        self._bytes(["-C", view, "update-index", "--add", "-z", "--index-info"],
                    b"".join(b"100644 blob " + blob + b"\t" + path + b"\0" for path, blob in sorted(listed.items())),
                    env={"GIT_INDEX_FILE": index})
        tree = self._bytes(["-C", view, "write-tree"], env={"GIT_INDEX_FILE": index}).strip()
        return self._bytes(["-C", view, "commit-tree", "-m", "the LFS objects a checkout needs", tree.decode()],
                           env=LISTING_IDENTITY).strip().decode()

    def lfs_in_tree(self, tree_dir: str) -> bool:
        # The attribute pathspec needs git only: it answers without git-lfs installed.
        done = self._run(["-C", tree_dir, "ls-files", "-z", "--", ":(attr:filter=lfs)"])
        return done.returncode == 0 and bool(done.stdout.strip("\0"))
