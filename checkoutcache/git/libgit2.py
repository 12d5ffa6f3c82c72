"""The git interface on libgit2 (pygit2), in-process: for machines without
git, or CHECKOUTCACHE_TRANSPORT=pygit2. pygit2 is imported by each method
that needs it, so a process that never uses this backend never loads it.

libgit2 has no repack: `repack` answers None (not done), and gc says so.
Its fetches run in the private view of the mirror (git/view.py), as the git
CLI's do: no setting in the mirror's config decides where a fetch goes.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from checkoutcache.credentials import Credential, redact, secrets_of
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.git.backend import (
    CHECKOUT_CONFIG,
    KEEP_PREFIX,
    mirror_config,
    Log,
    Progress,
    git_failure,
    keep_ref,
    probe_failure,
    write_alternates,
)
from checkoutcache.git.env import SSH_KEY_FILE_VAR, SSH_KNOWN_HOSTS_VAR
from checkoutcache.git.boundary import link_shallow
from checkoutcache.git.view import private_view


def _errors():
    import pygit2

    return (pygit2.GitError, KeyError, ValueError)


def _ignore_ambient_config() -> None:
    """libgit2 reads the system, XDG and global config like git does: point
    those levels at an empty place, so the caller's config never applies."""
    import pygit2

    for level in (pygit2.enums.ConfigLevel.SYSTEM, pygit2.enums.ConfigLevel.XDG,
                  pygit2.enums.ConfigLevel.GLOBAL, pygit2.enums.ConfigLevel.PROGRAMDATA):
        try:
            pygit2.settings.search_path[level] = os.devnull
        except (ValueError, pygit2.GitError, AttributeError):
            pass


def refuse_ssh_files(url: str) -> None:
    """libgit2 speaks ssh through libssh2, which takes neither the operator's known_hosts file
    nor their ssh command: with those set, an ssh URL needs the git CLI (never a silent
    fallback to ~/.ssh, or to no host key check)."""
    if url.startswith("ssh://") and (os.environ.get(SSH_KEY_FILE_VAR) or os.environ.get(SSH_KNOWN_HOSTS_VAR)):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{SSH_KEY_FILE_VAR} and {SSH_KNOWN_HOSTS_VAR} apply to the "
                                                      f"git CLI transport only; set CHECKOUTCACHE_TRANSPORT=cli "
                                                      f"(or auto, with git installed) for ssh repositories")


class Pygit2Backend:
    name = "pygit2"
    fetches_into_refs = False  # the keep-ref is written after the fetch
    # libgit2 has neither partial clone nor cone-mode sparse checkout: the worker makes a
    # full mirror instead (status says why), and a sparse request is refused up front.
    supports_partial = False
    supports_sparse = False
    # libgit2 1.9 fetches with a depth, but writes the shallow file of the repository it was
    # opened on (our private view's), and has no --deepen: its mirrors are full ones, and its
    # first answer costs the commit's history (the answer says "complete").
    supports_shallow = False

    def __init__(self):
        _ignore_ambient_config()

    @staticmethod
    def _callbacks(credential: Credential | None, on_progress: Progress | None, url: str):
        import pygit2

        refuse_ssh_files(url)

        class Callbacks(pygit2.RemoteCallbacks):
            def __init__(self):
                super().__init__()
                self.asked = 0

            def credentials(self, url, username_from_url, allowed_types):
                self.asked += 1
                if credential is None or self.asked > 1 or not credential.applies_to(url):
                    return None  # none for this host, or no more: fail instead of looping
                return pygit2.UserPass(credential.username, credential.password)

            def transfer_progress(self, stats):
                if on_progress is not None:
                    on_progress({"phase": "receiving objects", "objects": stats.received_objects,
                                 "total_objects": stats.total_objects, "bytes": stats.received_bytes})

        return Callbacks()

    def probe(self, url: str, is_local: bool, credential: Credential | None, timeout: float) -> None:
        import pygit2

        secrets = secrets_of(credential)
        pygit2.settings.server_connect_timeout = int(timeout * 1000)
        pygit2.settings.server_timeout = int(timeout * 1000)
        if is_local and not os.path.isdir(url):
            raise probe_failure(url, is_local, "no such directory", secrets)
        scratch = tempfile.mkdtemp(prefix="checkoutcache-probe-")
        try:
            repo = pygit2.init_repository(scratch, bare=True)
            repo.remotes.create_anonymous(url).list_heads(callbacks=self._callbacks(credential, None, url))
        except _errors() as exc:
            raise probe_failure(url, is_local, str(exc), secrets) from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def remote_refs(self, url: str, patterns: tuple[str, ...], credential: Credential | None,
                    timeout: float) -> dict[str, str]:
        import fnmatch

        import pygit2

        scratch = tempfile.mkdtemp(prefix="checkoutcache-refs-")
        try:
            repo = pygit2.init_repository(scratch, bare=True)
            heads = repo.remotes.create_anonymous(url).list_heads(callbacks=self._callbacks(credential, None, url))
        except _errors():
            return {}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return {head.name: str(head.oid) for head in heads
                if any(fnmatch.fnmatchcase(head.name, p) for p in patterns)}

    def gitmodules(self, mirror: str, sha: str) -> dict[bytes, str]:
        import configparser

        import pygit2

        try:
            data = pygit2.Repository(mirror).revparse_single(f"{sha}:.gitmodules").read_raw()
        except _errors():
            return {}
        # Bytes that are not UTF-8 survive as surrogates, and go back to bytes below.
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        try:
            parser.read_string(data.decode("utf-8", "surrogateescape"))
        except configparser.Error:
            return {}
        found = {}
        for section in parser.sections():
            if section.startswith("submodule ") and parser.has_option(section, "path") and \
                    parser.has_option(section, "url"):
                path = os.fsencode(parser.get(section, "path").strip())
                found[path] = parser.get(section, "url").strip().encode("utf-8", "surrogateescape").decode(
                    "utf-8", "replace")
        return found

    def index_gitlinks(self, tree_dir: str, keep_fds: tuple[int, ...] = ()) -> dict[bytes, str]:
        import pygit2

        try:
            index = pygit2.Repository(tree_dir).index
            # pygit2 decodes paths with surrogateescape: fsencode gives git's bytes back.
            return {os.fsencode(entry.path): str(entry.id) for entry in index
                    if entry.mode == pygit2.enums.FileMode.COMMIT}
        except _errors() as exc:
            text = str(exc) or type(exc).__name__
            raise git_failure(text, text, []) from None

    def drop_refs_under(self, mirror: str, prefix: str) -> None:
        import pygit2

        repo = pygit2.Repository(mirror)
        for name in [n for n in repo.references if n.startswith(prefix)]:
            try:
                repo.references.delete(name)
            except _errors():
                pass

    def init_mirror(self, path: str, filter: str | None = None) -> None:
        import pygit2

        if filter is not None:
            raise ValueError("libgit2 makes no partial clones (supports_partial is False)")

        repo = pygit2.init_repository(path, bare=True)
        for key, value in mirror_config().items():
            repo.config[key] = value

    def is_usable(self, mirror: str) -> bool:
        import pygit2

        if not os.path.isfile(os.path.join(mirror, "HEAD")):
            return False
        try:
            pygit2.Repository(mirror)
        except _errors():
            return False
        return True

    def has_commit(self, mirror: str, sha: str) -> bool:
        import pygit2

        try:
            obj = pygit2.Repository(mirror).get(sha)
        except _errors():
            return False
        return obj is not None and obj.type == pygit2.enums.ObjectType.COMMIT

    def object_kind(self, mirror: str, sha: str) -> tuple[str, str | None] | None:
        import pygit2

        try:
            obj = pygit2.Repository(mirror).get(sha)
        except _errors():
            return None
        if obj is None:
            return None
        kind = {pygit2.enums.ObjectType.COMMIT: "commit", pygit2.enums.ObjectType.TREE: "tree",
                pygit2.enums.ObjectType.BLOB: "blob", pygit2.enums.ObjectType.TAG: "tag"}.get(obj.type, "object")
        target = None
        if kind == "tag":
            try:
                target = str(obj.peel(pygit2.Commit).id)
            except _errors():
                target = None
        return kind, target

    def is_connected(self, mirror: str, sha: str) -> bool:
        import pygit2

        try:
            repo = pygit2.Repository(mirror)
            walker = repo.walk(sha, pygit2.enums.SortMode.NONE)
            for name in repo.references:
                if name == keep_ref(sha):
                    continue
                try:
                    walker.hide(repo.references[name].peel(pygit2.Commit).id)
                except _errors():
                    continue  # a ref to a tree or blob reaches no commit
            for commit in walker:
                if repo.get(commit.tree_id) is None:
                    return False
        except _errors():
            return False  # a parent that is not there
        return True

    def is_sound(self, mirror: str) -> bool:
        return self.is_usable(mirror)  # libgit2 fetches do not check objects: nothing to blame on the mirror

    def partial_filter(self, mirror: str) -> str | None:
        return None  # libgit2 makes none (a partial mirror git made is used through git)

    def objects_readable(self, mirror: str, sha: str, cone: tuple[str, ...] = ()) -> bool:
        import pygit2

        try:
            repo = pygit2.Repository(mirror)
            stack = [repo[sha].peel(pygit2.Tree)]
            while stack:
                for entry in stack.pop():
                    obj = repo[entry.id] if entry.filemode != pygit2.enums.FileMode.COMMIT else None
                    if isinstance(obj, pygit2.Tree):
                        stack.append(obj)
                    elif obj is not None:
                        obj.read_raw()
        except _errors():
            return False
        return True

    def keep(self, mirror: str, sha: str, keep_fds: tuple[int, ...] = ()) -> None:
        import pygit2

        pygit2.Repository(mirror).references.create(keep_ref(sha), sha, force=True)

    def drop_keep(self, mirror: str, sha: str) -> None:
        import pygit2

        try:
            pygit2.Repository(mirror).references.delete(keep_ref(sha))
        except _errors():
            pass

    def kept(self, mirror: str) -> list[str]:
        import pygit2

        return [name[len(KEEP_PREFIX):] for name in pygit2.Repository(mirror).references
                if name.startswith(KEEP_PREFIX)]

    def repack(self, mirror: str, keep_fds: tuple[int, ...], timeout: float, started=None) -> None:
        return None

    def fetch(self, mirror: str, url: str, refspecs: list[str], credential: Credential | None,
              on_progress: Progress, log: Log, keep_fds: tuple[int, ...] = (), refetch: bool = False,
              whole_packs: bool = False) -> bool:
        # refetch is not libgit2's to give: its mirrors are never partial, and a bundle's
        # stray commits are dropped after seeding (seed_mirror reachable_only). whole_packs is
        # what libgit2 always does: its indexer writes every fetch as a pack, never loose objects.
        import pygit2

        secrets = secrets_of(credential)
        log("libgit2 fetch " + redact(url, secrets) + " " + " ".join(refspecs))
        try:
            # libgit2 reads the repository's config as git does (`url.<other>.insteadOf` would
            # send the fetch elsewhere, `http.*` settings would apply): it fetches in the
            # same private view as the git CLI (git/view.py), whose config is ours alone,
            # and what it brings still lands in the mirror.
            with private_view(mirror) as view:
                repo = pygit2.Repository(view)
                stats = repo.remotes.create_anonymous(url).fetch(
                    refspecs, callbacks=self._callbacks(credential, on_progress, url))
        except CheckoutCacheError:
            raise  # TMPDIR could not hold the view: its own error says so
        except (pygit2.GitError, OSError, KeyError) as exc:
            text = str(exc) or type(exc).__name__
            log(redact(text, secrets))
            raise git_failure(text, text, secrets) from None
        log(f"received {stats.received_objects} objects, {stats.received_bytes} bytes")
        # The final figures (the callback may not have seen the last object).
        on_progress({"phase": "receiving objects", "objects": stats.received_objects,
                     "total_objects": stats.total_objects, "bytes": stats.received_bytes})
        return False  # never a filtered fetch

    def lfs_unsupported(self) -> str | None:
        return "the pygit2 transport does not run git-lfs (CHECKOUTCACHE_TRANSPORT=cli does)"

    def lfs_objects(self, mirror: str, sha: str) -> list[str]:
        return []

    def lfs_pointers(self, mirror: str, sha: str, cone: tuple[str, ...] = ()) -> list:
        return []

    def lfs_fetch(self, mirror: str, url: str, is_local: bool, pointers: list, store: str,
                  credential: Credential | None, on_progress: Progress, log: Log,
                  keep_fds: tuple[int, ...] = ()) -> None:
        raise CheckoutCacheError("LFS_FAILED", detail=self.lfs_unsupported())

    def lfs_in_tree(self, tree_dir: str) -> bool:
        """Whether a .gitattributes of the checkout names the LFS filter (an approximation
        of git's attribute matching: enough to say that LFS content is absent). The files are
        read as the commit's blobs, never through the work tree: a repository's symlinked
        `.gitattributes` could name a FIFO another uid made (a read that never returns), and
        git itself reads no symlinked attributes file (mode 120000 entries are skipped)."""
        import pygit2

        regular = (pygit2.enums.FileMode.BLOB, pygit2.enums.FileMode.BLOB_EXECUTABLE)
        try:
            repo = pygit2.Repository(tree_dir)
            for entry in repo.index:
                if entry.path.rsplit("/", 1)[-1] == ".gitattributes" and entry.mode in regular:
                    if b"filter=lfs" in repo[entry.id].data[: 1 << 20]:
                        return True
        except _errors():
            return False
        return False

    def checkout(self, tree_dir: str, mirror_objects: str, sha: str, on_progress: Progress, log: Log,
                 lfs: dict[str, str] | None = None, keep_fds: tuple[int, ...] = (),
                 cone: tuple[str, ...] = ()) -> None:
        import pygit2

        if cone:
            raise ValueError("libgit2 makes no sparse checkouts (supports_sparse is False)")

        try:
            repo = pygit2.init_repository(tree_dir, bare=False)
            write_alternates(tree_dir, mirror_objects)
            link_shallow(tree_dir, mirror_objects)  # a mirror the git CLI made shallow (git/shallow.py)
            for key, value in CHECKOUT_CONFIG.items():
                repo.config[key] = value
            repo = pygit2.Repository(tree_dir)  # reopen so the alternates are read
            commit = repo[sha].peel(pygit2.Commit)
            repo.set_head(commit.id)

            class Progress(pygit2.CheckoutCallbacks):
                def checkout_progress(self, path, completed_steps, total_steps):
                    on_progress({"phase": "checking out", "files": completed_steps, "total_files": total_steps})

            repo.checkout_tree(commit.tree, strategy=pygit2.enums.CheckoutStrategy.FORCE, callbacks=Progress())
        except _errors() as exc:
            text = str(exc) or type(exc).__name__
            raise git_failure(text, text, []) from None

    def deep_problems(self, checkout_dir: str, sha: str) -> list[str]:
        import pygit2

        try:
            repo = pygit2.Repository(checkout_dir)
            repo[sha].peel(pygit2.Tree)
            changed = [p for p, flags in repo.status(untracked_files="no").items() if flags]
        except _errors() as exc:
            return [f"the commit's objects cannot be read: {exc}"]
        try:
            for _commit in repo.walk(sha, pygit2.enums.SortMode.NONE):
                pass  # `git log` must work: every commit of its history is there
        except _errors() as exc:
            return [f"the commit's history is not all there (git log fails): {exc}"]
        return [f"{len(changed)} tracked file(s) differ from the commit, e.g. {changed[0]}"] if changed else []
