"""The command line: `checkoutcache [--root DIR] [--json] COMMAND ...`.

Every command prints one JSON object with --json (or when stdout is not a
terminal) and short text otherwise. Exit statuses are documented in the
README: 0 ok/ready, 75 cloning, 1 failed, 2 bad input.
"""

from __future__ import annotations

import sys

import click

from checkoutcache.answers import EXIT_BAD_INPUT, EXIT_EXEC_FAILED, Answer
from checkoutcache.cache import Cache
from checkoutcache.cli.output import ProgressBar, emit_answer, wants_json
from checkoutcache.errors import CheckoutCacheError


class Context:
    def __init__(self, root: str | None, as_json: bool):
        self.root = root
        self.as_json = wants_json(as_json)

    def cache(self) -> Cache:
        # The CLI is a process of our own, single-threaded: clone workers are forked.
        return Cache(self.root, fork_workers=True)


pass_context = click.make_pass_decorator(Context)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--root", metavar="DIR", default=None,
              help="The cache root. Default: $CHECKOUTCACHE_ROOT, else $XDG_CACHE_HOME/checkoutcache, "
                   "else ~/.cache/checkoutcache.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the default when stdout is not a terminal).")
@click.version_option(package_name="checkoutcache")
@click.pass_context
def cli(ctx: click.Context, root: str | None, as_json: bool) -> None:
    """A git checkout cache: one checkout per commit, one clone per commit."""
    ctx.obj = Context(root, as_json)


def parse_wait(value: str) -> float:
    from checkoutcache.units import parse_duration

    return parse_duration(value, "--wait")


@cli.command()
@click.argument("repo")
@click.argument("commit")
@click.option("--wait", default="0", metavar="SECONDS",
              help="Wait up to this long for a clone to finish (900, 15m...). Default: answer at once.")
@click.option("--scope", default="default", metavar="NAME",
              help="Owner scope (tenant, deployment): distinct scopes never share a checkout.")
@click.option("--submodules", type=click.Choice(["recursive", "none"]), default=None,
              help="Check out submodules' work trees (recursive) or not (none). [env CHECKOUTCACHE_SUBMODULES; "
                   "default recursive]")
@click.option("--lfs", type=click.Choice(["on", "off"]), default=None,
              help="Git LFS files with their content (on) or as pointers (off). [env CHECKOUTCACHE_LFS; default on]")
@pass_context
def ensure(ctx: Context, repo: str, commit: str, wait: str, scope: str, submodules: str | None,
           lfs: str | None) -> int:
    """Answer ready (with the path), cloning, or failed for COMMIT of REPO."""
    import os

    # The options are the settings' twins: set as the environment the cache and its worker read.
    for value, variable in ((submodules, "CHECKOUTCACHE_SUBMODULES"), (lfs, "CHECKOUTCACHE_LFS")):
        if value is not None:
            os.environ[variable] = value
    try:
        seconds = parse_wait(wait)
    except CheckoutCacheError as exc:
        emit_answer(Answer.from_error(exc), ctx.as_json)
        return EXIT_BAD_INPUT
    bar = ProgressBar() if seconds > 0 and sys.stderr.isatty() else None  # a person is watching
    try:
        answer = ctx.cache().ensure(repo, commit, wait=seconds, scope=scope, on_progress=bar)
    finally:
        if bar is not None:
            bar.close()
    emit_answer(answer, ctx.as_json)
    return answer.exit_code


def config_options(*names: str):
    """click options for Config fields, from their one declaration (env, default, help)."""
    import attrs

    from checkoutcache.config import Config

    fields = attrs.fields_dict(Config)

    def decorate(fn):
        for name in reversed(names):
            meta = fields[name].metadata
            fn = click.option(f"--{name.replace('_', '-')}", name, default=None, metavar="VALUE",
                              help=f"{meta['help']} [env {meta['env']}; default {meta['show']}]")(fn)
        return fn

    return decorate


def load_config(overrides: dict):
    from checkoutcache.config import Config

    return Config.from_env(**{k: v for k, v in overrides.items() if v is not None})


def repo_key_in(ctx: Context, repo: str | None, scope: str) -> str | None:
    """The key of REPO's store in this root (None: every repository)."""
    if repo is None:
        return None
    from checkoutcache.cache import store_key
    from checkoutcache.repospec import parse_repo

    cache = ctx.cache()
    spec = parse_repo(repo, scope, lfs=cache.lfs_setting(), submodules=cache.submodules_setting())
    return store_key(cache.paths, spec).key


def fail(ctx: Context, exc: CheckoutCacheError) -> int:
    answer = Answer.from_error(exc)
    emit_answer(answer, ctx.as_json)
    return answer.exit_code


@cli.command()
@config_options("max_checkouts", "max_bytes", "min_free", "free_headroom", "max_age", "grace", "mirror_gc_interval")
@click.option("--dry-run", is_flag=True, help="Report what would be removed; change nothing.")
@pass_context
def gc(ctx: Context, dry_run: bool, **overrides) -> int:
    """Evict least recently used checkouts over the limits, reap dead clones, tidy mirrors."""
    from checkoutcache.cli.output import emit_json, gc_text
    from checkoutcache.store.layout import RootPaths
    from checkoutcache.upkeep.gc import run_gc

    try:
        config = load_config(overrides)
        report = run_gc(RootPaths(ctx.cache().root), config, dry_run=dry_run)
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    if ctx.as_json:
        emit_json(report.to_json())
    else:
        click.echo(gc_text(report.to_json()))
    return 0


@cli.command()
@click.argument("repo", required=False)
@click.option("--scope", default="default", metavar="NAME", help="The owner scope of REPO.")
@config_options("max_checkouts", "max_bytes", "min_free", "grace")
@pass_context
def status(ctx: Context, repo: str | None, scope: str, **overrides) -> int:
    """Show checkouts, clones in flight, failures and totals against the limits."""
    from checkoutcache.cli.output import emit_json, status_text
    from checkoutcache.store.layout import RootPaths
    from checkoutcache.upkeep.status import build_status

    try:
        config = load_config(overrides)
        key = repo_key_in(ctx, repo, scope)
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    report = build_status(RootPaths(ctx.cache().root), config, key)
    if ctx.as_json:
        emit_json(report)
    else:
        click.echo(status_text(report))
    return 0


@cli.command()
@click.argument("repo", required=False)
@click.argument("commit", required=False)
@click.option("--scope", default="default", metavar="NAME", help="The owner scope of REPO.")
@click.option("--remove-broken", is_flag=True, help="Move broken checkouts (not held by an exec) to trash.")
@pass_context
def verify(ctx: Context, repo: str | None, commit: str | None, scope: str, remove_broken: bool) -> int:
    """Compare checkouts with their commits; exit 1 if any is broken."""
    from checkoutcache.cli.output import emit_json, verify_text
    from checkoutcache.repospec import parse_commit
    from checkoutcache.store.layout import RootPaths
    from checkoutcache.upkeep.verify import run_verify

    try:
        key = repo_key_in(ctx, repo, scope)
        sha = parse_commit(commit) if commit is not None else None
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    from checkoutcache.git.transport import pick_backend

    backend = pick_backend(load_config({}).transport)
    report = run_verify(RootPaths(ctx.cache().root), backend, key, sha, remove_broken)
    if ctx.as_json:
        emit_json(report)
    else:
        click.echo(verify_text(report))
    return 1 if report["broken"] else 0


@cli.command(name="exec", context_settings={"ignore_unknown_options": True})
@click.argument("repo")
@click.argument("commit")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--wait", default="10m", metavar="SECONDS", help="Wait up to this long for the checkout. Default 10m.")
@click.option("--scope", default="default", metavar="NAME", help="Owner scope.")
@pass_context
def exec_command(ctx: Context, repo: str, commit: str, command: tuple[str, ...], wait: str, scope: str) -> int:
    """Run COMMAND in the checkout, holding it against eviction; exit with its status.

    Use `--` before COMMAND. If the checkout cannot be made ready, the answer
    goes to stderr and the status is 125 (the command did not run).
    """
    from checkoutcache.cli.execute import run_held

    if command and command[0] == "--":  # click keeps the separator once arguments have started
        command = command[1:]
    if not command:
        return fail(ctx, CheckoutCacheError("BAD_ARGUMENT", what="exec needs a command after --"))
    try:
        seconds = parse_wait(wait)
    except CheckoutCacheError as exc:
        emit_answer(Answer.from_error(exc), True, sys.stderr)
        return EXIT_EXEC_FAILED
    return run_held(ctx.cache(), repo, commit, list(command), seconds, scope)


@cli.command()
@click.option("--listen", default="127.0.0.1:8787", metavar="HOST:PORT", show_default=True,
              help="TCP address; loopback only unless --allow-remote.")
@click.option("--unix", "unix_socket", default=None, metavar="PATH", help="Listen on a Unix socket instead.")
@click.option("--allow-remote", is_flag=True, help="Allow --listen on a non-loopback address.")
@click.option("--gc-interval", default="5m", metavar="DURATION", show_default=True,
              help="Run gc this often (0: never).")
@click.option("--ready-file", default=None, metavar="PATH", help="Write the listening address here once serving.")
@click.option("--token-file", default=None, metavar="PATH", envvar="CHECKOUTCACHE_API_TOKEN_FILE",
              help="Bearer tokens, one `TOKEN [SCOPE,...]` per line (required over TCP; or set "
                   "CHECKOUTCACHE_API_TOKEN). [env CHECKOUTCACHE_API_TOKEN_FILE]")
@click.option("--allow-repo", "allow_repo", multiple=True, metavar="PATTERN",
              help="Repositories the API may name: a shell pattern over the normalized URL, e.g. "
                   "'https://github.com/acme/*' (repeatable; default: any remote). [env CHECKOUTCACHE_API_REPOS, "
                   "comma-separated]")
@click.option("--allow-local", is_flag=True, envvar="CHECKOUTCACHE_API_ALLOW_LOCAL",
              help="Let the API name absolute local paths and file:// URLs (refused by default).")
@click.option("--max-connections", default=256, type=click.IntRange(1, 100000), show_default=True,
              help="Open connections at most; the next ones get 503 with Retry-After.")
@click.option("--max-holds", default=128, type=click.IntRange(0, 100000), show_default=True,
              help="Holds at most, in all (each keeps a descriptor open).")
@click.option("--max-holds-per-token", default=32, type=click.IntRange(0, 100000), show_default=True,
              help="Holds at most per token.")
@click.option("--max-wait", default="10m", metavar="DURATION", show_default=True,
              help="The longest `wait` a request may ask for (longer ones are cut to it).")
@config_options("max_checkouts", "max_bytes", "min_free", "free_headroom", "max_age", "grace", "mirror_gc_interval",
                "submodules", "lfs", "bundle_uri")
@pass_context
def serve(ctx: Context, listen: str, unix_socket: str | None, allow_remote: bool, gc_interval: str,
          ready_file: str | None, token_file: str | None, allow_repo: tuple[str, ...], allow_local: bool,
          max_connections: int, max_holds: int, max_holds_per_token: int, max_wait: str, **overrides) -> int:
    """Run the sidecar: an HTTP JSON API (/v1/...), /healthz, /metrics, and gc on a schedule."""
    import logging
    import os

    from checkoutcache.serve.http import parse_listen
    from checkoutcache.serve.http import serve as run_server
    from checkoutcache.serve.policy import ApiPolicy, load_tokens
    from checkoutcache.serve.service import Bounds
    from checkoutcache.units import parse_duration

    try:
        config = load_config(overrides)
        address = None if unix_socket else parse_listen(listen, allow_remote)
        interval = parse_duration(gc_interval, "--gc-interval")
        patterns = allow_repo or tuple(p.strip() for p in os.environ.get("CHECKOUTCACHE_API_REPOS", "").split(",")
                                       if p.strip())
        policy = ApiPolicy(tokens=load_tokens(token_file, os.environ), repo_patterns=tuple(patterns),
                           allow_local=allow_local)
        bounds = Bounds(max_wait=parse_duration(max_wait, "--max-wait"), max_holds=max_holds,
                        max_holds_per_token=max_holds_per_token)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
        # Multi-threaded: workers are spawned, never forked from here.
        return run_server(Cache(ctx.root, config=config), config, address, unix_socket, interval, policy, bounds,
                          max_connections, ready_file=ready_file)
    except CheckoutCacheError as exc:
        return fail(ctx, exc)


@cli.group()
def bundle() -> None:
    """Fleet seeding: git bundles of mirrors in a shared store (README "Fleets")."""


@bundle.command(name="publish")
@click.argument("repos", nargs=-1, metavar="[REPO]...")
@click.option("--to", "to", default=None, metavar="URI",
              help="The store: s3://bucket/prefix or file:///dir. Default: $CHECKOUTCACHE_BUNDLE_URI.")
@click.option("--scope", default="default", metavar="NAME", help="The owner scope of the REPOs.")
@click.option("--full", is_flag=True, help="Start a new chain with a full bundle, whatever the list holds.")
@click.option("--max-increments", default=6, type=click.IntRange(0, 1000), show_default=True,
              help="Increments on one full bundle before the next full one.")
@click.option("--full-every", default="7d", metavar="DURATION", show_default=True,
              help="A new full bundle at least this often.")
@click.option("--prune-after", default="1h", metavar="DURATION", show_default=True,
              help="Delete bundles no list names once older than this (readers of the old list finish first).")
@pass_context
def bundle_publish(ctx: Context, repos: tuple[str, ...], to: str | None, scope: str, full: bool,
                   max_increments: int, full_every: str, prune_after: str) -> int:
    """Fetch each REPO's branches and tags and publish them as a git bundle and a
    bundle list (every repository of the root with a mirror, without REPO)."""
    from checkoutcache.bundleuri import BUNDLE_URI_VAR, parse_bundle_uri
    from checkoutcache.cli.output import bundle_text, emit_json
    from checkoutcache.repospec import parse_repo
    from checkoutcache.store.layout import RootPaths
    from checkoutcache.units import parse_duration
    from checkoutcache.upkeep.publish import PublishOptions, Publisher, stored_repositories

    try:
        config = load_config({})
        location = parse_bundle_uri(to) if to is not None else config.bundle_uri
        if location is None:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"no bundle store: pass --to or set {BUNDLE_URI_VAR}")
        if not location.writable:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{location} is read-only here: publish to the s3:// or "
                                                          f"file:// location behind it")
        options = PublishOptions(full=full, max_increments=max_increments,
                                 full_every=parse_duration(full_every, "--full-every"),
                                 prune_after=parse_duration(prune_after, "--prune-after"))
        specs = [parse_repo(r, scope, lfs=config.lfs, submodules=config.submodules) for r in repos]
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    root_paths = RootPaths(ctx.cache().root)
    if not repos:
        specs = stored_repositories(root_paths)
    publisher = Publisher(root_paths, location, config, options,
                          log=(lambda line: None) if ctx.as_json else (lambda line: click.echo(line, err=True)))
    reports = [publisher.publish(spec) for spec in specs]
    result = {"store": str(location), "published": reports}
    if ctx.as_json:
        emit_json(result)
    else:
        click.echo(bundle_text(result))
    return 1 if any(r["action"] == "failed" for r in reports) else 0


@cli.command()
@click.option("--keep/--no-keep", default=True, help="Keep the demo's directory to look at afterwards.")
@pass_context
def demo(ctx: Context, keep: bool) -> int:
    """Build a small repository locally and show the answers for one of its commits."""
    from checkoutcache.cli.demo import run_demo

    return run_demo(ctx.root, ctx.as_json, keep)


def main(argv: list[str] | None = None) -> None:
    try:
        code = cli.main(args=argv, prog_name="checkoutcache", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        error = CheckoutCacheError("BAD_ARGUMENT", what=exc.format_message())
        emit_answer(Answer.from_error(error), _json_requested(argv))
        sys.exit(EXIT_BAD_INPUT)
    except Exception as exc:  # a bug: still one answer a program can read, and the trace for a person
        import traceback

        traceback.print_exc()
        error = CheckoutCacheError("INTERNAL_ERROR", detail=f"{type(exc).__name__}: {exc}"[:300])
        emit_answer(Answer.from_error(error), _json_requested(argv), sys.stdout)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


def _json_requested(argv: list[str] | None) -> bool:
    return "--json" in (argv if argv is not None else sys.argv[1:]) or not sys.stdout.isatty()


if __name__ == "__main__":
    main()
