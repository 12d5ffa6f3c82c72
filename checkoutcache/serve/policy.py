"""What a caller of the API may do: pure decisions over the operator's policy.

The code under review can reach the sidecar, so every request is hostile
until shown otherwise (DESIGN.md invariant 10). The operator decides:

- tokens: over TCP every request but /healthz needs `Authorization: Bearer
  <token>` (over the Unix socket only when tokens are configured); each token
  may be limited to some scopes. Tokens are compared in constant time. When
  the tokens file changes (rotated()), a token it no longer holds stays valid
  for the overlap (retiring), so clients move to the new one without a gap.
- repositories: which URLs the API may name (shell-style patterns over the
  normalized URL, e.g. `https://github.com/acme/*`); local paths and file://
  are refused unless allowed, and even then only absolute ones (never
  relative to serve's working directory, never `~`).
- limits: gc over the API may only tighten the configured limits, never
  lower the grace window; `wait` is capped.

The CLI is not subject to any of this: it runs with its caller's own rights.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import os
import time

import attrs

from checkoutcache.config import Config
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.repospec import RepoSpec
from checkoutcache.units import FreeTarget

ALL_SCOPES = "*"


@attrs.frozen
class Grant:
    """What one authenticated caller may use."""

    # Who it is, for holds, quotas and logs: a digest of the token (never the token), so
    # the same token is the same caller whichever source gave it, and two tokens never are.
    name: str
    scopes: frozenset[str] | None  # None: every scope

    def may_use(self, scope: str) -> bool:
        return self.scopes is None or scope in self.scopes


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
        """The caller's grant, or UNAUTHORIZED. Over the Unix socket without
        configured tokens, the socket's file mode is the access control."""
        if not self.tokens:
            if over_tcp:
                raise CheckoutCacheError("UNAUTHORIZED")  # serve refuses to start so; never reached
            return ANONYMOUS
        presented = ""
        if authorization and authorization[:7].lower() == "bearer ":
            presented = authorization[7:].strip()
        found = None
        for token, grant in self.tokens:  # every token is compared: no early exit to time
            if hmac.compare_digest(token.encode(), presented.encode()) and presented:
                found = grant
        if self.retiring:
            now = time.monotonic() if now is None else now
            for token, grant, until in self.retiring:
                if hmac.compare_digest(token.encode(), presented.encode()) and presented and until > now \
                        and found is None:
                    found = grant
        if found is None:
            raise CheckoutCacheError("UNAUTHORIZED")
        return found

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
        if not self.repo_patterns:
            return
        if not any(fnmatch.fnmatchcase(spec.url, pattern) for pattern in self.repo_patterns):
            raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why=f"{spec.url[:200]} matches no allowed pattern")

    def check_scope(self, grant: Grant, scope: str) -> None:
        if not grant.may_use(scope):
            raise CheckoutCacheError("FORBIDDEN_SCOPE", scope=scope[:64])


def parse_tokens(text: str, source: str) -> tuple[tuple[str, Grant], ...]:
    """A tokens file: one `TOKEN [SCOPE,SCOPE...]` per line (no scopes, or `*`:
    every scope); blank lines and `#` comments are skipped."""
    tokens = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        token, _, scopes = line.partition(" ")
        if len(token) < 16:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{source} line {number}: a token must be at least "
                                                          f"16 characters")
        names = frozenset(s.strip() for s in scopes.split(",") if s.strip())
        grant = Grant(token_name(token), None if not names or ALL_SCOPES in names else names)
        tokens.append((token, grant))
    return tuple(tokens)


def token_name(token: str) -> str:
    """A token's name in logs and hold accounting: its digest's first 12 hex digits."""
    return "token-" + hashlib.sha256(token.encode()).hexdigest()[:12]


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
