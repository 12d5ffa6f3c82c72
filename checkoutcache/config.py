"""Every knob in one place: each setting declared once, with its environment
variable, default, one sentence of help and how it is parsed. The commands'
options (cli/commands.py: `--name` for every field), the environment a clone
worker is given, the settings tables of docs/operations.md and the errors about a setting
(which name the option or variable) all follow from these declarations, so the
same settings serve `ensure`, cron's `gc` and a sidecar.

- Config: how the cache behaves (limits, clones, submodules, LFS, bundles);
  read by every command that touches the store, and by its clone workers.
- ServeSettings: the sidecar's own (listeners, tokens, bounds, logs).
- PublishSettings: `bundle publish`'s own (chains and pruning).

An option given on the command line wins over the environment, which wins
over the default; a malformed value is BAD_ARGUMENT naming where it came from
(`--max-checkouts` or `CHECKOUTCACHE_MAX_CHECKOUTS`).
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import attrs

from checkoutcache.bundles.location import BundleLocation, parse_bundle_uri
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.repospec import parse_lfs, parse_submodules
from checkoutcache.sharing import SHARING_VAR, WRITER, parse_sharing
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


def _on_off(value: Any) -> str:
    text = str(value).strip().lower()
    if text not in ("on", "off"):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{str(value)[:40]!r} is not on or off")
    return text


# The partial-clone filters a mirror may have (git/cli.py holds a mirror's recorded one to it too).
FILTER_SPEC = re.compile(r"blob:none|blob:limit=[0-9]{1,12}[kmg]?")


def _filter(value: Any) -> str | None:
    """A partial-clone filter git and every forge that serves partial clones know."""
    text = str(value).strip().lower()
    if text in ("off", "none", ""):
        return None
    if not FILTER_SPEC.fullmatch(text):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{str(value)[:40]!r} is not a filter this cache uses: "
                                                      f"blob:none, blob:limit=SIZE (e.g. 1m) or off")
    return text


def _flag(value: Any) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise CheckoutCacheError("BAD_ARGUMENT", what=f"{str(value)[:40]!r} is not on or off")


def _one_of(*allowed: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in allowed:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{str(value)[:40]!r} is not {', '.join(allowed)}")
        return text

    return parse


def _niceness(value: Any) -> int:
    number = _count(value)
    if number > 19:
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{str(value)[:40]!r} is not a niceness of 0 to 19")
    return number


def _patterns(value: Any) -> tuple[str, ...]:
    if isinstance(value, (tuple, list)):
        return tuple(str(v) for v in value if str(v).strip())
    return tuple(p.strip() for p in str(value).split(",") if p.strip())


def _patterns_or_none(value: Any) -> tuple[str, ...]:
    """Patterns, or none at all ("none": how to_env writes an empty list)."""
    return () if isinstance(value, str) and value.strip() == "none" else _patterns(value)


def _transport(value: str) -> str:
    if value not in ("auto", "cli", "pygit2"):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{str(value)[:40]!r} is not auto, cli or pygit2")
    return value


def _sharing(value: Any) -> str:
    try:
        return parse_sharing(value)
    except ValueError as exc:
        raise CheckoutCacheError("BAD_ARGUMENT", what=str(exc)) from None


def _text(value: Any) -> str:
    return str(value)


def _directory(value: Any) -> str:
    text = os.path.expanduser(str(value).strip())
    if not os.path.isabs(text) or "\0" in text:
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{str(value)[:60]!r} is not an absolute directory path")
    return text


def _shown(value: Any) -> str:
    """A value as an error shows it: quoted, cut, control characters escaped."""
    return repr(str(value)[:120])


# Paths in settings are checked twice: their form when parsed (pure: the deploy manifests'
# values are checked so, away from the container), and what is there when read on the machine
# that uses them (a `present` check: Settings.from_env).

def _path(value: Any, what: str) -> str:
    text = str(value)
    if not text or any(ord(c) < 32 for c in text):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{_shown(text)} is not a path ({what})")
    return text


def _absolute(value: Any, what: str) -> str:
    text = _path(value, what)
    if not os.path.isabs(text):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{_shown(text)} is not an absolute path ({what}; a relative "
                                                      f"one would depend on the working directory)")
    return text


def _in_a_directory(what: str) -> Callable[[str], None]:
    """path's directory exists and is one; path itself is not a directory."""
    def present(path: str) -> None:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{_shown(path)}: its directory {_shown(parent)} does not "
                                                          f"exist ({what})")
        if os.path.isdir(path):
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{_shown(path)} is a directory ({what})")

    return present


def _readable_file(path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{_shown(path)} cannot be read: "
                                                      f"{exc.strerror or type(exc).__name__}") from None
    if not os.path.isfile(path):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{_shown(path)} is not a regular file")


def _output_file(value: Any) -> str:
    return _path(value, "a file to write")


def _input_file(value: Any) -> str:
    return _path(value, "a file to read")


# sun_path holds 108 bytes, the last a NUL.
UNIX_PATH_MAX = 107


def _socket_path(value: Any) -> str:
    """A Unix socket to listen on: absolute (never relative to wherever serve started) and
    short enough for sun_path."""
    text = _absolute(value, "a Unix socket to listen on")
    if len(os.fsencode(text)) > UNIX_PATH_MAX:
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{_shown(text)} is longer than a Unix socket's path may be "
                                                      f"({UNIX_PATH_MAX} bytes)")
    return text


# A host CHECKOUTCACHE_GIT_HOSTS may bind the credential to: host or host:port, as https_host
# writes it (lower case, no scheme, no path, no user).
HOST_NAME = re.compile(r"(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
                       r"|\[[0-9a-f:.]+\]")


def _git_hosts(value: Any) -> str:
    hosts = [h.strip().lower() for h in str(value).split(",") if h.strip()]  # as parse_hosts reads them
    for host in hosts:
        name, colon, port = host.rpartition(":") if not host.endswith("]") else (host, "", "")
        if not colon:
            name, port = host, ""
        if not HOST_NAME.fullmatch(name) or (colon and not (port.isdigit() and 0 < int(port) < 65536)):
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{_shown(host)} in {_shown(value)} is not a host or "
                                                          f"host:port (comma-separated, no scheme or path: e.g. "
                                                          f"github.com,git.example.com:8443)")
    return str(value)


def _git_config(value: Any) -> str:
    return _absolute(value, "a git config file")


def _clone_journal(value: Any) -> str:
    return _absolute(value, "a file clone workers append to")


# Variables read where they are used (the clone worker, git's environment, the credential),
# not through Config: each is checked when Config is read (its form, then, on this machine,
# what is there), so a bad value is BAD_ARGUMENT naming it before anything is written, never
# a silent no-op later. name -> (parse, present)
CHECKED_VARIABLES: dict[str, tuple[Callable[[Any], Any], Callable[[str], None] | None]] = {
    "CHECKOUTCACHE_GIT_CONFIG": (_git_config, _readable_file),
    "CHECKOUTCACHE_GIT_HOSTS": (_git_hosts, None),
    "CHECKOUTCACHE_CLONE_JOURNAL": (_clone_journal, _in_a_directory("a file clone workers append to")),
}


def check_variables(environ: os._Environ | dict[str, str], here: bool = True) -> None:
    for name, (parse, present) in CHECKED_VARIABLES.items():
        value = environ.get(name)
        if value:
            try:
                parse(value)
                if here and present is not None:
                    present(value)
            except CheckoutCacheError as exc:
                raise CheckoutCacheError("BAD_ARGUMENT", what=f"{name}: {exc.message}") from None


def _size_text(value: int | None) -> str:
    return f"{value}B"


def setting(default: Any, env: str, help: str, parse: Callable[[Any], Any], show: str | None = None,
            render: Callable[[Any], str] = str, flag: bool = False, many: bool = False,
            present: Callable[[Any], None] | None = None):
    """One setting: its environment variable, default, help, parser; render gives the value
    back as the environment carries it; flag: a command-line switch; many: a repeatable option;
    present: what must be there on the machine that reads it (a path's directory, a file)."""
    return attrs.field(default=default, metadata={"env": env, "help": help, "parse": parse, "render": render,
                                                  "show": show if show is not None else str(default),
                                                  "flag": flag, "many": many, "present": present})


class Settings:
    """What Config and ServeSettings share: reading, overriding and handing on."""

    @classmethod
    def from_env(cls, environ: os._Environ | dict[str, str] | None = None, *, here: bool = True, **overrides: Any):
        """Explicit overrides (command-line options) win over the environment, which wins over defaults.
        here: also check what the settings name on this machine (False: their form only, e.g. a
        manifest's values away from its container)."""
        environ = os.environ if environ is None else environ
        values = {}
        for field in attrs.fields(cls):
            raw, source = overrides.get(field.name), f"--{field.name.replace('_', '-')}"
            if raw is None or raw == ():
                raw, source = environ.get(field.metadata["env"]) or None, field.metadata["env"]
            if raw is not None:
                values[field.name] = _parsed(field, raw, source, here)
        if cls is Config:
            check_variables(environ, here)
        return cls(**values)

    def with_overrides(self, **raw: Any):
        """These settings with some replaced, each parsed from its human form."""
        fields = attrs.fields_dict(type(self))
        parsed = {name: _parsed(fields[name], value, name) for name, value in raw.items() if value is not None}
        return attrs.evolve(self, **parsed)

    def to_env(self) -> dict[str, str]:
        """The environment that makes a child process (the clone worker) see these settings."""
        env = {}
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if value is not None:
                listed = isinstance(value, tuple) and not hasattr(value, "_fields")  # a NamedTuple shows itself
                env[field.metadata["env"]] = (",".join(value) or "none") if listed else field.metadata["render"](value)
        return env


def _parsed(field, raw: Any, source: str, here: bool = False) -> Any:
    try:
        value = field.metadata["parse"](raw)
        if here and value is not None and field.metadata.get("present") is not None:
            field.metadata["present"](value)
        return value
    except CheckoutCacheError as exc:
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{source}: {exc.message}") from None


@attrs.frozen
class Config(Settings):
    grace: float = setting(900.0, "CHECKOUTCACHE_GRACE",
                           "A checkout used within this window is never evicted.", parse_duration, "15m")
    max_checkouts: int | None = setting(None, "CHECKOUTCACHE_MAX_CHECKOUTS",
                                        "gc keeps at most this many checkouts per root.", _count, "unlimited")
    max_bytes: int | None = setting(None, "CHECKOUTCACHE_MAX_BYTES",
                                    "gc keeps checkouts within this many bytes in all.", parse_size, "unlimited",
                                    _size_text)
    min_free: FreeTarget | None = setting(None, "CHECKOUTCACHE_MIN_FREE",
                                          "gc starts evicting when the disk has less free space than this.",
                                          parse_free, "off")
    free_headroom: FreeTarget = setting(FreeTarget(percent=2.0), "CHECKOUTCACHE_FREE_HEADROOM",
                                        "Once started, gc evicts until free space is min-free plus this.",
                                        parse_free, "2%")
    max_age: float | None = setting(None, "CHECKOUTCACHE_MAX_AGE",
                                    "gc evicts checkouts unused for longer than this.", parse_duration, "off")
    max_held: int = setting(16, "CHECKOUTCACHE_MAX_HELD",
                            "Checkouts a reader's lock (an exec, a workspace, any process with the marker "
                            "locked shared) keeps past a limit, at most: past it, the least recently used "
                            "held ones go when a limit needs them (serve's own holds have their own bounds).",
                            _count)
    max_hold_age: float = setting(6 * 3600.0, "CHECKOUTCACHE_MAX_HOLD_AGE",
                                  "A checkout a reader's lock has held this long (as gc's runs saw it) keeps "
                                  "no protection past a limit.", parse_duration, "6h")
    max_spares: int = setting(4, "CHECKOUTCACHE_MAX_SPARES",
                              "gc keeps at most this many evicted trees per root as spares, updated in place "
                              "into a later commit's checkout (0: evicted trees are deleted).", _count)
    repo_max_idle: float = setting(7 * 86400.0, "CHECKOUTCACHE_REPO_MAX_IDLE",
                                   "gc removes a whole repository (mirror, LFS objects) that has no checkout, "
                                   "hold or clone left and was unused for longer than this; past the grace "
                                   "window already when min-free is unmet.", parse_duration, "7d")
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
                        "paths are refused before they reach a checkout (off: not checked).", _on_off)
    max_review_refs: int = setting(2000, "CHECKOUTCACHE_MAX_REVIEW_REFS",
                                   "The most review refs one attempt fetches (newest first, in batches) looking for "
                                   "a commit the server refuses by id.", _count)
    transport: str = setting("auto", "CHECKOUTCACHE_TRANSPORT",
                             "Fetch and check out with the git CLI (cli), libgit2 (pygit2), or the CLI when installed (auto).",
                             _transport)
    submodules: str = setting("recursive", "CHECKOUTCACHE_SUBMODULES",
                              "Check out every submodule's work tree, nested ones too (recursive), or none. "
                              "Checkouts made under each setting are kept apart.", parse_submodules)
    submodule_repos: tuple[str, ...] = setting((), "CHECKOUTCACHE_SUBMODULE_TOKEN_REPOS",
                                               "Repositories a submodule must match too, besides serve's "
                                               "allow-list: serve sets it for the clones a token with repos= "
                                               "started (shell patterns, comma-separated).", _patterns_or_none,
                                               "none", render=",".join, many=True)
    max_submodules: int = setting(100, "CHECKOUTCACHE_MAX_SUBMODULES",
                                  "A commit whose submodules (all levels) need more checkouts fails with "
                                  "SUBMODULE_FAILED.", _count)
    max_submodule_bytes: int = setting(4 << 30, "CHECKOUTCACHE_MAX_SUBMODULE_BYTES",
                                       "A commit whose submodules (all levels) hold more bytes fails with "
                                       "SUBMODULE_FAILED.", parse_size, "4G", _size_text)
    lfs: str = setting("on", "CHECKOUTCACHE_LFS",
                       "Check out Git LFS files with their content (on; needs git-lfs) or as pointer files (off). "
                       "Checkouts made under each setting are kept apart.", parse_lfs)
    bundle_uri: BundleLocation | None = setting(
        None, "CHECKOUTCACHE_BUNDLE_URI",
        "Seed a mirror's history from the bundles at this s3://, https:// or file:// location before fetching "
        "the rest from upstream (docs/fleets.md); also where `bundle publish` writes.",
        parse_bundle_uri, "off")
    filter: str | None = setting(None, "CHECKOUTCACHE_FILTER",
                                 "Make new mirrors partial clones with this filter (blob:none: commits and trees "
                                 "only; a checkout fetches the blobs it needs, once). For monorepos; needs the git "
                                 "CLI transport and a server that allows filters (else a full mirror, status says "
                                 "why).", _filter, "off")
    first_fetch: str = setting("shallow", "CHECKOUTCACHE_FIRST_FETCH",
                               "How a repository's first answer on a node is fetched: shallow (the commit alone, "
                               "at the cost of one tree; its whole history follows in the background, and answers "
                               "say `history`) or full (the whole history first, as a full mirror). The pygit2 "
                               "transport always fetches full.", _one_of("shallow", "full"))
    history_timeout: float = setting(7200.0, "CHECKOUTCACHE_HISTORY_TIMEOUT",
                                     "The background fetch of a mirror's history running longer is stopped (and "
                                     "tried again after its back-off).", parse_duration, "2h")
    history_nice: int = setting(10, "CHECKOUTCACHE_HISTORY_NICE",
                                "How much lower the background history's CPU priority is (nice, 0 to 19); its IO "
                                "runs best-effort at the lowest level. Answers always run at yours.", _niceness)
    base_deepen: int = setting(1 << 14, "CHECKOUTCACHE_BASE_DEEPEN",
                               "How many commits `ensure --base` deepens a shallow history at most, at the "
                               "answers' priority, looking for the merge base; past that the background "
                               "history brings the rest and the merge base is answered once it is complete.",
                               _count)
    seed_timeout: float = setting(120.0, "CHECKOUTCACHE_SEED_TIMEOUT",
                                  "The longest a new mirror spends taking in bundles; not counted in the clone "
                                  "timeout (a slow store costs speed, never the clone).", parse_duration, "2m")
    workspaces: str | None = setting(None, "CHECKOUTCACHE_WORKSPACES",
                                     "Where writable workspaces go (`exec --writable`, `workspace`): a directory the "
                                     "review owns; gc counts and reaps what it sees there.", _directory,
                                     "ROOT/workspaces if this user may write the root, else "
                                     "$XDG_CACHE_HOME/checkoutcache-workspaces")
    sharing: str = setting(WRITER, SHARING_VAR,
                           "Who writes the store: the writer's uid alone (writer: checkouts are not writable by "
                           "other uids; readers use a read-only mount and ask the writer) or every member of the "
                           "root's group (group: peers that trust each other; docs/security.md).", _sharing)



def _listen(value: Any) -> str:
    text = str(value).strip()
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536 or (host and not host.strip("[]")):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{text[:60]!r} is not HOST:PORT or :PORT")
    return text


DEFAULT_LISTEN = "127.0.0.1:8787"


@attrs.frozen
class ServeSettings(Settings):
    """The sidecar's own settings (`checkoutcache serve`)."""

    @property
    def api_address(self) -> str | None:
        """The API's TCP address: --listen, else the default when there is no Unix socket."""
        return self.listen or (None if self.unix else DEFAULT_LISTEN)

    listen: str | None = setting(None, "CHECKOUTCACHE_LISTEN",
                                 "The API's TCP address (`:PORT` is loopback); loopback only unless allow-remote. "
                                 "Needs a token.", _listen, "127.0.0.1:8787, or off with --unix")
    unix: str | None = setting(None, "CHECKOUTCACHE_UNIX_SOCKET",
                               "Serve the API on this Unix socket (mode 0660, the directory's group; no token: the "
                               "file's permissions decide); with --listen too, on both. An absolute path in an "
                               "existing directory.", _socket_path, "off",
                               present=_in_a_directory("a Unix socket to listen on"))
    health_listen: str | None = setting(None, "CHECKOUTCACHE_HEALTH_LISTEN",
                                        "A second TCP address serving only /healthz, /readyz and /metrics, without "
                                        "a token (for a kubelet and Prometheus; e.g. 0.0.0.0:8788).", _listen, "off")
    allow_remote: bool = setting(False, "CHECKOUTCACHE_ALLOW_REMOTE",
                                 "Allow the API's TCP address to be a non-loopback one.", _flag, "off", flag=True)
    gc_interval: float = setting(300.0, "CHECKOUTCACHE_GC_INTERVAL", "Run gc this often (0: never).",
                                 parse_duration, "5m")
    gc_deadline: float = setting(1800.0, "CHECKOUTCACHE_GC_DEADLINE",
                                 "A scheduled gc run still running after this long makes /readyz 503 (holds, "
                                 "tokens and answers never wait on it; evictions do).", parse_duration, "30m")
    token_file: str | None = setting(None, "CHECKOUTCACHE_API_TOKEN_FILE",
                                     "Bearer tokens, one `TOKEN [SCOPE,...]` per line (a token is needed over TCP; "
                                     "or give one in CHECKOUTCACHE_API_TOKEN).", _input_file, "none",
                                     present=_readable_file)
    token_overlap: float = setting(600.0, "CHECKOUTCACHE_API_TOKEN_OVERLAP",
                                   "When the tokens file changes (checked every second, and on SIGHUP), a token it "
                                   "no longer holds stays valid this long, so clients move to the new one.",
                                   parse_duration, "10m")
    allow_repo: tuple[str, ...] = setting((), "CHECKOUTCACHE_API_REPOS",
                                          "Repositories the API may name: shell patterns over the normalized URL, "
                                          "e.g. 'https://github.com/acme/*' (repeatable, or comma-separated).",
                                          _patterns, "any remote", many=True)
    allow_local: bool = setting(False, "CHECKOUTCACHE_API_ALLOW_LOCAL",
                                "Let the API name absolute local paths and file:// URLs.", _flag, "off", flag=True)
    max_connections: int = setting(4096, "CHECKOUTCACHE_MAX_CONNECTIONS",
                                   "Connections open at once, idle ones included (each idle one is closed after "
                                   "the 5 s header deadline; one that showed no token, after its answer).", _count)
    max_waiting: int = setting(64, "CHECKOUTCACHE_MAX_WAITING",
                               "Requests waiting on a clone at once (`wait` > 0); the next one is SERVER_BUSY with "
                               "Retry-After. Ready answers never wait behind them.", _count)
    max_waiting_per_token: int = setting(32, "CHECKOUTCACHE_MAX_WAITING_PER_TOKEN",
                                         "Of max-waiting, how many one token may take (the rest are another "
                                         "caller's to have).", _count)
    max_clones: int = setting(8, "CHECKOUTCACHE_MAX_CLONES",
                              "Clone workers this serve runs at once; more wait in a fair queue (round robin "
                              "over tokens), answered cloning with their place.", _count)
    max_clones_per_token: int = setting(6, "CHECKOUTCACHE_MAX_CLONES_PER_TOKEN",
                                        "Of max-clones, how many may run for one token at once.", _count)
    max_queued: int = setting(256, "CHECKOUTCACHE_MAX_QUEUED",
                              "Clones waiting for a slot, in all; the next new commit is SERVER_BUSY.", _count)
    max_queued_per_token: int = setting(64, "CHECKOUTCACHE_MAX_QUEUED_PER_TOKEN",
                                        "Clones waiting for a slot for one token.", _count)
    max_new_repos_per_token: int = setting(2, "CHECKOUTCACHE_MAX_NEW_REPOS_PER_TOKEN",
                                           "Requests naming a repository new to this store (each probes it "
                                           "first) one token may have in progress; the next is SERVER_BUSY.",
                                           _count)
    max_wait: float = setting(600.0, "CHECKOUTCACHE_MAX_WAIT",
                              "The longest `wait` a request may ask for (longer ones are cut to it).",
                              parse_duration, "10m")
    max_holds: int = setting(128, "CHECKOUTCACHE_MAX_HOLDS", "Holds at most, in all (each keeps a descriptor open).",
                             _count)
    max_holds_per_token: int = setting(32, "CHECKOUTCACHE_MAX_HOLDS_PER_TOKEN", "Holds at most per token.", _count)
    stop_timeout: float = setting(20.0, "CHECKOUTCACHE_STOP_TIMEOUT",
                                  "On SIGTERM, in-flight answers get this long to finish (waiting requests are "
                                  "answered SHUTTING_DOWN at once); then the process exits.", parse_duration, "20s")
    log_format: str = setting("text", "CHECKOUTCACHE_LOG_FORMAT", "Log lines as text or as JSON objects (json).",
                              _one_of("text", "json"))
    log_level: str = setting("info", "CHECKOUTCACHE_LOG_LEVEL",
                             "The least severe log lines written: debug, info (one access line per request), "
                             "warning or error.", _one_of("debug", "info", "warning", "error"))
    ready_file: str | None = setting(None, "CHECKOUTCACHE_READY_FILE",
                                     "Write the listening addresses here once serving (for scripts and tests); "
                                     "its directory must exist.", _output_file, "none",
                                     present=_in_a_directory("a file to write"))


@attrs.frozen
class PublishSettings(Settings):
    """`bundle publish`'s own settings (docs/fleets.md)."""

    max_increments: int = setting(6, "CHECKOUTCACHE_BUNDLE_MAX_INCREMENTS",
                                  "Increments on one full bundle before the next full one.", _count)
    full_every: float = setting(7 * 86400.0, "CHECKOUTCACHE_BUNDLE_FULL_EVERY", "A new full bundle at least this often.",
                                parse_duration, "7d")
    prune_after: float = setting(3600.0, "CHECKOUTCACHE_BUNDLE_PRUNE_AFTER",
                                 "Delete bundles no list names (and abort uploads a killed publisher left) once older "
                                 "than this: readers of the old list finish first.", parse_duration, "1h")


def options_table(*classes: type) -> str:
    """A settings table of docs/operations.md (of Config unless told), from the same declarations."""
    rows = ["| option | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for cls in classes or (Config,):
        for field in attrs.fields(cls):
            name = field.name.replace("_", "-")
            rows.append(f"| `--{name}` | `{field.metadata['env']}` | {field.metadata['show']} | "
                        f"{field.metadata['help']} |")
    return "\n".join(rows)
