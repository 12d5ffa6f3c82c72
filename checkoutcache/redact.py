"""Keeping credentials out of text: every line that may carry git's output or a
URL passes through here before it reaches a file, a log line or an answer."""

from __future__ import annotations

import base64
import re

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
