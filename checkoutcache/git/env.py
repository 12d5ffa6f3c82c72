"""The environment every git process we start runs in.

- Nothing of the caller's applies: every GIT_* variable is dropped (GIT_DIR,
  GIT_WORK_TREE, GIT_ALTERNATE_OBJECT_DIRECTORIES, ...), and neither the
  machine's /etc/gitconfig nor the caller's ~/.gitconfig is read
  (GIT_CONFIG_SYSTEM names our own file, GIT_CONFIG_GLOBAL the operator's or
  none): no filter, hook, insteadOf or fsmonitor of theirs runs.
- The operator may give one git config file (CHECKOUTCACHE_GIT_CONFIG) for
  network operations only (probe, fetch): credential helpers, `insteadOf`
  rewrites to a caching proxy, proxies, CA bundles. Local operations
  (checkout, keep-refs, repack) never read it.
- Settings that execute code stay off whatever that file says: hooks
  (core.hooksPath), fsmonitor. No checkout reads the file, so no filter of its
  runs; the one filter a checkout runs is git-lfs's, enabled by our own config
  (git/backend.py LFS_FILTER) only for commits with LFS files.
- Nothing can prompt: GIT_TERMINAL_PROMPT=0 and ssh in batch mode.
- ssh: the operator may name a private key and a known_hosts file
  (CHECKOUTCACHE_SSH_KEY_FILE, CHECKOUTCACHE_SSH_KNOWN_HOSTS_FILE): ssh then
  uses that key alone and refuses any host that file does not vouch for.
  With neither, an operator's core.sshCommand (in CHECKOUTCACHE_GIT_CONFIG)
  applies: our default ssh command sits at git's system level, the lowest it
  reads (git/system.gitconfig), never in GIT_SSH_COMMAND, which would win.
- Only safe transports: GIT_ALLOW_PROTOCOL also binds redirects and submodules.
- No lazy fetch (GIT_NO_LAZY_FETCH): a partial mirror (CHECKOUTCACHE_FILTER)
  gets the blobs a checkout needs in one fetch of ours, never one by one.
- A credential reaches git as a helper scoped to its host (credentials.py):
  in the child's environment only, never on a command line (visible in ps),
  in a config file, or in the URL git prints.
"""

from __future__ import annotations

import os
import shlex

from checkoutcache.credentials import CREDENTIAL_VARS, Credential, git_auth
from checkoutcache.errors import CheckoutCacheError

OPERATOR_CONFIG_VAR = "CHECKOUTCACHE_GIT_CONFIG"
SSH_KEY_FILE_VAR = "CHECKOUTCACHE_SSH_KEY_FILE"
SSH_KNOWN_HOSTS_VAR = "CHECKOUTCACHE_SSH_KNOWN_HOSTS_FILE"
# The same command as system.gitconfig's core.sshCommand (a test keeps them equal).
SSH_DEFAULT = "ssh -o BatchMode=yes -o ConnectTimeout=30"
SYSTEM_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "system.gitconfig")
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
        "GIT_ALLOW_PROTOCOL": ALLOWED_PROTOCOLS,
        # No lazy fetch, ever (git 2.39.4+; a partial mirror's promisor remote has no URL
        # anyway): a partial mirror's missing blobs come only from our batch fetch.
        "GIT_NO_LAZY_FETCH": "1",
        "GIT_CONFIG_SYSTEM": SYSTEM_CONFIG,
        "GIT_CONFIG_GLOBAL": operator_config or os.devnull,
        "LC_ALL": "C",
        "LANGUAGE": "C",
    })
    if url is not None:
        ssh = ssh_command(base)
        if ssh is not None:
            env["GIT_SSH_COMMAND"] = ssh
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


def ssh_command(base: dict[str, str]) -> str | None:
    """GIT_SSH_COMMAND for the operator's key and known_hosts files, or None when neither is
    set. A named file that cannot be read is BAD_ARGUMENT (naming the variable) before any
    contact: ssh would say only "Permission denied" or "Host key verification failed"."""
    key, known = base.get(SSH_KEY_FILE_VAR) or None, base.get(SSH_KNOWN_HOSTS_VAR) or None
    if key is None and known is None:
        return None
    parts = [SSH_DEFAULT]
    for var, path in ((SSH_KEY_FILE_VAR, key), (SSH_KNOWN_HOSTS_VAR, known)):
        if path is not None and not (os.path.isabs(path) and os.path.isfile(path) and os.access(path, os.R_OK)):
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{var}={path[:200]!r} is not a readable file "
                                                          f"(give an absolute path this user can read)")
    if key is not None:
        # Only this key: not whatever an agent or ~/.ssh offers first.
        parts += ["-i", shlex.quote(key), "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none"]
    if known is not None:
        parts += ["-o", shlex.quote(f"UserKnownHostsFile={known}"), "-o", "GlobalKnownHostsFile=/dev/null",
                  "-o", "StrictHostKeyChecking=yes"]
    return " ".join(parts)
