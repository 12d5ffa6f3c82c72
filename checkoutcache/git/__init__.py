"""git: every git operation, behind one interface.

- backend.py    the interface (GitBackend), keep-refs' name, failure codes.
- transport.py  `pick_backend`: the one place that chooses an implementation.
- cli.py      the implementation on the git CLI (the default where git exists).
- libgit2.py  the implementation on pygit2, for machines without git.
- mirror.py   stale git lock files in a mirror, found and removed.
- env.py      the environment every git process runs in (no ambient GIT_*,
              no prompts, only safe transports, credentials by environment).
- view.py     the private view of a mirror every network git runs in.
- quarantine.py  a partial fetch checked by fsck before it lands (git < 2.44).
- shallow.py  shallow mirrors: private fetches (depth 1, deepen) installed under the
              mirror lock, reachability and merge bases (mixed into the CLI backend).
- boundary.py   the shallow file itself: read, written, linked into checkouts.
- messages.py   what git's output says (progress, the failing line, a refused filter).
"""
