"""The answer to `ensure`: one attrs value, one JSON object, one exit status.

Exit statuses are a public contract (docs/errors.md): 0 ready, 75 cloning (EX_TEMPFAIL:
ask again later, or pass --wait), 1 failed, 2 bad input; exec passes its
command's status through and uses 125 when the command could not run.
"""

from __future__ import annotations

import enum

import attrs

from checkoutcache.errors import CheckoutCacheError, is_input_error


class State(enum.StrEnum):
    """The states of one commit (DESIGN.md). ABSENT is never answered: an absent
    commit starts a clone and is answered `cloning`."""

    READY = "ready"
    CLONING = "cloning"
    FAILED = "failed"
    ABSENT = "absent"


EXIT_READY = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_CLONING = 75
# exec: the checkout could not be provided, the command did not run (as docker/env use 125).
EXIT_EXEC_FAILED = 125


@attrs.frozen
class Answer:
    state: State
    commit: str | None
    repo: str | None
    path: str | None = None
    # Ready answers of commits with Git LFS files: "content", "pointers" or "off" (docs/repositories.md "Git LFS").
    lfs: str | None = None
    # For a commit with submodules: "included" (their work trees) or "none" (the setting).
    submodules: str | None = None
    # A sparse checkout's cone: the directories it holds (cones.py); None: the whole tree.
    sparse: list[str] | None = None
    # What the checkout's git has of the commit's history: "complete" (`git log` reaches the
    # root commit), or "shallow" (a cold node's first answer: the history follows in the
    # background; `history="full"` waits for it). Ready answers, and `cloning` ones that wait for it.
    history: str | None = None
    # With a base asked (`--base`): the base, and the merge base of the commit and it (a
    # review diffs merge_base..commit; the checkout's history reaches it).
    base: str | None = None
    merge_base: str | None = None
    pid: int | None = None
    # The owner's PID namespace: its pid names the owner only in that namespace.
    pid_namespace: str | None = None
    started_at: str | None = None
    progress: dict | None = None
    # A clone waiting for one of serve's clone slots (serve/admission.py): its place in its
    # caller's queue, how many wait and how many run.
    queue: dict | None = None
    error: str | None = None
    message: str | None = None
    next: str | None = None
    retry_after: int | None = None

    @property
    def exit_code(self) -> int:
        if self.state == State.READY:
            return EXIT_READY
        if self.state == State.CLONING:
            return EXIT_CLONING
        return EXIT_BAD_INPUT if is_input_error(self.error) else EXIT_FAILED

    def to_json(self) -> dict:
        # Field by field (attrs.asdict is ~10x slower: this is every answer of a sidecar).
        found = {name: getattr(self, name) for name in _FIELDS}
        found["state"] = str(self.state)
        return {k: v for k, v in found.items() if v is not None}

    @classmethod
    def from_error(cls, exc: CheckoutCacheError, commit: str | None = None,
                   repo: str | None = None, retry_after: int | None = None) -> "Answer":
        return cls(state=State.FAILED, commit=commit, repo=repo, error=exc.code,
                   message=exc.message, next=exc.next, retry_after=retry_after)


    @classmethod
    def from_json(cls, body: dict) -> "Answer":
        """The answer a serve sent (the typed client's, and a read-only reader's): its known
        fields (a newer server may add others); a state this version does not know is failed."""
        values = {k: v for k, v in body.items() if k in _FIELDS}
        values.setdefault("commit", None)
        values.setdefault("repo", None)
        try:
            values["state"] = State(values.get("state", "failed"))
        except ValueError:
            values["state"] = State.FAILED
        return cls(**values)


_FIELDS = tuple(field.name for field in attrs.fields(Answer))
