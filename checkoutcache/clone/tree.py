"""Building a commit's tree in the worker's scratch: the checkout, its completeness, its
submodules, and recycled trees (spares).

The worker (worker.py) owns the process: the clone lock, the mirror, the timeout, the
kill and the publish. This module owns what lies between "the mirror has the commit"
and "scratch/tree holds exactly that commit": `TreeBuilder.build()` returns what the
ready marker will say of the tree, which the worker then publishes.

Two ways to a tree:

- fresh: `git checkout` into an empty scratch/tree (a mirror whose objects cannot be
  read is rebuilt once and the checkout retried);
- recycled: a spare (store/spares.py) of the same repository, cone, LFS and submodule
  settings and conversion (the digest its marker recorded of our checkout config, the
  attribute sources, the umask and git: git/backend.py checkout_conversion), the nearest
  in history, whose top-level `.gitattributes` and `.lfsconfig` are those of the commit
  (one diff-tree of the two commits' trees; else it is left for another commit), taken
  by one rename into our scratch and updated
  in place. Nothing in it is trusted but what we can prove: its .git is deleted and
  made anew, its index is used only if its identity (inode, ctime, size) is the one
  recorded when the checkout was published (no process can set a ctime back). With
  that index, first everything it does not vouch for goes, beneath the tree: what `find`
  shows (`.git` entries below the top, fifos, sockets, and every file or symlink whose
  ctime is newer than the index, to the nanosecond: a chmod, a hard link or an edit
  git's whole-second stat would miss; directory modes are set back and ACLs dropped),
  what git lists as untracked (ignored too, empty directories, nested repositories; a
  listing run beside find is used only if find met no nested `.git`, whose HEAD git
  opens: a fifo there would block it) and every gitlink's contents. Only then
  `git read-tree --reset -u` writes anew every path whose stat differs from the index
  and every path the commit changes: its check of every entry is the proof of the
  tracked files, and it holds because nothing it could be misled by is left (its lstat
  follows a symlink a reader put in place of a tracked directory, it reads a
  .gitattributes the index lacks from the work tree, and it compares ctime by the
  second: all gone before it runs). Its check says a kept file's bytes are what the
  spare's commit wrote; they are ours only if that blob is written alike in both commits,
  so every path beneath a directory whose `.gitattributes` the two commits differ in is
  deleted first too (read-tree keeps an entry whose blob and stat did not change as the
  old attributes wrote it: LF where ours say CRLF, `$Id$` unexpanded, a pointer where
  ours say LFS content). Every other input of git's conversion is the same by the
  conversion digest and git_env (no machine's or user's attributes file, no
  .git/info/attributes: .git is made anew). This holds whoever changed the tree
  (the writer's own uid in the one-writer mode, a peer in the group mode): none of it
  rests on who may write. Any doubt, and the spare is dropped and the tree is made
  fresh: a spare only ever saves time.

DESIGN invariant 1 is kept by both ways alike: the tree is built in scratch and
published by the worker's one rename, marker last. A worker killed anywhere in an
update leaves the spare in its scratch, reaped with it (invariant 3).
"""

from __future__ import annotations

import os
import stat
import time
from typing import Any, Callable

from checkoutcache.errors import CheckoutCacheError
from checkoutcache.git.backend import lfs_checkout_config, lfs_endpoint
from checkoutcache.repospec import LFS_OFF, SUBMODULES_NONE
from checkoutcache.store import records
from checkoutcache.store import tree as store_tree
from checkoutcache.store.beneath import Escape, components, open_dir_beneath
from checkoutcache.store.checkouts import remove_tree
from checkoutcache.store.layout import RepoPaths, RootPaths
from checkoutcache.store.sizes import index_identity
from checkoutcache.store.spares import Spare, list_spares, take_spare
from checkoutcache.testhooks import checkpoint

# The spares whose distance in history is measured (one git execution each), newest first.
NEAREST_OF = 4


# The ACLs a reader may have set on a directory (setfacl): dropped with the mode set back.
ACL_ATTRIBUTES = ("system.posix_acl_default", "system.posix_acl_access")


def restore_directory(fd: int, mode: int) -> None:
    """A directory (by descriptor) as a fresh checkout makes it: its mode, no ACL."""
    os.fchmod(fd, mode)
    for name in ACL_ATTRIBUTES:
        try:
            os.removexattr(fd, name)
        except OSError:
            pass  # none there (ENODATA), or a file system without ACLs


def current_umask() -> int:
    """The process's umask (the worker set the store's, store/modes.py): what files get their modes from."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


class SpareUnusable(Exception):
    """A spare that cannot be proven exact: dropped, and the tree made fresh."""


class TreeBuilder:
    """The tree of one worker's clone. worker: the clone worker (worker.Worker: its paths,
    commit, cone, backend, LFS settings, log and progress, scratch and clone timeout);
    run_inline: how a submodule's clone runs inside this worker (worker.run_inline)."""

    def __init__(self, worker: Any, run_inline: Callable[..., None]):
        self.w = worker
        self.run_inline = run_inline
        self.submodule_lfs: str | None = None  # what the submodules' LFS files hold, if they have any
        self.index: list[int] | None = None  # the published tree's index identity (spares trust it)
        self.recycled_from: str | None = None  # the spare's checkout name, when one was used
        self._conversion: str | None = None

    # ------------------------------------------------------------ the tree
    def build(self) -> dict:
        """scratch/tree holding exactly the commit; what its marker says (LFS, submodules, cone)."""
        w = self.w
        if not self.recycle():
            self.checkout_fresh()
        w.log("checked out" if self.recycled_from is None else f"checked out (updated spare of {self.recycled_from})")
        if w.lfs_answer in ("pointers", LFS_OFF) and not w.backend.lfs_in_tree(w.scratch.tree):
            w.lfs_answer = w.lfs_why = None  # no LFS files: nothing to say
        checkpoint("after-checkout")
        lfs = {"lfs": w.lfs_answer, "lfs_why": w.lfs_why} if w.lfs_answer else {}
        extra = {**lfs, **self.add_submodules()}
        checkpoint("after-submodules")
        # Last: nothing writes the index after this (submodules have indexes of their own).
        self.index = index_identity(os.path.join(w.scratch.tree, ".git"))
        return {**extra, **self.cone_marker(), **self.conversion_marker()}

    def checkout_fresh(self) -> None:
        w = self.w
        if os.path.isdir(w.scratch.tree) and os.listdir(w.scratch.tree):
            raise CheckoutCacheError("CLONE_FAILED", detail=f"the scratch tree {w.scratch.tree} is not empty: a "
                                                            f"checkout is only ever made into an empty one")
        try:
            w.backend.checkout(w.scratch.tree, w.paths.mirror_objects, w.sha, w.on_progress, w.log, w.lfs_config,
                               cone=w.cone)
        except CheckoutCacheError as exc:
            if exc.code == "DISK_FULL" or w.backend.objects_readable(w.paths.mirror, w.sha, w.cone):
                raise  # the tree itself cannot be checked out: no rebuild would help
            # The mirror opened but the commit's objects cannot be read (a truncated
            # pack, a lost object): rebuild it once, restoring what other checkouts borrow.
            w.log(f"the mirror is corrupt ({exc.detail}); rebuilding it")
            remove_tree(w.scratch.tree)
            w.fetch_into_mirror(rebuild=True)
            w.backend.checkout(w.scratch.tree, w.paths.mirror_objects, w.sha, w.on_progress, w.log, w.lfs_config,
                               cone=w.cone)

    def cone_marker(self) -> dict:
        """What the marker records of a sparse checkout: its cone (the answer says it)."""
        return {"sparse": list(self.w.cone)} if self.w.cone else {}

    def conversion_marker(self) -> dict:
        """What the marker records of how the tree's files were written, besides the commit's
        own attributes: whether the top-level tree went through git-lfs's smudge filter
        (verify expects LFS content, else pointers) and, where spares are made, the digest of
        everything else (git/backend.py checkout_conversion), which a spare must share with
        the commit it is updated into."""
        marker: dict = {"lfs_filter": self.w.lfs_config is not None}
        conversion = self.conversion()
        if conversion is not None:
            marker["conversion"] = conversion
        return marker

    def conversion(self) -> str | None:
        """checkout_conversion of this worker's checkouts (None where spares are not made)."""
        if self._conversion is None and getattr(self.w.backend, "supports_spares", False):
            self._conversion = self.w.backend.conversion(current_umask())
        return self._conversion

    # ------------------------------------------------------------ recycled trees
    def fits(self, spare: Spare) -> bool:
        """A spare of the same cone, LFS and submodule settings, written with the same
        conversion (checkout_conversion: config, attribute sources, umask, git): every file
        it holds that the commits share, under .gitattributes they share, is then already
        what a fresh checkout would write (recycle() checks the .gitattributes)."""
        w = self.w
        record = spare.record
        if not record.get("index") or spare.cone_digest != w.name.partition("-")[2]:
            return False
        if record.get("conversion") is None or record.get("conversion") != self.conversion():
            return False  # (a spare of a version that recorded none: how it was written is unknown)
        if tuple(record.get("sparse") or ()) != tuple(w.cone):
            return False
        if record.get("submodules_setting", w.submodules_setting) != w.submodules_setting:
            return False
        content = w.lfs_config is not None
        was = record.get("lfs")
        return was is None or (was == "content") == content

    def nearest_spares(self) -> list[Spare]:
        w = self.w
        fitting = [s for s in reversed(list_spares(w.paths)) if self.fits(s)][:NEAREST_OF]
        if len(fitting) < 2:
            return fitting
        distance = {s.entry: w.backend.commit_distance(w.paths.mirror, s.sha, w.sha) for s in fitting}
        return sorted(fitting, key=lambda s: (distance[s.entry] is None, distance[s.entry] or 0))

    def recycle(self) -> bool:
        """Update the nearest fitting spare into scratch/tree; False when there is none
        (or none could be proven exact: then the tree is made fresh)."""
        w = self.w
        if not getattr(w.backend, "supports_spares", False) or not os.path.isdir(w.paths.spares_dir):
            return False
        for spare in self.nearest_spares():
            # Before it is taken: a spare whose top-level attributes differ is left for another commit.
            rewrite = w.backend.attribute_changes(w.paths.mirror, spare.sha, w.sha)
            if rewrite is None or b"" in rewrite:
                w.log(f"spare of {spare.name} not used: " + (
                    "its commit's trees cannot be read" if rewrite is None else
                    "the top-level .gitattributes or .lfsconfig differs (every file may be written otherwise)"))
                continue
            taken = take_spare(w.paths, spare, w.scratch.path)
            if taken is None:
                continue  # another worker took it first
            checkpoint("spare-taken")
            started = time.monotonic()
            try:
                self.update(taken, spare, rewrite)
            except (SpareUnusable, CheckoutCacheError, OSError) as exc:
                if isinstance(exc, CheckoutCacheError) and exc.code == "DISK_FULL":
                    raise
                w.log(f"spare of {spare.name} not used: {exc}; checking out afresh")
                removal = remove_tree(w.scratch.tree)
                if not removal.complete:
                    # What could not be deleted (an immutable file, a peer's directory) never
                    # reaches the fresh checkout: the tree goes back into the spare's slot in our
                    # scratch (a rename works whatever it holds), reaped with the scratch.
                    w.log(f"the spare's tree could not be emptied ({removal.unremovable[0].path or '.'}: "
                          f"{removal.unremovable[0].error}); set aside in the scratch")
                    try:
                        store_tree.rename(w.scratch.tree, RepoPaths.spare_tree(taken))
                    except OSError as moved:
                        raise CheckoutCacheError("CLONE_FAILED", detail=f"a spare's tree that could not be "
                                                 f"emptied could not be set aside either: {moved}") from None
                remove_tree(taken)
                records.remove_quietly(RepoPaths.scratch_index(w.scratch.path))
                return False
            remove_tree(taken)
            self.recycled_from = spare.name
            w.log(f"updated the spare of {spare.name} in {time.monotonic() - started:.3f}s")
            return True
        return False

    def update(self, taken: str, spare: Spare, rewrite: list[bytes]) -> None:
        """The spare (in our scratch) made sha's tree in place; rewrite: the directories whose
        .gitattributes the spare's commit and sha differ in (attribute_changes), whose every
        path is written anew."""
        w = self.w
        tree = w.scratch.tree
        last = [time.monotonic()]

        def step(name: str) -> None:
            """A kill point of the fault tests, and how long the step before it took (the log)."""
            now = time.monotonic()
            w.log(f"spare: {name} ({now - last[0]:.3f}s)")
            last[0] = now
            checkpoint(name)

        store_tree.rename(RepoPaths.spare_tree(taken), tree)
        git_dir = os.path.join(tree, ".git")
        if index_identity(git_dir) != list(spare.record["index"]):
            raise SpareUnusable("its index changed since it was published")
        # The verified index waits in our scratch while the rest of .git (config, hooks,
        # objects, refs: all a reader could have written) goes.
        index = RepoPaths.scratch_index(w.scratch.path)
        store_tree.rename(os.path.join(git_dir, "index"), index)
        removal = remove_tree(git_dir)
        if not removal.complete:
            raise SpareUnusable(f"its .git could not be removed ({removal.unremovable[0].error})")
        if rewrite:
            self.remove_attributed(tree, rewrite)
        step("spare-old-git-removed")
        w.on_progress({"phase": "checking out"})
        w.backend.prepare_update(tree, index, w.paths.mirror_objects, w.sha, w.lfs_config, cone=w.cone)
        step("spare-after-git-dir")
        # Before git's update, as `git clean` would, but with what clean never sees: read-tree's
        # check of the tracked files holds only with nothing untracked left (a symlink standing
        # in for a tracked directory, a .gitattributes the index lacks).
        self.clear_leftovers(tree)
        if w.cone:
            self.remove_outside_cone(tree)
        step("spare-after-leftovers")
        w.backend.update_tree(tree, w.sha, w.on_progress, w.log, w.lfs_config)
        step("spare-after-checkout")

    def remove_attributed(self, tree: str, dirs: list[bytes]) -> None:
        """Every path beneath a directory whose .gitattributes the spare's commit and ours
        differ in, gone (a .gitattributes applies to its directory's paths only; the top's,
        which alone may define macros, never gets here): read-tree then writes each anew,
        with our commit's attributes. It would keep an entry whose blob and stat did not
        change as the spare's attributes wrote it (LF where ours say CRLF, `$Id$` unexpanded,
        an LFS pointer where ours say content)."""
        unique = sorted(set(dirs))
        tops = [d for d in unique if not any(d.startswith(other + b"/") for other in unique if other != d)]
        for rel in tops:
            try:
                components(rel)
            except Escape as exc:
                raise SpareUnusable(f"a directory of attributes cannot be resolved: {exc}") from None
            removal = remove_tree(os.path.join(tree, os.fsdecode(rel)))
            if not removal.complete:
                raise SpareUnusable(f"a directory whose attributes changed could not be emptied: {rel[:200]!r}")
        self.w.log(f"spare: {len(tops)} directory(ies) whose .gitattributes changed, written anew")

    def clear_leftovers(self, tree: str) -> None:
        """Everything of the tree its (verified) index does not vouch for, gone. find: `.git`
        entries below the top, fifos and sockets, and every file or symlink changed since the
        index was written (its ctime, to the nanosecond, newer than the index's mtime: a
        chmod, a hard link or an edit git's whole-second stat would miss); directories get
        their mode back and lose any ACL. git: what it does not track (ignored too, empty and
        nested-repository directories) and every gitlink, whose contents go (populated anew
        later). The three walks run side by side; git's untracked listing is trusted only if
        find met no `.git` below the top (git opens a nested repository's HEAD: a fifo there
        blocks it), else it is stopped and run again once those are gone."""
        w = self.w
        finder = self.find_leftovers(tree)
        listings = [finder]
        try:
            untracked = w.backend.untracked(tree)
            listings.append(untracked)
            gitlinks = w.backend.gitlinks(tree)
            listings.append(gitlinks)
            found = finder.result()
            nested = any(entry.startswith(b"G") for entry in found)
            if nested:
                untracked.cancel()
            self.apply_found(tree, found)
            if nested:
                untracked = w.backend.untracked(tree)  # no nested .git left to block it
                listings.append(untracked)
            entries, links = untracked.result(), gitlinks.result()
        finally:
            for listing in listings:
                listing.cancel()  # a no-op for one read to its end; else its process and pipes go
        for rel in entries:
            removal = remove_tree(os.path.join(tree, os.fsdecode(rel)))
            if not removal.complete:
                raise SpareUnusable(f"an untracked entry could not be removed: {rel[:200]!r}")
        for rel in links:
            self.empty_directory(rel)

    def empty_directory(self, rel: bytes) -> None:
        """Empty a gitlink's directory of the spare (a submodule is populated anew, as in a fresh
        tree), resolved beneath the tree without following a symlink."""
        tree_fd = os.open(self.w.scratch.tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            parent, _, name = rel.rpartition(b"/")
            try:
                parent_fd = open_dir_beneath(tree_fd, parent) if parent else os.dup(tree_fd)
            except FileNotFoundError:
                return  # git makes it
            except (Escape, NotADirectoryError) as exc:  # every untracked entry is gone already: a doubt
                raise SpareUnusable(f"a submodule's directory could not be reached: {rel[:200]!r}") from exc
            try:
                try:
                    info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                except FileNotFoundError:
                    return
                if not stat.S_ISDIR(info.st_mode):
                    os.unlink(name, dir_fd=parent_fd)
                else:  # by its path under the root: remove_tree never follows a symlink on the way
                    removal = remove_tree(os.path.join(self.w.scratch.tree, os.fsdecode(rel)))
                    if not removal.complete:
                        raise SpareUnusable(f"a submodule could not be emptied: {rel[:200]!r}")
                os.mkdir(name, 0o777, dir_fd=parent_fd)
            finally:
                os.close(parent_fd)
        finally:
            os.close(tree_fd)

    def remove_outside_cone(self, tree: str) -> None:
        """A sparse checkout holds the cone's directories, their parents, and the files directly
        in those parents: any other directory goes. git would never look: a sparse index holds
        one entry for a directory outside the cone, and clean and status take it as tracked."""
        cone = [tuple(os.fsencode(d).strip(b"/").split(b"/")) for d in self.w.cone]
        inside = set(cone)
        parents = {d[:i] for d in cone for i in range(len(d))}
        tree_fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for parent in sorted(parents, key=len):
                try:
                    fd = open_dir_beneath(tree_fd, b"/".join(parent)) if parent else os.dup(tree_fd)
                except (Escape, FileNotFoundError):
                    continue  # not a directory: git's read-tree made what the cone needs, or will say
                try:
                    for entry in os.scandir(fd):
                        name = os.fsencode(entry.name)
                        if parent == () and name == b".git":
                            continue
                        if entry.is_dir(follow_symlinks=False) and parent + (name,) not in inside | parents:
                            removal = remove_tree(os.path.join(tree, os.fsdecode(b"/".join(parent + (name,)))))
                            if not removal.complete:
                                raise SpareUnusable(f"a directory outside the cone could not be removed: {name!r}")
                finally:
                    os.close(fd)
        finally:
            os.close(tree_fd)

    def directory_mode(self, tree: str) -> int:
        """A directory's mode as a fresh checkout in our scratch makes it."""
        return (0o777 & ~current_umask()) | (stat.S_ISGID if os.stat(self.w.scratch.path).st_mode & stat.S_ISGID
                                             else 0)

    def find_leftovers(self, tree: str):
        """Start one walk (find, lstat of every entry, never following a symlink) for what git
        lists nowhere or would miss: a Listing whose result() is its entries, each a kind letter
        and a path: G a nested .git, O a fifo or socket, C a file or symlink changed since
        .git/index was written, D a directory of another mode or changed since (an ACL a reader
        set on it)."""
        from checkoutcache.git.cli import Listing  # spares are the git CLI transport's

        mode = self.directory_mode(tree)
        newer = ["-cnewer", ".git/index"]  # ctime against the index's mtime, in nanoseconds
        return Listing(
            ["find", ".", "-mindepth", "1", "(", "-path", "./.git", "-prune", ")", "-o",
             "(", "-name", ".git", "-printf", "G%P\\0", "-prune", ")", "-o",
             "(", "-type", "d", "(", "!", "-perm", f"{mode:o}", "-o", *newer, ")", "-printf", "D%P\\0", ")", "-o",
             "(", "!", "-type", "d", "!", "-type", "f", "!", "-type", "l", "-printf", "O%P\\0", ")", "-o",
             "(", "!", "-type", "d", *newer, "-printf", "C%P\\0", ")"],
            lambda out: [entry for entry in out.split(b"\0") if entry], cwd=tree)

    def apply_found(self, tree: str, found: list[bytes]) -> None:
        """Delete what find_leftovers found (read-tree writes anew what is tracked of it); set
        directories' modes back and drop their ACLs (a default ACL would give every file read-tree
        writes there its mode, whatever the umask)."""
        mode = self.directory_mode(tree)
        tree_fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            restore_directory(tree_fd, mode)
            entries = [(e[:1], e[1:]) for e in found]
            # Directories first (find prints none below a nested .git): one a reader made
            # read-only would refuse the deletions in it.
            for rel in (rel for kind, rel in entries if kind == b"D"):
                try:  # opened beneath the tree: a leading component that is no directory is never followed
                    fd = open_dir_beneath(tree_fd, rel)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                except Escape as exc:
                    raise SpareUnusable(f"a directory could not be reached beneath the tree: {rel[:200]!r}") from exc
                try:
                    restore_directory(fd, mode)
                finally:
                    os.close(fd)
            for rel in (rel for kind, rel in entries if kind != b"D"):
                if not remove_tree(os.fsdecode(os.path.join(os.fsencode(tree), rel))).complete:
                    raise SpareUnusable(f"an entry git cannot vouch for could not be removed: {rel[:200]!r}")
        finally:
            os.close(tree_fd)

    # ------------------------------------------------------------ submodules
    def add_submodules(self) -> dict:
        """The commit's submodules, checked out in our scratch tree (clone/submodules.py);
        what the marker records of them ({} for a commit without submodules)."""
        w = self.w
        urls = w.backend.gitmodules(w.paths.mirror, w.sha)
        if not urls:
            return {}  # most commits: clone/submodules.py is not even imported
        if w.submodules_setting == SUBMODULES_NONE:
            return {"submodules": "none"}  # only whether the commit has submodules, for the answer
        from checkoutcache.clone.submodules import submodules_in

        tree_fd = os.open(w.scratch.tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            subs = submodules_in(w.backend, w.scratch.tree, w.paths.mirror, w.sha, w.url,
                                 cone=w.cone, urls=urls)
            if not subs:
                return {}
            w.on_progress({"phase": "checking out submodules"})
            borrowed = self.populate_submodules(tree_fd, subs)
        finally:
            os.close(tree_fd)
        marker = {"submodules": "included", "borrows": borrowed}
        if self.submodule_lfs is not None and w.lfs_answer in (None, "content"):
            # What the answer says of LFS files covers the submodules' too: pointers anywhere say so.
            marker["lfs"] = self.submodule_lfs if self.submodule_lfs != "content" else "content"
        return marker

    def populate_submodules(self, tree_fd: int, subs: list) -> list[list[str]]:
        from checkoutcache.clone.submodules import Budget, ensure_in_store, making, populate, submodules_in

        w = self.w
        root = w.paths.root
        deadline = time.monotonic() + max(1.0, w.remaining())
        budget = Budget(w.config.max_submodules, w.config.max_submodule_bytes)

        def ensure(url: str, sha: str, wait: float) -> str:
            return ensure_in_store(root, w.config, w.scope, url, sha, wait, self.run_inline,
                                   super_is_local=w.is_local)

        def checkout(where: str, where_fd: int, key: str, sha: str) -> None:
            store = RootPaths(root).repo(key)
            lfs = None
            if w.backend.lfs_objects(store.mirror, sha):
                # The submodule's own clone put its LFS objects in its repository's store:
                # checked out from there with content where we can, else the answer says so.
                reason = LFS_OFF if w.lfs_setting == LFS_OFF else w.backend.lfs_unsupported()
                if reason is None:
                    info = records.read_json(store.repo_json, records.REPO) or {}
                    lfs = lfs_checkout_config(store.lfs_store, lfs_endpoint(info.get("url", ""),
                                                                            bool(info.get("is_local"))))
                    self.submodule_lfs = self.submodule_lfs or "content"
                else:
                    self.submodule_lfs = LFS_OFF if reason == LFS_OFF else "pointers"
            w.backend.checkout(where, store.mirror_objects, sha, lambda _update: None, w.log, lfs,
                               keep_fds=(where_fd,))

        def submodules_at(where: str, where_fd: int, key: str, url: str, sha: str):
            return submodules_in(w.backend, where, RootPaths(root).repo(key).mirror, sha, url, (where_fd,))

        # On the chain of superprojects populating their submodules (a cycle is seen at once).
        with making(w.paths.key, w.sha):
            return populate(tree_fd, subs, deadline, 1, budget, ensure, checkout, submodules_at, w.log)
