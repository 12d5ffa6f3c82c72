"""Every knob in one place: each setting declared once with its environment
variable, default and one sentence of help. The CLI options, the worker's
environment and the README's option table all follow from this class, so the
same settings serve `ensure`, `gc` from cron and a sidecar.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import attrs

from checkoutcache.bundleuri import BundleLocation, parse_bundle_uri
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.repospec import parse_lfs, parse_submodules
from checkoutcache.units import FreeTarget, parse_duration, parse_free, parse_size


def _count(value: str | int) -> int:
    try:
        number = -1 if isinstance(value, (bool, float)) else int(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0:
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{str(value)[:40]!r} is not a whole number >= 0")
    return number


def _ref_patterns(value: str | tuple) -> tuple[str, ...]:
    if isinstance(value, str) and value.strip() == "none":
        return ()
    patterns = tuple(value) if isinstance(value, (tuple, list)) else \
        tuple(p.strip() for p in str(value).split(",") if p.strip())
    for pattern in patterns:
        if not pattern.startswith("refs/") or pattern.count("*") > 1 or any(c in pattern for c in " :^~?[\\"):
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"review ref pattern {pattern[:60]!r} is not refs/... "
                                                          f"with at most one '*'")
    return patterns


def _on_off(variable: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in ("on", "off"):
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{variable}: {str(value)[:40]!r} is not on or off")
        return text

    return parse


def _transport(value: str) -> str:
    if value not in ("auto", "cli", "pygit2"):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"transport {str(value)[:40]!r} is not auto, cli or pygit2")
    return value


def setting(default: Any, env: str, help: str, parse: Callable[[Any], Any], show: str | None = None):
    return attrs.field(default=default, metadata={"env": env, "help": help, "parse": parse,
                                                  "show": show if show is not None else str(default)})


@attrs.frozen
class Config:
    grace: float = setting(900.0, "CHECKOUTCACHE_GRACE",
                           "A checkout used within this window is never evicted.", parse_duration, "15m")
    max_checkouts: int | None = setting(None, "CHECKOUTCACHE_MAX_CHECKOUTS",
                                        "gc keeps at most this many checkouts per root.", _count, "unlimited")
    max_bytes: int | None = setting(None, "CHECKOUTCACHE_MAX_BYTES",
                                    "gc keeps checkouts within this many bytes in all.", parse_size, "unlimited")
    min_free: FreeTarget | None = setting(None, "CHECKOUTCACHE_MIN_FREE",
                                          "gc starts evicting when the disk has less free space than this.",
                                          parse_free, "off")
    free_headroom: FreeTarget = setting(FreeTarget(percent=2.0), "CHECKOUTCACHE_FREE_HEADROOM",
                                        "Once started, gc evicts until free space is min-free plus this.",
                                        parse_free, "2%")
    max_age: float | None = setting(None, "CHECKOUTCACHE_MAX_AGE",
                                    "gc evicts checkouts unused for longer than this.", parse_duration, "off")
    mirror_gc_interval: float = setting(3600.0, "CHECKOUTCACHE_MIRROR_GC_INTERVAL",
                                        "gc repacks a mirror to drop objects no checkout needs at most this often.",
                                        parse_duration, "1h")
    clone_timeout: float = setting(600.0, "CHECKOUTCACHE_CLONE_TIMEOUT",
                                   "A clone running longer is stopped and fails with TIMEOUT.", parse_duration, "10m")
    backoff: float = setting(30.0, "CHECKOUTCACHE_BACKOFF",
                             "The first back-off after a failed clone; it doubles with each failure.",
                             parse_duration, "30s")
    backoff_max: float = setting(900.0, "CHECKOUTCACHE_BACKOFF_MAX",
                                 "The longest back-off between attempts.", parse_duration, "15m")
    probe_timeout: float = setting(30.0, "CHECKOUTCACHE_PROBE_TIMEOUT",
                                   "How long the first contact with a new repository may take.",
                                   parse_duration, "30s")
    review_refs: tuple[str, ...] = setting(
        ("refs/pull/*", "refs/merge-requests/*", "refs/changes/*"), "CHECKOUTCACHE_REVIEW_REFS",
        "Where review commits live, fetched when a server refuses a commit by id (comma-separated, or none).",
        lambda v: _ref_patterns(v), "refs/pull/*,refs/merge-requests/*,refs/changes/*")
    fsck: str = setting("on", "CHECKOUTCACHE_FSCK",
                        "git checks every fetched object (fetch.fsckObjects): malformed trees, `..` or `.git` "
                        "paths are refused before they reach a checkout (off: not checked).", _on_off("CHECKOUTCACHE_FSCK"))
    max_review_refs: int = setting(2000, "CHECKOUTCACHE_MAX_REVIEW_REFS",
                                   "The most review refs one attempt fetches (newest first, in batches) looking for "
                                   "a commit the server refuses by id.", _count)
    transport: str = setting("auto", "CHECKOUTCACHE_TRANSPORT",
                             "Fetch and check out with the git CLI (cli), libgit2 (pygit2), or the CLI when installed (auto).",
                             _transport)
    submodules: str = setting("recursive", "CHECKOUTCACHE_SUBMODULES",
                              "Check out every submodule's work tree, nested ones too (recursive), or none. "
                              "Checkouts made under each setting are kept apart.", parse_submodules)
    max_submodules: int = setting(100, "CHECKOUTCACHE_MAX_SUBMODULES",
                                  "A commit whose submodules (all levels) need more checkouts fails with "
                                  "SUBMODULE_FAILED.", _count)
    max_submodule_bytes: int = setting(4 << 30, "CHECKOUTCACHE_MAX_SUBMODULE_BYTES",
                                       "A commit whose submodules (all levels) hold more bytes fails with "
                                       "SUBMODULE_FAILED.", parse_size, "4G")
    lfs: str = setting("on", "CHECKOUTCACHE_LFS",
                       "Check out Git LFS files with their content (on; needs git-lfs) or as pointer files (off). "
                       "Checkouts made under each setting are kept apart.", parse_lfs)
    bundle_uri: BundleLocation | None = setting(
        None, "CHECKOUTCACHE_BUNDLE_URI",
        "Seed a new mirror from the bundles at this s3://, https:// or file:// location before fetching "
        "from upstream (README \"Fleets: seeding from bundles\"); also where `bundle publish` writes.",
        parse_bundle_uri, "off")

    seed_timeout: float = setting(120.0, "CHECKOUTCACHE_SEED_TIMEOUT",
                                  "The longest a new mirror spends taking in bundles; not counted in the clone "
                                  "timeout (a slow store costs speed, never the clone).", parse_duration, "2m")

    @classmethod
    def from_env(cls, environ: os._Environ | dict[str, str] | None = None, **overrides: Any) -> "Config":
        """Explicit overrides (CLI options) win over the environment, which wins over defaults."""
        environ = os.environ if environ is None else environ
        values = {}
        for field in attrs.fields(cls):
            raw = overrides.get(field.name)
            if raw is None:
                raw = environ.get(field.metadata["env"]) or None
            if raw is not None:
                values[field.name] = field.metadata["parse"](raw)
        return cls(**values)

    def with_overrides(self, **raw: Any) -> "Config":
        """This config with some settings replaced, each parsed from its human form."""
        fields = attrs.fields_dict(type(self))
        parsed = {name: fields[name].metadata["parse"](value) for name, value in raw.items() if value is not None}
        return attrs.evolve(self, **parsed)

    def to_env(self) -> dict[str, str]:
        """The environment that makes a child process (the clone worker) see this config."""
        env = {}
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if value is not None:
                listed = isinstance(value, tuple) and not hasattr(value, "_fields")  # a NamedTuple shows itself
                env[field.metadata["env"]] = (",".join(value) or "none") if listed else str(value)
        return env


def options_table() -> str:
    """The README's option table, from the same declarations."""
    rows = ["| setting | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for field in attrs.fields(Config):
        name = field.name.replace("_", "-")
        rows.append(f"| `--{name}` | `{field.metadata['env']}` | {field.metadata['show']} | {field.metadata['help']} |")
    return "\n".join(rows)
