"""The environment every git process we start runs in.

- Nothing of the caller's applies: every GIT_* variable is dropped (GIT_DIR,
  GIT_WORK_TREE, GIT_ALTERNATE_OBJECT_DIRECTORIES, ...), and neither the
  system config nor the caller's ~/.gitconfig is read (GIT_CONFIG_NOSYSTEM,
  GIT_CONFIG_GLOBAL): no filter, hook, insteadOf or fsmonitor of theirs runs.
- The operator may give one git config file (CHECKOUTCACHE_GIT_CONFIG) for
  network operations only (probe, fetch): credential helpers, `insteadOf`
  rewrites to a caching proxy, proxies, CA bundles. Local operations
  (checkout, keep-refs, repack) never read it.
- Settings that execute code stay off whatever that file says: hooks
  (core.hooksPath), fsmonitor. No checkout reads the file, so no filter of its
  runs; the one filter a checkout runs is git-lfs's, enabled by our own config
  (git/backend.py LFS_FILTER) only for commits with LFS files.
- Nothing can prompt: GIT_TERMINAL_PROMPT=0 and ssh in batch mode.
- Only safe transports: GIT_ALLOW_PROTOCOL also binds redirects and submodules.
- A credential reaches git as a helper scoped to its host (credentials.py):
  in the child's environment only, never on a command line (visible in ps),
  in a config file, or in the URL git prints.
"""

from __future__ import annotations

import os

from checkoutcache.credentials import CREDENTIAL_VARS, Credential, git_auth

OPERATOR_CONFIG_VAR = "CHECKOUTCACHE_GIT_CONFIG"
SAFE_CONFIG = {
    "core.fsmonitor": "false",
    "core.autocrlf": "false",
    "core.hooksPath": os.devnull,
    # Which files are LFS is the repository's .gitattributes alone: no user's or operator's.
    "core.attributesFile": os.devnull,
    "gc.auto": "0",
    "maintenance.auto": "false",
    "fetch.writeCommitGraph": "false",
    "protocol.ext.allow": "never",
    # Callers of several uids share the store (one group): git must work in a mirror
    # or checkout another member made. Only our own store's repositories are ever
    # opened, and the settings above override what a repository's config says.
    "safe.directory": "*",
}
ALLOWED_PROTOCOLS = "https:ssh:git:file"
# CHECKOUTCACHE_FSCK (on by default): git checks every object a fetch brings. Its tree
# checks are what matter here (duplicate entries, `..`, `.git`, unsorted trees: the
# shapes hostile repositories use); the commit and tag header checks only find old
# history's sloppy dates and names, which no checkout is harmed by: those are ignored.
# Measured on a 20,000-commit, 497k-object fetch: 1.14x the time (benchmarks/MONOREPO.md).
FSCK_VAR = "CHECKOUTCACHE_FSCK"
FSCK_CONFIG = {"fetch.fsckObjects": "true", **{f"fetch.fsck.{msg}": "ignore" for msg in (
    "badDate", "badDateOverflow", "badEmail", "badTimezone", "missingEmail", "missingNameBeforeEmail",
    "missingSpaceBeforeDate", "missingSpaceBeforeEmail", "zeroPaddedDate", "multipleAuthors",
    "missingAuthor", "missingCommitter", "badTagName", "missingTaggerEntry")}}


def git_env(base: dict[str, str] | None = None, credential: Credential | None = None,
            url: str | None = None, takes_objects: bool = False) -> dict[str, str]:
    """The environment of one git process; url is given for network operations
    (which alone read the operator's config and may carry a credential). Fetches
    (url given, or takes_objects: a bundle's take-in) check what they bring in."""
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items()
           if not k.startswith("GIT_") and k not in CREDENTIAL_VARS and k != OPERATOR_CONFIG_VAR}
    operator_config = base.get(OPERATOR_CONFIG_VAR) if url is not None else None
    env.update({
        "GIT_TERMINAL_PROMPT": "0",
        "GCM_INTERACTIVE": "never",
        "GIT_SSH_COMMAND": "ssh -o BatchMode=yes -o ConnectTimeout=30",
        "GIT_ALLOW_PROTOCOL": ALLOWED_PROTOCOLS,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": operator_config or os.devnull,
        "LC_ALL": "C",
        "LANGUAGE": "C",
    })
    config = dict(SAFE_CONFIG)
    if (url is not None or takes_objects) and base.get(FSCK_VAR, "on") != "off":
        config.update(FSCK_CONFIG)
    auth_config, auth_env = git_auth(credential, url)
    config.update(auth_config)
    env.update(auth_env)
    env["GIT_CONFIG_COUNT"] = str(len(config))
    for index, (key, value) in enumerate(config.items()):
        env[f"GIT_CONFIG_KEY_{index}"] = key
        env[f"GIT_CONFIG_VALUE_{index}"] = value
    return env
