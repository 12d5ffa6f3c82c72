"""The environment every git process runs in, and how credentials reach it.

- Nothing inherited can redirect git: every GIT_* variable of the caller is
  dropped (GIT_DIR, GIT_WORK_TREE, GIT_ALTERNATE_OBJECT_DIRECTORIES, ...).
- Nothing can prompt: GIT_TERMINAL_PROMPT=0 and ssh in batch mode.
- Only safe transports: GIT_ALLOW_PROTOCOL also binds redirects and submodules.
- No fsmonitor, no autocrlf, no automatic gc in anything we create.
- A credential is handed to git as an http.<url>.extraHeader through
  GIT_CONFIG_* variables: it lives in the child's environment only, never on
  a command line (visible in ps), in a config file, or in the URL git prints.
"""

from __future__ import annotations

import base64
import os

from .repospec import Credential

SAFE_CONFIG = {
    "core.fsmonitor": "false",
    "core.autocrlf": "false",
    "gc.auto": "0",
    "maintenance.auto": "false",
    "fetch.writeCommitGraph": "false",
    "protocol.ext.allow": "never",
}

# Variables of ours that carry secrets: never passed on to git itself.
CREDENTIAL_VARS = ("CHECKOUTCACHE_GIT_USERNAME", "CHECKOUTCACHE_GIT_PASSWORD")


def git_env(base: dict[str, str] | None = None, credential: Credential | None = None,
            url: str | None = None) -> dict[str, str]:
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items() if not k.startswith("GIT_") and k not in CREDENTIAL_VARS}
    env.update({
        "GIT_TERMINAL_PROMPT": "0",
        "GCM_INTERACTIVE": "never",
        "GIT_SSH_COMMAND": "ssh -o BatchMode=yes -o ConnectTimeout=30",
        "GIT_ALLOW_PROTOCOL": "https:ssh:git:file",
        "LC_ALL": "C",
        "LANGUAGE": "C",
    })
    config = dict(SAFE_CONFIG)
    if credential is not None and url is not None and url.startswith("https://"):
        token = base64.b64encode(f"{credential.username}:{credential.password}".encode()).decode()
        config[f"http.{url}.extraHeader"] = f"Authorization: Basic {token}"
    env["GIT_CONFIG_COUNT"] = str(len(config))
    for index, (key, value) in enumerate(config.items()):
        env[f"GIT_CONFIG_KEY_{index}"] = key
        env[f"GIT_CONFIG_VALUE_{index}"] = value
    return env


def credential_env(credential: Credential | None) -> dict[str, str]:
    """How a credential travels from the asking process to its clone worker."""
    if credential is None:
        return {}
    return {"CHECKOUTCACHE_GIT_USERNAME": credential.username,
            "CHECKOUTCACHE_GIT_PASSWORD": credential.password}
