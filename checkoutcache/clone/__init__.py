"""clone: making a commit's checkout when it is not ready.

- decide.py       pure decisions: a commit's state, what to do with an absent
                  or failed commit, back-off.
- coordinator.py  the slow path of ensure: one look, start exactly one clone,
                  wait within the caller's limit.
- spawn.py        starting a detached clone worker that inherits the clone lock:
                  forked (the CLI), from the worker server (serve), or spawned.
- workserver.py   serve's pre-forked worker server: workers without a Python start.
- worker.py       the worker: scratch, fetch into the mirror, check out, publish.
"""
