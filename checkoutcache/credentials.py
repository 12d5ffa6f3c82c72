"""Credentials: the one home of the secret a fetch may need.

What it owns: the Credential type, reading it from the environment, handing
it to git (an `http.<url>.extraHeader` in the child's environment) and to a
clone worker (its environment), and redaction of every text that may carry it.

Invariant 8 (nothing leaks): a Credential never appears in a repr, a URL we
show, a file, a log line, an answer or an argv. Its variable names are spelled
only here. Every line that may carry git's output or a URL passes through
`redact` before it reaches a file, a log line or an answer.
"""

from __future__ import annotations

import base64
import re
from typing import Mapping

import attrs

USERNAME_VAR = "CHECKOUTCACHE_GIT_USERNAME"
PASSWORD_VAR = "CHECKOUTCACHE_GIT_PASSWORD"
# Variables of ours that carry secrets: never passed on to git itself.
CREDENTIAL_VARS = (USERNAME_VAR, PASSWORD_VAR)
DEFAULT_USERNAME = "x-access-token"


@attrs.frozen
class Credential:
    """A username and secret for https fetches. Never written, never shown."""

    username: str = attrs.field(repr=False)
    password: str = attrs.field(repr=False)

    def secrets(self) -> list[str]:
        return [self.username, self.password]


def credential_from_env(environ: Mapping[str, str]) -> Credential | None:
    """A credential given through the environment instead of the URL."""
    password = environ.get(PASSWORD_VAR)
    if not password:
        return None
    return Credential(environ.get(USERNAME_VAR, DEFAULT_USERNAME), password)


def credential_env(credential: Credential | None) -> dict[str, str]:
    """How a credential travels from the asking process to its clone worker."""
    if credential is None:
        return {}
    return {USERNAME_VAR: credential.username, PASSWORD_VAR: credential.password}


def without_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in CREDENTIAL_VARS}


def git_auth_config(credential: Credential | None, url: str | None) -> dict[str, str]:
    """git config entries that send the credential to url's https server only."""
    if credential is None or url is None or not url.startswith("https://"):
        return {}
    token = base64.b64encode(f"{credential.username}:{credential.password}".encode()).decode()
    return {f"http.{url}.extraHeader": f"Authorization: Basic {token}"}


# scheme://user[:password]@host -> scheme://host. Userinfo is either a credential
# or an ssh login; for text we show, dropping both is the safe choice.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


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

