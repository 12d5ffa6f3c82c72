"""What a caller of the API may do: pure decisions over the operator's policy.

The code under review can reach the sidecar, so every request is hostile
until shown otherwise (DESIGN.md invariant 10). The operator decides:

- tokens: over TCP every request but /healthz needs a token, as `Authorization:
  Bearer <token>` or signed with it (signing.py: the token itself never sent);
  over the Unix socket only when tokens are configured. Each token carries what
  it may do (DESIGN invariant 18): the scopes it may name, the endpoints it may
  call (`can=`: ensure, hold, status, workspaces, gc, metrics) and repositories
  of its own on top of the sidecar's (`repos=`), so the token code under review
  can read does no more than that review needs. Tokens are compared in constant
  time. When the tokens file changes (rotated()), a token it no longer holds
  stays valid for the overlap (retiring), so clients move to the new one
  without a gap.
- repositories: which URLs the API may name (shell-style patterns over the
  normalized URL, e.g. `https://github.com/acme/*`); local paths and file://
  are refused unless allowed, and even then only absolute ones (never
  relative to serve's working directory, never `~`).
- limits: gc over the API may only tighten the configured limits, never
  lower the grace window; `wait` is capped.

The CLI is not subject to any of this: it runs with its caller's own rights.
"""

from __future__ import annotations

import collections
import fnmatch
import hmac
import os
import re
import time

import attrs

from checkoutcache import signing
from checkoutcache.config import Config
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.repospec import RepoSpec
from checkoutcache.signing import token_name
from checkoutcache.units import FreeTarget

ALL_SCOPES = "*"


# What a token may call (`can=`), and which capability each endpoint needs.
CAPABILITIES = ("ensure", "hold", "status", "workspaces", "gc", "metrics")
CAPABILITY_OF = {"/v1/ensure": "ensure", "/v1/hold": "hold", "/v1/release": "hold", "/v1/status": "status",
                 "/v1/workspaces": "workspaces", "/v1/gc": "gc", "/metrics": "metrics"}


@attrs.frozen
class Grant:
    """What one authenticated caller may use."""

    # Who it is, for holds, quotas and logs: a digest of the token (never the token), so
    # the same token is the same caller whichever source gave it, and two tokens never are.
    name: str
    scopes: frozenset[str] | None  # None: every scope
    can: frozenset[str] | None = None  # the endpoints' capabilities it may use; None: every one
    repos: tuple[str, ...] = ()  # patterns a repository must match too (beyond the sidecar's); (): no more

    def may_use(self, scope: str) -> bool:
        return self.scopes is None or scope in self.scopes

    def may_call(self, capability: str) -> bool:
        return self.can is None or capability in self.can

    def may_name(self, url: str) -> bool:
        return not self.repos or any(fnmatch.fnmatchcase(url, pattern) for pattern in self.repos)

    @property
    def everything(self) -> bool:
        """Every scope, every repository the sidecar allows: what gc, which spans them all, needs."""
        return self.scopes is None and not self.repos


ANONYMOUS = Grant("unix-socket", None)


@attrs.frozen
class ApiPolicy:
    tokens: tuple[tuple[str, Grant], ...] = ()
    repo_patterns: tuple[str, ...] = ()  # empty: any remote repository
    allow_local: bool = False
    # Tokens a reload dropped, each valid until its time.monotonic() deadline.
    retiring: tuple[tuple[str, Grant, float], ...] = ()

    def rotated(self, tokens: tuple[tuple[str, Grant], ...], now: float, overlap: float) -> "ApiPolicy":
        """This policy with the tokens a reloaded file holds: one it no longer holds retires,
        valid for `overlap` seconds more (one retiring already keeps its deadline; one the
        file holds again is simply current)."""
        current = {token for token, _grant in tokens}
        still = tuple(r for r in self.retiring if r[2] > now and r[0] not in current)
        already = {r[0] for r in still}
        leaving = tuple((token, grant, now + overlap) for token, grant in self.tokens
                        if token not in current and token not in already)
        return attrs.evolve(self, tokens=tokens, retiring=still + leaving)

    def authenticate(self, authorization: str | None, over_tcp: bool, now: float | None = None) -> Grant:
        """The caller's grant for a bearer token, or UNAUTHORIZED. Over the Unix socket
        without configured tokens, the socket's file mode is the access control."""
        if not self.tokens:
            if over_tcp:
                raise CheckoutCacheError("UNAUTHORIZED")  # serve refuses to start so; never reached
            return ANONYMOUS
        presented = ""
        if authorization and authorization[:7].lower() == "bearer ":
            presented = authorization[7:].strip()
        found = None
        for token, grant in self.valid_tokens(now):  # every token is compared: no early exit to time
            if hmac.compare_digest(token.encode(), presented.encode()) and presented and found is None:
                found = grant
        if found is None:
            raise CheckoutCacheError("UNAUTHORIZED")
        return found

    def valid_tokens(self, now: float | None = None) -> list[tuple[str, Grant]]:
        """The tokens in force, then those retiring whose overlap has not ended."""
        valid = list(self.tokens)
        if self.retiring:
            now = time.monotonic() if now is None else now
            valid += [(token, grant) for token, grant, until in self.retiring if until > now]
        return valid

    def verify_signature(self, signature: signing.Signature, method: str, target: str, wall_now: float,
                         now: float | None = None) -> tuple[str, Grant]:
        """(the token, its grant) of a signed request (signing.py), or UNAUTHORIZED: its key names
        a token in force, its time is within the window, its mac is that token's. The caller
        refuses a nonce it has seen and checks the body against the signed digest."""
        if not -signing.SIGNATURE_WINDOW <= signature.ts - wall_now <= signing.SIGNATURE_AHEAD:
            raise CheckoutCacheError("UNAUTHORIZED")
        for token, grant in self.valid_tokens(now):
            if grant.name == signature.key and signing.signed_by(token, signature, method, target):
                return token, grant
        raise CheckoutCacheError("UNAUTHORIZED")

    def repos_of(self, name: str) -> tuple[str, ...]:
        """The repos= patterns of the grant of this name (() for none, or no such grant)."""
        for _token, grant in self.valid_tokens():
            if grant.name == name:
                return grant.repos
        return ()

    def token_of(self, name: str) -> str | None:
        """The token of a grant's name (for an answer's proof), in force or retiring."""
        for token, grant in self.valid_tokens():
            if grant.name == name:
                return token
        return None

    @staticmethod
    def check_call(grant: Grant, capability: str) -> None:
        """FORBIDDEN_ENDPOINT unless the token may call an endpoint needing this capability."""
        if not grant.may_call(capability):
            raise CheckoutCacheError("FORBIDDEN_ENDPOINT", endpoint=capability,
                                     can=",".join(sorted(grant.can or ())) or "nothing")

    def check_repo_argument(self, raw: object) -> None:
        """Refuse local paths before they are resolved against serve's own cwd or home."""
        if not isinstance(raw, str):
            return  # parse_repo answers the input error
        if "://" in raw:
            local = raw.lower().startswith("file://")
        else:
            local = raw.startswith(("/", ".", "~")) or ":" not in raw.split("/", 1)[0]
        if local and not self.allow_local:
            raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why="local paths and file:// are not allowed "
                                                                 "through the API")
        if local and (raw.startswith(("~", ".")) or not (raw.startswith("/") or raw.lower().startswith("file://"))):
            raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why="a local path must be absolute")

    def check_repo(self, spec: RepoSpec) -> None:
        """The sidecar's allow-list (the same for every caller: what serve.resolve remembers)."""
        if not self.repo_patterns:
            return
        if not any(fnmatch.fnmatchcase(spec.url, pattern) for pattern in self.repo_patterns):
            raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why=f"{spec.url[:200]} matches no allowed pattern")

    @staticmethod
    def check_grant_repo(grant: Grant, spec: RepoSpec) -> None:
        """The token's own repositories (checked at every request: a remembered request is the
        sidecar's decision, not this caller's)."""
        if not grant.may_name(spec.url):
            raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why=f"{spec.url[:200]} is not among this token's "
                                                                 f"repositories")

    def check_scope(self, grant: Grant, scope: str) -> None:
        if not grant.may_use(scope):
            raise CheckoutCacheError("FORBIDDEN_SCOPE", scope=scope[:64])


def token_words(line: str) -> list[str]:
    """A tokens-file line's words, its comment cut: `#` starts one at the line's start or after
    a blank only (handoff.token_from_file reads the review's file the same way)."""
    return re.split(r"(?:^|\s)#", line, maxsplit=1)[0].split()


class NonceBook:
    """The nonces of signed requests taken, per token, each remembered for as long as its
    signature could still be taken (the window and the lead allowed): a request is answered
    once. A token's book is bounded (per_token) and so is the whole (total): a flood of one
    token's own valid signatures fills its own book only, and then only its requests are
    refused. O(1) per request (a deque in arrival order, pruned from its front): it runs on
    the event loop. Not thread-safe by itself: the caller serialises (serve's event loop)."""

    def __init__(self, per_token: int, total: int, keep_for: float):
        self.per_token, self.total, self.keep_for = per_token, total, keep_for
        self.books: dict[str, tuple[set[str], collections.deque]] = {}
        self.count = 0

    def first_use(self, token: str, nonce: str, now: float) -> bool:
        """Whether the nonce is new for this token (it is then remembered); False for a replay,
        or when the token's book (or the whole) is full."""
        seen, order = self.books.setdefault(token, (set(), collections.deque()))
        while order and order[0][0] <= now:
            seen.discard(order.popleft()[1])
            self.count -= 1
        if nonce in seen or len(order) >= self.per_token or self.count >= self.total and not self.prune(now):
            return False
        seen.add(nonce)
        order.append((now + self.keep_for, nonce))
        self.count += 1
        return True

    def prune(self, now: float) -> bool:
        """Drop every book's expired nonces (when the whole is full: amortised by the entries it
        frees); whether there is room now."""
        for token in list(self.books):
            seen, order = self.books[token]
            while order and order[0][0] <= now:
                seen.discard(order.popleft()[1])
                self.count -= 1
            if not order:
                del self.books[token]
        return self.count < self.total


def parse_tokens(text: str, source: str) -> tuple[tuple[str, Grant], ...]:
    """A tokens file: one `TOKEN [SCOPE,SCOPE...] [can=CAPABILITY,...] [repos=PATTERN,...]`
    per line. No scopes, or `*`: every scope; no `can=`: every endpoint; no `repos=`: every
    repository the sidecar allows. Blank lines and `#` comments are skipped. A line this
    does not read whole is BAD_ARGUMENT naming the line (never a token taken for more)."""
    tokens = []
    for number, line in enumerate(text.removeprefix("\ufeff").splitlines(), 1):
        words = token_words(line)
        if not words:
            continue
        where = f"{source} line {number}"
        token, options = words[0], words[1:]
        if len(token) < 16:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{where}: a token must be at least 16 characters")
        if "#" in token:  # read another way by whoever cuts comments otherwise: never a token
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{where}: a token may not hold '#'")
        # The scopes: every word before the first key=value (as the one-field form read them: "a, b").
        plain = 0
        while plain < len(options) and "=" not in options[plain]:
            plain += 1
        names = tuple(v.strip() for v in " ".join(options[:plain]).split(",") if v.strip())
        scopes = None if not names or ALL_SCOPES in names else frozenset(names)
        can: frozenset[str] | None = None
        repos: tuple[str, ...] = ()
        for word in options[plain:]:
            key, equals, value = word.partition("=")
            items = tuple(v.strip() for v in value.split(",") if v.strip())
            if key == "can" and equals and can is None:
                unknown = sorted(set(items) - set(CAPABILITIES))
                if unknown or not items:
                    raise CheckoutCacheError("BAD_ARGUMENT", what=f"{where}: can= takes {', '.join(CAPABILITIES)} "
                                                                  f"(comma-separated), not {','.join(unknown)!r}")
                can = frozenset(items)
            elif key == "repos" and equals and not repos:
                if not items:
                    raise CheckoutCacheError("BAD_ARGUMENT", what=f"{where}: repos= needs at least one pattern")
                repos = items
            else:
                raise CheckoutCacheError("BAD_ARGUMENT", what=f"{where}: {word[:40]!r} is not SCOPES (first), "
                                                              f"can=... or repos=... (each once)")
        tokens.append((token, Grant(token_name(token), scopes, can, repos)))
    return tuple(tokens)


# The roles of the shipped topology (deploy/, `checkoutcache tokens`): what each token may do.
# The review's is the one code under review can read: its checkouts, in the default scope, of
# the repositories serve allows (CHECKOUTCACHE_API_REPOS); never gc, status or another scope.
SHIPPED_ROLES = {"review": "default can=ensure,hold", "operator": "* can=status,workspaces,gc,metrics"}


def shipped_tokens() -> dict[str, str]:
    """Fresh tokens for the shipped roles: {"tokens": serve's tokens file, "review": the review's
    token alone (what its container mounts)}. Each token 43 characters of secrets.token_urlsafe."""
    import secrets

    made = {role: secrets.token_urlsafe(32) for role in SHIPPED_ROLES}
    lines = [f"# checkoutcache tokens: one a line, TOKEN SCOPES can=... (docs/http-api.md, \"Tokens\")"]
    lines += [f"{made[role]} {grant}  # {role}" for role, grant in SHIPPED_ROLES.items()]
    parse_tokens("\n".join(lines), "the made tokens")  # what serve will read: never one it would refuse
    return {"tokens": "\n".join(lines) + "\n", "review": made["review"] + "\n"}


def load_tokens(token_file: str | None, environ: dict | os._Environ) -> tuple[tuple[str, Grant], ...]:
    tokens: list[tuple[str, Grant]] = []
    if token_file:
        try:
            with open(token_file) as handle:
                tokens += parse_tokens(handle.read(), token_file)
        except OSError as exc:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"CHECKOUTCACHE_API_TOKEN_FILE (--token-file) "
                                                          f"{token_file[:200]!r} cannot be read: {exc.strerror}") from None
    single = environ.get("CHECKOUTCACHE_API_TOKEN")
    if single:
        tokens += parse_tokens(single, "CHECKOUTCACHE_API_TOKEN")
    return tuple(tokens)


def tightened(configured: Config, requested: Config) -> Config:
    """The limits a gc over the API runs with: a request may only make them
    stricter. The grace window never drops below the configured one."""
    def lower(a, b):
        return b if a is None else (a if b is None else min(a, b))

    return attrs.evolve(
        configured,
        grace=max(configured.grace, requested.grace),
        max_checkouts=lower(configured.max_checkouts, requested.max_checkouts),
        max_bytes=lower(configured.max_bytes, requested.max_bytes),
        max_age=lower(configured.max_age, requested.max_age),
        min_free=_stricter_free(configured.min_free, requested.min_free),
    )


def _stricter_free(configured: FreeTarget | None, requested: FreeTarget | None) -> FreeTarget | None:
    if requested is None:
        return configured
    if configured is None:
        return requested
    same_kind = (configured.percent is None) == (requested.percent is None)
    if not same_kind:
        return configured  # not comparable without the disk's size: keep the operator's
    return requested if requested.bytes_of(100 << 40) > configured.bytes_of(100 << 40) else configured
