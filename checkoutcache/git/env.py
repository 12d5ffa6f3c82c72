"""The environment every git process we start runs in.

- Nothing inherited can redirect git: every GIT_* variable of the caller is
  dropped (GIT_DIR, GIT_WORK_TREE, GIT_ALTERNATE_OBJECT_DIRECTORIES, ...).
- Nothing can prompt: GIT_TERMINAL_PROMPT=0 and ssh in batch mode.
- Only safe transports: GIT_ALLOW_PROTOCOL also binds redirects and submodules.
- No fsmonitor, no autocrlf, no automatic gc in anything we create.
- A credential reaches git through GIT_CONFIG_* variables (credentials.py
  says how): it lives in the child's environment only, never on a command
  line (visible in ps), in a config file, or in the URL git prints.
"""

from __future__ import annotations

import os

from checkoutcache.credentials import CREDENTIAL_VARS, Credential, git_auth_config

SAFE_CONFIG = {
    "core.fsmonitor": "false",
    "core.autocrlf": "false",
    "gc.auto": "0",
    "maintenance.auto": "false",
    "fetch.writeCommitGraph": "false",
    "protocol.ext.allow": "never",
}
ALLOWED_PROTOCOLS = "https:ssh:git:file"


def git_env(base: dict[str, str] | None = None, credential: Credential | None = None,
            url: str | None = None) -> dict[str, str]:
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items() if not k.startswith("GIT_") and k not in CREDENTIAL_VARS}
    env.update({
        "GIT_TERMINAL_PROMPT": "0",
        "GCM_INTERACTIVE": "never",
        "GIT_SSH_COMMAND": "ssh -o BatchMode=yes -o ConnectTimeout=30",
        "GIT_ALLOW_PROTOCOL": ALLOWED_PROTOCOLS,
        "LC_ALL": "C",
        "LANGUAGE": "C",
    })
    config = dict(SAFE_CONFIG)
    config.update(git_auth_config(credential, url))
    env["GIT_CONFIG_COUNT"] = str(len(config))
    for index, (key, value) in enumerate(config.items()):
        env[f"GIT_CONFIG_KEY_{index}"] = key
        env[f"GIT_CONFIG_VALUE_{index}"] = value
    return env
