"""store: the cache root on disk, and the only code that touches it directly.

- layout.py     every path, the names' parsing, and the lock table (a contract).
- ready.py      the ready path: is a checkout published, mark it used (stdlib only).
- checkouts.py  how a checkout appears (publish, marker last) and leaves (trash).
- locks.py      flock primitives, and helpers named for each lock's purpose.
- records.py    whole-or-nothing JSON records; the failure record.
- scratch.py    clones' scratch directories: created by owner, reaped when dead.
- liveness.py   is the owner of something still the same live process.
- inventory.py  what a root holds, gathered read-only (gc and status share it);
                sizes recorded at publish and measured again only after a use.
- watch.py      waiting for a clone's outcome on an inotify watch, not by polling.
- create.py     creating a root and a repository's store on first use.
"""
