"""Every error checkoutcache can answer with: one table of stable codes.

Each code has a kind ("input": the caller's arguments are wrong, exit 2, nothing
was written; "failure": the attempt failed, exit 1, the commit backs off), a
message template and the next step a caller should take. Every failure path
picks a code from this table; nothing formats an ad-hoc error string. The codes
are a public contract (documented in docs/errors.md): add codes, never rename them.
"""

from __future__ import annotations

import errno
from typing import NamedTuple

INPUT = "input"
FAILURE = "failure"


class ErrorCode(NamedTuple):
    # A NamedTuple, not attrs: the CLI's ready answer imports this module and must
    # stay close to a bare Python start (attrs alone costs ~13 ms to import).
    code: str
    kind: str
    message: str
    next: str
    http: int | None = None  # serve's HTTP status; default 400 for input, 503 for failure

    @property
    def http_status(self) -> int:
        return self.http if self.http is not None else (400 if self.kind == INPUT else 503)


_TABLE = [
    ErrorCode("BAD_COMMIT", INPUT,
              "the commit must be a full 40-hex commit id, got {got}",
              "pass the full id, for example the output of `git rev-parse <branch>`"),
    ErrorCode("BAD_REPO", INPUT,
              "the repository argument is not usable: {why}",
              "pass an https://, ssh://, git:// or file:// URL, user@host:path, or an absolute path"),
    ErrorCode("UNSAFE_TRANSPORT", INPUT,
              "the transport {scheme!r} is not allowed",
              "use https://, ssh://, git://, file:// or a local path"),
    ErrorCode("BAD_SCOPE", INPUT,
              "the scope must be 1-64 of [A-Za-z0-9._-], not starting with '.' or '-', got {got}",
              "pass a short name such as a tenant or deployment id"),
    ErrorCode("BAD_ARGUMENT", INPUT,
              "{what}",
              "see `checkoutcache --help` for the accepted forms"),
    ErrorCode("NOT_A_COMMIT", INPUT,
              "{commit} is {what}, not a commit",
              "pass a commit id, for example the output of `git rev-parse <tag>^{commit}`"),
    ErrorCode("NOT_A_REPOSITORY", INPUT,
              "{path} is not a git repository",
              "pass the path of a git repository (its work tree or its .git/bare directory)"),
    ErrorCode("IN_USE", FAILURE,
              "not everything asked could be evicted: {detail}",
              "a checkout an exec or hold uses, or a running clone, is never evicted: wait until it "
              "ends; one used within its grace window goes with --force", 409),
    ErrorCode("ROOT_UNUSABLE", FAILURE,
              "the cache root {root} cannot be used: {why}",
              "pass --root (or set CHECKOUTCACHE_ROOT) to a writable local directory"),
    ErrorCode("SETTINGS_MISMATCH", INPUT,
              "this reader keys repositories with {setting}={ours}, the writer with {theirs}: its checkouts "
              "are not the ones this reader would use",
              "set CHECKOUTCACHE_LFS and CHECKOUTCACHE_SUBMODULES in the reader as the writer has them "
              "(docs/deployment.md, one writer)", http=409),
    ErrorCode("NO_WRITER", FAILURE,
              "the cache root {root} is read-only here and its writer did not answer: {why}",
              "run `checkoutcache serve` as the store's writer and set CHECKOUTCACHE_API_URL (with "
              "CHECKOUTCACHE_API_TOKEN) to it, or use a root this user may write (docs/deployment.md)"),
    ErrorCode("UNREACHABLE", FAILURE,
              "the repository could not be reached: {detail}",
              "check the URL, the network and the credentials; it is retried after the back-off"),
    ErrorCode("UNKNOWN_COMMIT", FAILURE,
              "commit {commit} is not in the repository (fetched by id and all refs): {detail}",
              "check that the commit was pushed; it is retried after the back-off"),
    ErrorCode("TIMEOUT", FAILURE,
              "the clone did not finish within {limit}",
              "raise CHECKOUTCACHE_CLONE_TIMEOUT if the repository is large; retried after the back-off"),
    ErrorCode("DISK_FULL", FAILURE,
              "the disk under the cache root is full: {detail}",
              "run `checkoutcache gc` (or free space) and ask again"),
    ErrorCode("CLONE_FAILED", FAILURE,
              "the clone failed: {detail}",
              "see the clone log named in `checkoutcache status`; it is retried after the back-off"),
    ErrorCode("LFS_FAILED", FAILURE,
              "the Git LFS content of the commit could not be fetched: {detail}",
              "check the LFS server, its quota and that every LFS object was pushed; it is retried after the back-off"),
    ErrorCode("SUBMODULE_FAILED", FAILURE,
              "submodule {path} ({url}) could not be checked out: {detail}",
              "check the submodule's URL in .gitmodules and that its commit was pushed; retried after the back-off"),
    ErrorCode("BUNDLE_FAILED", FAILURE,
              "no bundle of {repo} could be made: {detail}",
              "see the message; seeding nodes go on with the bundles listed before"),
    ErrorCode("BUNDLE_STORE_FAILED", FAILURE,
              "the bundle store {where} could not be used: {detail}",
              "check the location (--to or CHECKOUTCACHE_BUNDLE_URI), that it is reachable, and its credentials "
              "(the AWS environment for s3://); seeding nodes go on with the bundles listed before"),
    ErrorCode("HISTORY_FAILED", FAILURE,
              "the history of the repository could not be fetched: {detail}",
              "the checkout stays usable with the history it has (`history` in the answer); the history is "
              "fetched again after the back-off (`checkoutcache status` says why it failed)"),
    ErrorCode("NO_MERGE_BASE", FAILURE,
              "commits {commit} and {base} have no common history: no merge base",
              "compare against the base commit itself, or check that --base names the review's base branch"),
    ErrorCode("WORKER_DIED", FAILURE,
              "the clone worker died {deaths} times in a row without finishing (killed, or out of memory?)",
              "check the machine's memory and the clone log; it is retried after the back-off"),
    ErrorCode("NEWER_LAYOUT", FAILURE,
              "the store of {repo} was written by a newer checkoutcache (layout version {found}; this one "
              "knows up to {known}): refused, nothing was changed",
              "run the newer checkoutcache on this root (or give this version a root of its own with --root); "
              "an older version writing a newer store could corrupt it"),
    ErrorCode("INTERNAL_ERROR", FAILURE,
              "checkoutcache failed unexpectedly: {detail}",
              "this is a bug: report it with the output of `checkoutcache status`; the store is left consistent"),
    ErrorCode("WORKER_START_FAILED", FAILURE,
              "the clone worker could not be started: {detail}",
              "check that the Python running checkoutcache can start subprocesses"),
    # Writable workspaces (workspaces.py): a review's own tree of a commit.
    ErrorCode("WORKSPACES_UNUSABLE", FAILURE,
              "the workspaces directory {where} cannot be used: {why}",
              "set CHECKOUTCACHE_WORKSPACES (or --workspaces) to a directory this user can write"),
    ErrorCode("WORKSPACE_FAILED", FAILURE,
              "the workspace could not be made: {detail}",
              "free space where workspaces go (`checkoutcache status` lists them) and ask again"),
    ErrorCode("UNKNOWN_WORKSPACE", INPUT,
              "{what} is not a workspace in {where}",
              "pass the path `checkoutcache workspace create` printed (`checkoutcache workspace list` shows them)",
              http=404),
    ErrorCode("WORKSPACE_OWNED", INPUT,
              "the workspace belongs to process {pid}, not to a keeper of this user: it goes when that process ends",
              "end the owning process, or remove the workspace from within it"),
    # The HTTP API's own answers (serve): no commit is involved.
    ErrorCode("UNKNOWN_HOLD", INPUT,
              "no such hold (released, expired, or never made)",
              "hold again with POST /v1/hold", http=404),
    ErrorCode("NOT_FOUND", INPUT,
              "no such endpoint: {what}",
              "see the README's endpoint table (GET /openapi.json)", http=404),
    ErrorCode("METHOD_NOT_ALLOWED", INPUT,
              "{method} is not an operation of {path}",
              "use a method the Allow header lists", http=405),
    ErrorCode("UNAUTHORIZED", INPUT,
              "this request needs a valid bearer token",
              "send `Authorization: Bearer <token>` with the token the platform gave this container", http=401),
    ErrorCode("FORBIDDEN_ORIGIN", INPUT,
              "requests from a browser page or through another host name are refused ({why})",
              "call the API directly (no Origin header) at the address it listens on", http=403),
    ErrorCode("FORBIDDEN_REPOSITORY", INPUT,
              "the API may not name this repository: {why}",
              "ask the operator to allow it (serve --allow-repo), or use the CLI with your own rights", http=403),
    ErrorCode("FORBIDDEN_SCOPE", INPUT,
              "this token may not use scope {scope!r}",
              "use a scope the token was given, or ask the operator for one", http=403),
    ErrorCode("FORBIDDEN_ENDPOINT", INPUT,
              "this token may not call {endpoint} (it may: {can})",
              "use a token whose can= lists it (docs/http-api.md, \"Tokens\"): the one code under review "
              "can read never runs gc or reads every scope's status", http=403),
    ErrorCode("TOO_MANY_HOLDS", FAILURE,
              "too many holds ({held} held, at most {limit} {whose})",
              "release holds you no longer need (POST /v1/release) and retry after Retry-After", http=429),
    ErrorCode("PAYLOAD_TOO_LARGE", INPUT,
              "the request body is larger than {limit} bytes",
              "send a JSON object of a few fields", http=413),
    ErrorCode("SERVER_BUSY", FAILURE,
              "the server is at its limit: {why}",
              "retry after Retry-After", http=503),
    ErrorCode("SHUTTING_DOWN", FAILURE,
              "the server is stopping (SIGTERM)",
              "retry after Retry-After, at the restarted sidecar", http=503),
]

CODES: dict[str, ErrorCode] = {e.code: e for e in _TABLE}


class CheckoutCacheError(Exception):
    """An error with a code from the table, carried to the answer or exit status.

    Every failure is this type, git's included: `detail` is the one redacted
    line the message shows, `output` what the failing git printed (redacted;
    kept for the log, never for a decision).
    """

    def __init__(self, code: str, output: str = "", **fields: object):
        entry = CODES[code]
        self.code = code
        self.kind = entry.kind
        self.detail = str(fields.get("detail", ""))
        self.output = output
        self.message = entry.message.format(**fields)
        self.next = entry.next
        super().__init__(f"{code}: {self.message}")


def describe(code: str, **fields: object) -> tuple[str, str]:
    """(message, next) for a code, formatted."""
    entry = CODES[code]
    return entry.message.format(**fields), entry.next


def is_input_error(code: str | None) -> bool:
    return code is not None and code in CODES and CODES[code].kind == INPUT


def is_disk_full(exc: BaseException) -> bool:
    """An OSError that says the disk (or the caller's quota) is full."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: OSError) -> CheckoutCacheError:
    """DISK_FULL for a write that met ENOSPC: every such write on the ensure and gc paths says this."""
    where = f" writing {exc.filename}" if isinstance(exc.filename, str) else ""
    return CheckoutCacheError("DISK_FULL", detail=f"{exc.strerror or exc}{where}")
