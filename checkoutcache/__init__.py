"""checkoutcache: a git checkout cache for shared per-repository containers.

`Cache(root).ensure(repo, commit)` answers ready (with the path of a complete
checkout), cloning, or failed. See README.md and layout.py for the on-disk
contract. This module imports only the ready path's light modules.
"""

from checkoutcache.answers import Answer
from checkoutcache.cache import Cache

__all__ = ["Answer", "Cache"]
