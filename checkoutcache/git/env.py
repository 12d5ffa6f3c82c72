"""The environment every git process we start runs in.

- Nothing of the caller's applies: every GIT_* variable is dropped (GIT_DIR,
  GIT_WORK_TREE, GIT_ALTERNATE_OBJECT_DIRECTORIES, ...), and neither the
  machine's /etc/gitconfig nor the caller's ~/.gitconfig is read
  (GIT_CONFIG_SYSTEM is /dev/null, GIT_CONFIG_GLOBAL the operator's file or
  none): no filter, hook, insteadOf or fsmonitor of theirs runs. Nor is the
  machine's attributes file ($(prefix)/etc/gitattributes, GIT_ATTR_NOSYSTEM)
  or a user's (core.attributesFile is /dev/null): how a checkout writes a
  file is decided by the commit's own .gitattributes and our config alone,
  the same on every machine (a spare, clone/tree.py, is updated on one
  machine and was written on another, or before the file changed).
- The operator may give one git config file (CHECKOUTCACHE_GIT_CONFIG) for
  network operations only (probe, fetch): credential helpers, `insteadOf`
  rewrites to a caching proxy, proxies, CA bundles. Local operations
  (checkout, keep-refs, repack) never read it.
- Settings that execute code stay off whatever that file says: hooks
  (core.hooksPath), fsmonitor. No checkout reads the file, so no filter of its
  runs; the one filter a checkout runs is git-lfs's, enabled by our own config
  (git/backend.py LFS_FILTER) only for commits with LFS files.
- A mirror's own config is the group's to write (docs/security.md): what a
  fetch would run or send a credential to is never taken from it. The ssh
  command, the credential helpers (the list is reset, then the operator's and
  ours are given), askpass, git's proxy command and the alternate-refs command
  are set above the repository's level (environment or command-line config,
  which win); a partial mirror fetches through a remote defined on the
  command line alone (git/cli.py one_time_promisor_remote).
- Nothing can prompt: GIT_TERMINAL_PROMPT=0, no askpass, ssh in batch mode.
- ssh: the operator may name a private key and a known_hosts file
  (CHECKOUTCACHE_SSH_KEY_FILE, CHECKOUTCACHE_SSH_KNOWN_HOSTS_FILE): ssh then
  uses that key alone and refuses any host that file does not vouch for.
  With neither, the operator's core.sshCommand (in CHECKOUTCACHE_GIT_CONFIG)
  applies, else our default (batch mode, a connect timeout); whichever it
  is, it goes in GIT_SSH_COMMAND, which beats any config.
- Only safe transports: GIT_ALLOW_PROTOCOL also binds redirects and submodules.
- No lazy fetch (GIT_NO_LAZY_FETCH): a partial mirror (CHECKOUTCACHE_FILTER)
  gets the blobs a checkout needs in one fetch of ours, never one by one.
- A credential reaches git as a helper scoped to its host (credentials.py):
  in the child's environment only, never on a command line (visible in ps),
  in a config file, or in the URL git prints.
"""

from __future__ import annotations

import functools
import os
import shlex
import subprocess

from checkoutcache.credentials import CREDENTIAL_VARS, Credential, git_auth
from checkoutcache.errors import CheckoutCacheError

OPERATOR_CONFIG_VAR = "CHECKOUTCACHE_GIT_CONFIG"
SSH_KEY_FILE_VAR = "CHECKOUTCACHE_SSH_KEY_FILE"
SSH_KNOWN_HOSTS_VAR = "CHECKOUTCACHE_SSH_KNOWN_HOSTS_FILE"
# Never prompt; give up on a host that does not answer. An operator's own core.sshCommand
# replaces it (keep BatchMode=yes in it).
SSH_DEFAULT = "ssh -o BatchMode=yes -o ConnectTimeout=30"
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
    # Run by a fetch for each alternate object store: never a command of a config's.
    "core.alternateRefsCommand": "true",
    # Callers of several uids share the store (one group): git must work in a mirror
    # or checkout another member made. Only our own store's repositories are ever
    # opened, and the settings above override what a repository's config says.
    "safe.directory": "*",
}
ALLOWED_PROTOCOLS = "https:ssh:git:file"
# CHECKOUTCACHE_FSCK (on by default): git checks every object a fetch (or a bundle's
# take-in) brings. Under fetch.fsckObjects git is strict: its warnings are errors too.
# Measured on a 20,000-commit, 497k-object fetch: 1.14x the time (benchmarks/MONOREPO.md).
#
# What stays an error (git's default) is what can harm a checkout or the store: paths
# with `.git` (and its NTFS/HFS spellings), `..` or `.`, an empty name or a `/` in a name,
# duplicate entries and unsorted trees (git would read one path two ways), a bad,
# symlinked, oversized or unreadable `.gitmodules` or `.gitattributes`, a null id, a
# tree or commit git cannot parse, a tag that does not say what it points at.
#
# What is relaxed, each with why (DESIGN invariant 17: git's own `clone` takes them, and
# long-lived public repositories carry them; docs/security.md lists them): msg-id ->
# (level, reason). "ignore" rather than "warn": a warning per object would fill a big
# history's clone log, and nothing is done with it.
FSCK_VAR = "CHECKOUTCACHE_FSCK"
_IDENT = "an author or committer line; no checkout reads it (git log shows it as written)"
FSCK_CHOICES: dict[str, tuple[str, str]] = {
    "zeroPaddedFilemode": ("ignore", "a tree mode written 040000 by git before 2.0 and some converters (pallets/flask "
                                     "has them): git reads it as 40000, the checkout is the same; git's documentation "
                                     "recommends ignoring it"),
    "badDate": ("ignore", f"a date git cannot parse in {_IDENT}"),
    "badDateOverflow": ("ignore", f"a date past git's range in {_IDENT}"),
    "zeroPaddedDate": ("ignore", f"a zero-padded date in {_IDENT}"),
    "badTimezone": ("ignore", f"a time zone not of the +hhmm form in {_IDENT}"),
    "missingSpaceBeforeDate": ("ignore", f"no blank before the date in {_IDENT}"),
    "badEmail": ("ignore", f"a malformed email in {_IDENT}"),
    "missingEmail": ("ignore", f"no email in {_IDENT}"),
    "missingSpaceBeforeEmail": ("ignore", f"no blank before the email in {_IDENT}"),
    "missingNameBeforeEmail": ("ignore", f"no name before the email in {_IDENT}"),
    "badName": ("ignore", f"a name with a stray '<' or '>' in {_IDENT}"),
    "multipleAuthors": ("ignore", "two author lines in a commit (old import tools): git uses the first"),
    "missingAuthor": ("ignore", "a commit without an author line (old import tools): nothing reads it"),
    "missingCommitter": ("ignore", "a commit without a committer line (old import tools): nothing reads it"),
    "nulInCommit": ("ignore", "a NUL byte in a commit message (converted histories): git stops showing the "
                              "message there, nothing else reads it"),
    "badTagName": ("ignore", "a tag object whose name is no valid ref name: only the message text, the ref we "
                             "fetch is named by the server"),
    "missingTaggerEntry": ("ignore", "a tag without a tagger line (git before 0.99.1 wrote none)"),
    "badFilemode": ("ignore", "a tree mode git no longer writes (100664, 100600: git before 1.0 and converters; "
                              "git/git's own history has them): git checks the file out as a regular one, 100644"),
}
FSCK_CONFIG = {"fetch.fsckObjects": "true", **{f"fetch.fsck.{msg}": level for msg, (level, _why) in FSCK_CHOICES.items()}}


def git_env(base: dict[str, str] | None = None, credential: Credential | None = None,
            url: str | None = None, takes_objects: bool = False, fsck: bool = True) -> dict[str, str]:
    """The environment of one git process; url is given for network operations
    (which alone read the operator's config and may carry a credential). Fetches
    (url given, or takes_objects: a bundle's take-in) check what they bring in, but
    for fsck=False: a quarantined fetch, checked after (git/quarantine.py)."""
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
        "GIT_CONFIG_SYSTEM": os.devnull,
        "GIT_CONFIG_GLOBAL": operator_config or os.devnull,
        "GIT_ATTR_NOSYSTEM": "1",
        # Set but empty, each beats its config key (core.askPass, core.gitProxy) and runs nothing.
        "GIT_ASKPASS": "",
        "SSH_ASKPASS": "",
        "GIT_PROXY_COMMAND": "",
        "LC_ALL": "C",
        "LANGUAGE": "C",
    })
    config = list(SAFE_CONFIG.items())
    if (url is not None or takes_objects) and fsck and base.get(FSCK_VAR, "on") != "off":
        config += FSCK_CONFIG.items()
    elif not fsck:
        config += [("fetch.fsckObjects", "false"), ("transfer.fsckObjects", "false")]  # not an operator's either
    if url is not None:
        operator = operator_settings(operator_config)
        env["GIT_SSH_COMMAND"] = ssh_command(base) or operator.ssh_command or SSH_DEFAULT
        # An empty helper empties the list gathered so far (a repository's helpers, which
        # would be given the credential to store); the operator's follow, then ours.
        config += [("credential.helper", ""), *operator.credential_helpers]
    auth_config, auth_env = git_auth(credential, url)
    config += auth_config.items()
    env.update(auth_env)
    env["GIT_CONFIG_COUNT"] = str(len(config))
    for index, (key, value) in enumerate(config):
        env[f"GIT_CONFIG_KEY_{index}"] = key
        env[f"GIT_CONFIG_VALUE_{index}"] = value
    return env


class OperatorSettings:
    """What the operator's git config says of the two things we must restate above a
    repository's level: its ssh command and its credential helpers, in their order."""

    def __init__(self, ssh_command: str | None = None, credential_helpers: tuple[tuple[str, str], ...] = ()):
        self.ssh_command = ssh_command
        self.credential_helpers = credential_helpers


NO_OPERATOR_SETTINGS = OperatorSettings()


def operator_settings(path: str | None) -> OperatorSettings:
    if not path:
        return NO_OPERATOR_SETTINGS
    try:
        stat = os.stat(path)
    except OSError:
        return NO_OPERATOR_SETTINGS  # git reads no file there either
    return _read_operator_settings(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read_operator_settings(path: str, _mtime_ns: int, _size: int) -> OperatorSettings:
    # git's own reading (includes, quoting, `credential.<url>.helper`), once per version of the file.
    done = subprocess.run(["git", "config", "--file", path, "--includes", "--null", "--get-regexp",
                           r"^(credential\..*helper|core\.sshcommand)$"],
                          capture_output=True, env={"PATH": os.environ.get("PATH", os.defpath),
                                                    "GIT_CONFIG_NOSYSTEM": "1", "HOME": os.devnull}, cwd="/")
    ssh, helpers = None, []
    for entry in done.stdout.decode(errors="surrogateescape").split("\0"):
        key, _, value = entry.partition("\n")
        if key == "core.sshcommand":
            ssh = value or None
        elif key.startswith("credential."):
            helpers.append((key, value))
    return OperatorSettings(ssh, tuple(helpers))


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
        if path is not None and any(char in path for char in '"\\\n\r\t'):
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{var}={path[:200]!r}: ssh cannot be given a path with a "
                                                          f"double quote, backslash or control character")
    if key is not None:
        # Only this key: not whatever an agent or ~/.ssh offers first.
        # -o, not -i: -i drops a path it cannot stat before expanding %%.
        parts += ["-o", shlex.quote(f'IdentityFile="{_ssh_path(key)}"'), "-o", "IdentitiesOnly=yes",
                  "-o", "IdentityAgent=none"]
    if known is not None:
        # ssh splits an option's value at blanks unless it is in double quotes.
        parts += ["-o", shlex.quote(f'UserKnownHostsFile="{_ssh_path(known)}"'),
                  "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes"]
    return " ".join(parts)


def _ssh_path(path: str) -> str:
    """A path as ssh reads it in -i and UserKnownHostsFile, where it expands %-tokens (%d is
    the home directory): %% is a literal %. The caller refused paths ssh cannot quote."""
    return path.replace("%", "%%")
