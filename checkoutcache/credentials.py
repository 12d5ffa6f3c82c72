"""Credentials: the one home of the secret a fetch may need.

What it owns: the Credential type and the hosts it is bound to, reading it
from the environment, handing it to git and to a clone worker, and redaction
of every text that may carry it.

Invariant 8 (nothing leaks, and only to its hosts):
- a Credential is bound to hosts: one in a URL to that URL's host; one from
  CHECKOUTCACHE_GIT_PASSWORD to the hosts in CHECKOUTCACHE_GIT_HOSTS (none if
  unset). For any other host it is never handed to git at all.
- it reaches git as a credential helper scoped to its host
  (`credential.https://<host>.helper`, in GIT_CONFIG_* variables; the secret
  itself in the child's environment): git asks a helper only after the server
  asks for authentication, and asks for the host it is talking to, so a
  redirect to another host never carries it.
- it never appears in a repr, a URL we show, a file, a log line, an answer or
  an argv. Its variable names are spelled only here. Every line that may
  carry git's output or a URL passes through `redact` first.
"""

from __future__ import annotations

import base64
import re
import urllib.parse
from typing import Mapping, NamedTuple


USERNAME_VAR = "CHECKOUTCACHE_GIT_USERNAME"
PASSWORD_VAR = "CHECKOUTCACHE_GIT_PASSWORD"
HOSTS_VAR = "CHECKOUTCACHE_GIT_HOSTS"
# Variables of ours that carry secrets: never passed on to git itself.
CREDENTIAL_VARS = (USERNAME_VAR, PASSWORD_VAR, HOSTS_VAR)
# What our credential helper reads, in git's environment only.
_HELPER_USERNAME = "CHECKOUTCACHE_HELPER_USERNAME"
_HELPER_PASSWORD = "CHECKOUTCACHE_HELPER_PASSWORD"
_HELPER = (f'!f() {{ test "$1" = get || exit 0; echo "username=${_HELPER_USERNAME}"; '
           f'echo "password=${_HELPER_PASSWORD}"; }}; f')
DEFAULT_USERNAME = "x-access-token"


class Credential(NamedTuple):
    """A username and secret for https fetches. Never written, never shown (its
    repr hides both); hosts: the lower-case host or host:port names it may go to."""

    username: str
    password: str
    hosts: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"Credential(hosts={self.hosts!r})"

    __str__ = __repr__

    def secrets(self) -> list[str]:
        return [self.username, self.password]

    def applies_to(self, url: str) -> bool:
        host = https_host(url)
        return host is not None and (host in self.hosts or host.split(":")[0] in self.hosts)


def https_host(url: str) -> str | None:
    """host[:port] of an https URL (lower case), or None for any other transport."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        return None
    return parts.hostname.lower() + (f":{parts.port}" if parts.port and parts.port != 443 else "")


def parse_hosts(value: str | None) -> tuple[str, ...]:
    return tuple(sorted({h.strip().lower() for h in (value or "").split(",") if h.strip()}))


def credential_from_env(environ: Mapping[str, str]) -> Credential | None:
    """A credential given through the environment instead of the URL, bound to
    the hosts CHECKOUTCACHE_GIT_HOSTS lists (none when it is unset)."""
    password = environ.get(PASSWORD_VAR)
    if not password:
        return None
    return Credential(environ.get(USERNAME_VAR, DEFAULT_USERNAME), password, parse_hosts(environ.get(HOSTS_VAR)))


def credential_for(url: str, from_url: Credential | None, environ: Mapping[str, str]) -> Credential | None:
    """The credential a fetch of url may use: the URL's own, else the environment's
    if it is bound to url's host; None otherwise (then none is sent anywhere)."""
    if from_url is not None:
        return from_url
    candidate = credential_from_env(environ)
    return candidate if candidate is not None and candidate.applies_to(url) else None


def unbound_credential_note(url: str, environ: Mapping[str, str]) -> str:
    """Why no credential was used for url although one is configured ('' if none is)."""
    candidate = credential_from_env(environ)
    if candidate is None or candidate.applies_to(url):
        return ""
    host = https_host(url) or "this repository's transport"
    return f"; no credential applies to {host} (the configured one is bound to {HOSTS_VAR})"


def credential_env(credential: Credential | None) -> dict[str, str]:
    """How a credential travels from the asking process to its clone worker."""
    if credential is None:
        return {}
    return {USERNAME_VAR: credential.username, PASSWORD_VAR: credential.password,
            HOSTS_VAR: ",".join(credential.hosts)}


def without_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in CREDENTIAL_VARS}


def git_auth(credential: Credential | None, url: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """(git config entries, environment) that let git answer url's host's request
    for authentication with the credential, and no other host's."""
    if credential is None or url is None or not credential.applies_to(url):
        return {}, {}
    config = {f"credential.https://{https_host(url)}.helper": _HELPER}
    return config, {_HELPER_USERNAME: credential.username, _HELPER_PASSWORD: credential.password}


# scheme://user[:password]@host -> scheme://host. Userinfo is either a credential
# or an ssh login; for text we show, dropping both is the safe choice. It runs to
# the last '@' before the path: a password may hold a raw '@' (as urllib reads it).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")


def strip_userinfo(text: str) -> str:
    return _USERINFO.sub(r"\g<scheme>", text)


def secret_forms(secrets: list[str]) -> list[str]:
    """The strings to scrub for a set of secrets: each one, and the Basic-auth
    encodings git could echo if it ever printed a header."""
    forms = [s for s in secrets if s]
    if len(secrets) == 2 and any(secrets):
        forms.append(base64.b64encode(f"{secrets[0]}:{secrets[1]}".encode()).decode())
    return sorted(set(forms), key=len, reverse=True)


def redact(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    text = strip_userinfo(text)
    for secret in secret_forms(list(secrets)):
        if len(secret) >= 3:
            text = text.replace(secret, "***")
    return text


def secrets_of(credential: Credential | None) -> list[str]:
    return credential.secrets() if credential is not None else []

