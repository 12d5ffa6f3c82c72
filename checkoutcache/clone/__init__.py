"""clone: making a commit's checkout when it is not ready.

- decide.py       pure decisions: a commit's state, what to do with an absent
                  or failed commit, back-off.
- coordinator.py  the slow path of ensure: one look, start exactly one clone,
                  wait within the caller's limit.
- spawn.py        starting a detached clone worker that inherits the clone lock:
                  forked (the CLI), from the worker server (serve), or spawned.
- workserver.py   serve's pre-forked worker server: workers without a Python start.
- worker.py       the worker: scratch, fetch into the mirror, check out, publish.
- tree.py         the tree in scratch: a fresh checkout or a recycled spare, submodules.
- submodules.py   a checkout's submodules, each a repository of the store.
- history.py      after a shallow first answer: the background history of the mirror,
                  and the merge base a review asks for (`--base`).
- process.py      what the worker and the history's process share: log, SIGTERM, counts.
"""
