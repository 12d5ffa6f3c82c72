"""Where bundles live: CHECKOUTCACHE_BUNDLE_URI, and the layout of a bundle store.

Pure: parses and names, touches nothing. The layout below is a contract
between the nodes of a fleet (publishers and seeders of different versions),
as store/layout.py is for a root:

    <location>/                    s3://bucket/prefix, file:///dir or https://host/path
    └── <bundle key>/              one repository in one owner scope: its store key under
        │                          the default settings (every settings variant of a
        │                          repository shares one mirror's worth of objects)
        ├── bundle-list            git's bundle list (`git config` format, mode=all,
        │                          heuristic=creationToken); replaced whole, never
        │                          edited in place: a reader sees the old list or the new
        ├── <token>-<id>.bundle    a git bundle (v2): a full one (no prerequisites) or an
        │                          increment on the bundles of lower tokens in the same list.
        │                          Written whole before any list names it; never rewritten.
        ├── <token>-<id>.retired   written when a publisher first finds that bundle in no list:
        │                          the bundle and its heads are deleted --prune-after later
        │                          (a publisher that read an older list has finished by then)
        └── <token>-<id>.heads     the repository's branches and tags when that bundle was made
                                   (`<sha> <ref>` lines): publishers read them to make the
                                   next increment (everything not reachable from them);
                                   seeders never do. Written before the list names the bundle.

<token> is the creationToken (the publish time in whole seconds, kept
increasing within a list); <id> is random, so two publishers never write the
same name. A bundle no list names is marked retired, then deleted with its
heads --prune-after later (readers of a previous list finish their downloads,
publishers that read it finish their run, first).

A location names no credentials: `https://user:secret@...` and query strings
are refused (they would reach logs). S3 credentials come from the standard
AWS chain (environment, ~/.aws, instance roles), its endpoint from
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL for S3-compatible stores.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import NamedTuple

from checkoutcache.errors import CheckoutCacheError
from checkoutcache.repospec import identity, repo_key

BUNDLE_URI_VAR = "CHECKOUTCACHE_BUNDLE_URI"
LIST_NAME = "bundle-list"
BUNDLE_SUFFIX = ".bundle"
HEADS_SUFFIX = ".heads"
RETIRED_SUFFIX = ".retired"
# A file:// store's objects in the making (temp file, then rename); pruned like the rest.
TMP_PREFIX = ".tmp-"
SCHEMES = ("s3", "file", "https")
# S3 bucket names: 3-63 of lower-case letters, digits, dots and hyphens.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_OBJECT = re.compile(r"(?P<token>[0-9]{1,20})-(?P<id>[0-9a-f]{8,32})(?P<suffix>\.bundle|\.heads|\.retired)")


class BundleLocation(NamedTuple):
    scheme: str  # s3, file or https
    host: str  # the bucket (s3), the host[:port] (https), "" (file)
    path: str  # the prefix (s3: no leading or trailing "/"), the directory or base path

    @property
    def writable(self) -> bool:
        return self.scheme in ("s3", "file")

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        if self.scheme == "s3":
            return f"s3://{self.host}/{self.path}".rstrip("/")
        return f"https://{self.host}{self.path}"

    def repository(self, bundle_key: str) -> str:
        """The repository's folder: an S3 key prefix, a directory or a URL path (no trailing '/')."""
        return "/".join(p for p in (self.path.rstrip("/"), bundle_key) if p) if self.scheme == "s3" \
            else f"{self.path.rstrip('/')}/{bundle_key}"


def _bad(why: str) -> CheckoutCacheError:
    return CheckoutCacheError("BAD_ARGUMENT", what=f"{BUNDLE_URI_VAR}: {why}")


def parse_bundle_uri(raw: object) -> BundleLocation | None:
    """A bundle store location, or None for "" / "off"; raise BAD_ARGUMENT if unusable."""
    text = str(raw).strip() if raw is not None else ""
    if text in ("", "off", "none"):
        return None
    if len(text) > 1024 or any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise _bad("is longer than 1024 characters or has control characters")
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        raise _bad(f"is not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        # http:// would carry bundles (and whatever list it serves) unauthenticated
        # and unencrypted; the repository transports are not opened by this setting.
        raise _bad(f"the scheme {scheme or '(none)'!r} is not s3://, https:// or file://")
    if parts.username or parts.password:
        raise _bad("names credentials; give S3 credentials through the AWS environment instead")
    if parts.query or parts.fragment:
        raise _bad("takes no '?query' or '#fragment' (they would reach the logs)")
    path = urllib.parse.unquote(parts.path)
    if ".." in path.split("/"):
        raise _bad("contains a '..' path component")
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise _bad("a file:// location names an absolute local path (file:///dir)")
        return BundleLocation("file", "", path.rstrip("/") or "/")
    if scheme == "s3":
        if not _BUCKET.fullmatch(parts.netloc):
            raise _bad(f"{parts.netloc[:70]!r} is not an S3 bucket name")
        return BundleLocation("s3", parts.netloc, path.strip("/"))
    if not parts.hostname:
        raise _bad("an https:// location names a host")
    return BundleLocation("https", parts.netloc.lower(), path.rstrip("/"))


def bundle_key(scope: str, url: str, is_local: bool) -> str:
    """A repository's folder in the bundle store: its store key under the default settings."""
    return repo_key(scope, identity(url, is_local))


def object_name(token: int, object_id: str, suffix: str = BUNDLE_SUFFIX) -> str:
    return f"{token}-{object_id}{suffix}"


def heads_name(bundle_name: str) -> str:
    return bundle_name[: -len(BUNDLE_SUFFIX)] + HEADS_SUFFIX


def retired_name(bundle_name: str) -> str:
    return bundle_name[: -len(BUNDLE_SUFFIX)] + RETIRED_SUFFIX


def parse_object_name(name: str) -> tuple[int, str, str] | None:
    """(token, id, suffix) of an object a publisher wrote; None for any other name."""
    match = _OBJECT.fullmatch(name)
    return (int(match["token"]), match["id"], match["suffix"]) if match else None
