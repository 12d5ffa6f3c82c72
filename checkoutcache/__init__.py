"""checkoutcache: a git checkout cache for shared per-repository containers.

`Cache(root).ensure(repo, commit)` answers ready (with the path of a complete
checkout), cloning, or failed; `checkoutcache.client.Client` asks a sidecar
(`checkoutcache serve`) the same over HTTP. See README.md and store/layout.py
for the on-disk contract. This module imports only the ready path's light
modules.

The package, bottom layer first (each folder's __init__ says which file does what):

- errors, units, testhooks, credentials   the ground: codes, parsing, secrets
- config, repospec, answers                settings, what a request names, answers
- store/    the cache root on disk: paths, locks, records, checkouts, scratch
- git/      every git operation, behind one interface (git CLI or libgit2)
- clone/    making a checkout that is not ready: decide, coordinate, work
- cache     the library API (the ready path)
- workspaces  writable workspaces: a review's own tree of a commit (make_workspace)
- upkeep/   gc, eviction, verify, status
- serve/    the sidecar: HTTP, service, policy, metrics
- cli/, client   the command line; the sidecar's typed client
"""

__all__ = ["Answer", "Cache", "make_workspace"]


def __getattr__(name: str):
    # Imported on first use, so that `python -m checkoutcache` can answer a ready
    # checkout before attrs is imported (cli/fast.py).
    if name == "Cache":
        from checkoutcache.cache import Cache

        return Cache
    if name == "Answer":
        from checkoutcache.answers import Answer

        return Answer
    if name == "make_workspace":
        from checkoutcache.workspaces import make_workspace

        return make_workspace
    raise AttributeError(name)
