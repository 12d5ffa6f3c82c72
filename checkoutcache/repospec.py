"""What a request names: a repository (normalized, keyed, credentials apart),
a commit id and an owner scope. Pure: reads no disk except os.path.realpath
for local paths, writes nothing, imports no git library.

Invariants kept here:
- a repository's key is a hash over a domain tag, the scope and the
  repository's identity, so distinct scopes never share a store and keys are
  never raw paths;
- one repository, one key: equivalent spellings have one identity (below), so
  they share one mirror and one clone per commit. The URL we fetch from and
  show is the one given (normalized, credentials removed);
- credentials found in a URL are split off into a Credential that never appears
  in the normalized URL, a repr, or an error message;
- only safe transports pass (https, ssh, git, file and local paths): `ext::`
  and other remote helpers are refused before git ever sees them;
- anything malformed raises CheckoutCacheError with an input code.
"""

from __future__ import annotations

import hashlib
import os
import re
import urllib.parse
from typing import NamedTuple

from checkoutcache.credentials import Credential, https_host, strip_userinfo
from checkoutcache.errors import CheckoutCacheError

MAX_REPO_LEN = 2048
# The domain tag of repository keys (store/layout.py draws where keys are used).
REPO_KEY_DOMAIN = b"checkoutcache-repo-v1"
DEFAULT_SCOPE = "default"
# CHECKOUTCACHE_LFS: LFS content fetched (the default) or left as pointer files.
LFS_ON, LFS_OFF = "on", "off"
LFS_SETTING_VAR = "CHECKOUTCACHE_LFS"
SUBMODULES_RECURSIVE, SUBMODULES_NONE = "recursive", "none"
SUBMODULES_SETTING_VAR = "CHECKOUTCACHE_SUBMODULES"

_COMMIT = re.compile(r"[0-9a-f]{40}")
_SCOPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HELPER_TRANSPORT = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*::")
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SCP_LIKE = re.compile(r"^(?:(?P<user>[^@/:\s]+)@)?(?P<host>[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):(?P<path>.*)$")
_HOST = re.compile(r"^([A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:.]+\])$")
_SCHEMES = {"https": 443, "ssh": 22, "git": 9418, "file": None}
_SCHEME_ALIASES = {"git+ssh": "ssh", "ssh+git": "ssh"}


class RepoSpec(NamedTuple):
    url: str
    scope: str
    key: str
    is_local: bool
    credential: Credential | None = None  # its repr shows no secret
    # The key layout v1 gave this spelling, when it differs from `key`: a store
    # made under it keeps being used (see store/create.py's store_key).
    legacy_key: str | None = None
    # CHECKOUTCACHE_LFS: a store holds checkouts made under one setting only.
    lfs: str = LFS_ON
    submodules: str = SUBMODULES_RECURSIVE


def identity(url: str, is_local: bool) -> str:
    """What makes two spellings one repository (docs/commands.md "One repository, one key"):
    - a local path or file:// URL: its real path, without a final `/.git`
      (`/srv/up/.git` is `/srv/up`);
    - `user@host:path` is `ssh://user@host/path`;
    - any URL: the host in lower case, no default port, no credentials, and
      no trailing `/` or `.git` (`https://host/org/repo.git/` is
      `https://host/org/repo`).
    """
    if is_local:
        return url[: -len("/.git")] if url.endswith("/.git") and len(url) > len("/.git") else url
    scp = None if "://" in url else _SCP_LIKE.match(url)
    if scp is not None:
        user = f"{scp.group('user')}@" if scp.group("user") else ""
        url = f"ssh://{user}{scp.group('host')}/{scp.group('path').lstrip('/')}"
    url = url.rstrip("/")
    if url.endswith(".git"):
        url = url[: -len(".git")].rstrip("/")
    return url


def _shown(value: str, limit: int = 60) -> str:
    """A bad value as an error message may show it: short, credentials dropped."""
    text = strip_userinfo(value)
    text = text if len(text) <= limit else text[:limit] + f"... ({len(value)} characters)"
    return repr(text)


def parse_commit(commit: object) -> str:
    if not isinstance(commit, str):
        raise CheckoutCacheError("BAD_COMMIT", got=repr(type(commit).__name__))
    if _COMMIT.fullmatch(commit.lower()) is None:
        if commit == "":
            got = "an empty string"
        elif re.fullmatch(r"[0-9a-fA-F]{4,39}", commit):
            got = f"{_shown(commit)} (an abbreviated id)"
        elif re.fullmatch(r"[0-9a-fA-F]{64}", commit):
            got = f"{_shown(commit)} (a SHA-256 id; this store serves SHA-1 repositories)"
        elif len(commit) > 40 and re.fullmatch(r"[0-9a-fA-F]+", commit):
            got = f"{_shown(commit)} (too long)"
        else:
            got = f"{_shown(commit)} (a branch, tag or other name?)"
        raise CheckoutCacheError("BAD_COMMIT", got=got)
    return commit.lower()


def parse_scope(scope: object) -> str:
    if not isinstance(scope, str) or _SCOPE.fullmatch(scope) is None:
        raise CheckoutCacheError("BAD_SCOPE", got=_shown(str(scope)))
    return scope


def parse_lfs(value: object) -> str:
    """The LFS setting: on (LFS files with their content) or off (pointer files)."""
    text = str(value).strip().lower() if isinstance(value, str) else ""
    if text not in (LFS_ON, LFS_OFF):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{LFS_SETTING_VAR} {_shown(str(value), 20)} is not on or off")
    return text


def parse_submodules(value: object) -> str:
    """The submodules setting: recursive (every submodule's work tree) or none."""
    text = str(value).strip().lower() if isinstance(value, str) else ""
    if text not in (SUBMODULES_RECURSIVE, SUBMODULES_NONE):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{SUBMODULES_SETTING_VAR} {_shown(str(value), 20)} is not "
                                                      f"recursive or none")
    return text


def repo_key(scope: str, url: str, lfs: str = LFS_ON, submodules: str = "recursive") -> str:
    """The store's key. A non-default LFS or submodules setting is part of it, so
    checkouts made under different settings never share a path; the defaults keep
    the keys of stores made before the settings existed."""
    tail = b"" if lfs == LFS_ON else b"\0lfs=" + lfs.encode()
    tail += b"" if submodules == SUBMODULES_RECURSIVE else b"\0submodules=" + submodules.encode()
    digest = hashlib.sha256(REPO_KEY_DOMAIN + b"\0" + scope.encode() + b"\0" + url.encode() + tail)
    return digest.hexdigest()[:32]


def _bad(why: str) -> CheckoutCacheError:
    return CheckoutCacheError("BAD_REPO", why=why)


def _check_path_parts(path: str) -> None:
    if ".." in path.split("/"):
        raise _bad("it contains a '..' path component")


def _missing_scheme_hint(raw: str, cwd: str | None) -> str | None:
    """For what reads as a local path but is not one, and looks like a remote spelled
    without its scheme (`github.com/org/repo`, `git@github.com/org/repo`): what to give
    instead. None for anything that exists here or looks like a path."""
    first, _, rest = raw.partition("/")
    if not rest or raw.startswith((".", "/", "~")):
        return None
    user, at, host = first.rpartition("@")
    if "." not in host or not _HOST.match(host) or not re.search(r"\.[A-Za-z]{2,}$", host):
        return None
    if os.path.lexists(os.path.join(cwd or os.getcwd(), raw)):
        return None
    if at:
        return (f"{_shown(raw)} is not a local path; an ssh address needs a ':' after the host: "
                f"{user}@{host}:{rest}")
    return (f"{_shown(raw)} is not a local path; a repository on {host} needs a URL, such as "
            f"https://{host}/{rest} or git@{host}:{rest}")


def _local(path: str, cwd: str | None) -> tuple[str, bool]:
    path = os.path.expanduser(path)
    _check_path_parts(path)
    if not os.path.isabs(path):
        path = os.path.join(cwd or os.getcwd(), path)
    real = os.path.realpath(path)
    if len(real) > MAX_REPO_LEN:
        raise _bad(f"the path is longer than {MAX_REPO_LEN} characters")
    return real, True


# Transports git knows that are not allowed here (UNSAFE_TRANSPORT); any other scheme
# is a mistake (BAD_REPO, with the allowed scheme it is closest to).
_REFUSED_SCHEMES = frozenset({"http", "ftp", "ftps", "ext", "fd", "rsync", "git+http", "git+https"})


def _url(raw: str, scheme: str) -> tuple[str, bool, Credential | None]:
    scheme = _SCHEME_ALIASES.get(scheme, scheme)
    if scheme not in _SCHEMES:
        if scheme in _REFUSED_SCHEMES:
            raise CheckoutCacheError("UNSAFE_TRANSPORT", scheme=scheme)
        import difflib

        close = difflib.get_close_matches(scheme, list(_SCHEMES), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}://?)" if close else ""
        raise _bad(f"{_shown(scheme, 20)}:// is not a URL scheme git knows{hint}")
    try:
        parts = urllib.parse.urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise _bad(f"it is not a valid URL ({exc})") from None
    if parts.query or parts.fragment:
        raise _bad("a repository URL takes no '?query' or '#fragment'")
    path = urllib.parse.unquote(parts.path)
    if "\0" in path or any(ord(c) < 32 for c in path):
        raise _bad("it contains control characters")
    _check_path_parts(path)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise _bad("a file:// URL must name a local path (file:///path)")
        real, _ = _local(path, None)
        return real, True, None
    host = (parts.hostname or "").lower()
    if not host or not _HOST.match(host if ":" not in host else f"[{host}]"):
        raise _bad("it names no valid host")
    if not path or path == "/":
        raise _bad("it names no repository path on the host")
    credential = None
    user = ""
    if scheme == "https" and (parts.username or parts.password):
        credential = Credential(urllib.parse.unquote(parts.username or ""),
                                urllib.parse.unquote(parts.password or ""))
    elif scheme == "ssh" and parts.username:
        user = parts.username + "@"  # an ssh login is identity, not a secret
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _SCHEMES[scheme]:
        netloc += f":{port}"
    normalized = f"{scheme}://{user}{netloc}{path}".rstrip("/")
    if credential is not None:  # a credential in a URL goes to that URL's host only
        credential = credential._replace(hosts=(https_host(normalized),))
    return normalized, False, credential


def parse_repo(raw: object, scope: str = DEFAULT_SCOPE, cwd: str | None = None, lfs: str = LFS_ON,
               submodules: str = SUBMODULES_RECURSIVE) -> RepoSpec:
    """Validate and normalize a repository argument; raise CheckoutCacheError if bad.
    lfs: the CHECKOUTCACHE_LFS setting the checkouts are made under (part of the key when off)."""
    scope = parse_scope(scope)
    lfs = parse_lfs(lfs)
    submodules = parse_submodules(submodules)
    if not isinstance(raw, str) or raw == "":
        raise _bad("it is empty")
    if len(raw) > MAX_REPO_LEN:
        raise _bad(f"it is longer than {MAX_REPO_LEN} characters")
    if "\0" in raw or any(ord(c) < 32 or ord(c) == 127 for c in raw):
        raise _bad("it contains a NUL, newline or other control character")
    if raw.startswith("-"):
        raise _bad("it starts with '-' and would be read as an option")
    helper = _HELPER_TRANSPORT.match(raw)
    if helper:
        raise CheckoutCacheError("UNSAFE_TRANSPORT", scheme=raw[: helper.end()])
    credential = None
    scheme = _URL_SCHEME.match(raw)
    if scheme:
        url, is_local, credential = _url(raw, scheme.group(1).lower())
    elif (scp := _SCP_LIKE.match(raw)) and "/" not in raw.split(":", 1)[0]:
        path = scp.group("path")
        if not path:
            raise _bad("it names no repository path on the host")
        _check_path_parts(path)
        user = f"{scp.group('user')}@" if scp.group("user") else ""
        url, is_local = f"{user}{scp.group('host').lower()}:{path.rstrip('/')}", False
    else:
        hint = _missing_scheme_hint(raw, cwd)
        if hint is not None:
            raise _bad(hint)
        url, is_local = _local(raw, cwd)
    key = repo_key(scope, identity(url, is_local), lfs, submodules)
    # Stores of layout v1 all had the default settings.
    legacy = repo_key(scope, url) if (lfs, submodules) == (LFS_ON, SUBMODULES_RECURSIVE) else key
    return RepoSpec(url=url, scope=scope, key=key, is_local=is_local, credential=credential,
                    legacy_key=legacy if legacy != key else None, lfs=lfs, submodules=submodules)

