"""The command line: `checkoutcache [--root DIR] [--json] COMMAND ...`.

Every command prints one JSON object with --json (or when stdout is not a
terminal) and short text otherwise. Exit statuses are documented in
docs/errors.md: 0 ok/ready, 75 cloning, 1 failed, 2 bad input.

Settings (config.py) are options of every command that reads them, each with
its environment twin, generated from their one declaration (`settings_options`):
an option wins over the environment, which wins over the default.
"""

from __future__ import annotations

import re
import sys

import attrs
import click

from checkoutcache.answers import EXIT_BAD_INPUT, EXIT_EXEC_FAILED, Answer
from checkoutcache.cache import Cache
from checkoutcache.cli.fast import global_options_first
from checkoutcache.cli.output import ProgressBar, emit_answer, wants_json
from checkoutcache.config import Config, ServeSettings, PublishSettings
from checkoutcache.errors import CheckoutCacheError


class Context:
    def __init__(self, root: str | None, as_json: bool):
        self.root = root
        self.as_json = wants_json(as_json)
        self.config: Config | None = None  # the command's settings, once read (load_config)
        self.root_checked = False  # gc and status: an unusable root is the caller's mistake (exit 2)

    def cache(self) -> Cache:
        # The CLI is a process of our own, single-threaded: clone workers are forked.
        return Cache(self.root, config=self.config, fork_workers=True)


pass_context = click.make_pass_decorator(Context)


def settings_options(*classes: type):
    """click options for every field of the settings classes, from their one declaration:
    `--name`, its environment twin, default and help in its text."""
    import attrs

    def decorate(fn):
        for cls in reversed(classes):
            for field in reversed(attrs.fields(cls)):
                meta = field.metadata
                text = f"{meta['help']} [env {meta['env']}; default {meta['show']}]"
                name = f"--{field.name.replace('_', '-')}"
                if meta["flag"]:
                    fn = click.option(name, field.name, flag_value="on", default=None, help=text)(fn)
                elif meta["many"]:
                    fn = click.option(name, field.name, multiple=True, metavar="VALUE", help=text)(fn)
                else:
                    fn = click.option(name, field.name, default=None, metavar="VALUE", help=text)(fn)
        return fn

    return decorate


def load_settings(cls, options: dict):
    """A settings class from the command's options (taken out of `options`) over the environment."""
    import attrs

    names = attrs.fields_dict(cls)
    return cls.from_env(**{k: options.pop(k) for k in list(options) if k in names})


def load_config(ctx: Context, options: dict) -> Config:
    ctx.config = load_settings(Config, options)
    return ctx.config


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


def fail(ctx: Context, exc: CheckoutCacheError) -> int:
    answer = Answer.from_error(exc)
    emit_answer(answer, ctx.as_json)
    if exc.code == "ROOT_UNUSABLE" and ctx.root_checked:
        return EXIT_BAD_INPUT  # gc and status on a root that is not there: the caller's mistake
    return answer.exit_code


def check_root(ctx: Context, write: bool) -> None:
    """gc, status, verify and `bundle publish` of every repository work on an existing root:
    a missing or unusable one is ROOT_UNUSABLE, exit 2 (a misspelled CHECKOUTCACHE_ROOT made
    cron's gc a silent no-op)."""
    from checkoutcache.store.create import existing_root_problem

    ctx.root_checked = True
    problem = existing_root_problem(ctx.cache().paths, write)
    if problem is not None:
        raise problem


SPARSE_HELP = ("A sparse checkout (cone mode) of this directory of the tree, repeatable: only these "
               "directories, and the files directly in the root and in their ancestors. Each cone is a "
               "checkout of its own.")


def repo_key_in(ctx: Context, repo: str | None, scope: str) -> str | None:
    """The key of REPO's store in this root (None: every repository)."""
    if repo is None:
        return None
    from checkoutcache.store.create import store_key
    from checkoutcache.repospec import parse_repo

    cache = ctx.cache()
    spec = parse_repo(repo, scope, lfs=cache.lfs_setting(), submodules=cache.submodules_setting())
    return store_key(cache.paths, spec).key


@cli.command()
@click.argument("repo")
@click.argument("commit")
@click.option("--wait", default="0", metavar="SECONDS",
              help="Wait up to this long for a clone to finish (900, 15m...). Default: answer at once.")
@click.option("--scope", default="default", metavar="NAME",
              help="Owner scope (tenant, deployment): distinct scopes never share a checkout.")
@click.option("--sparse", multiple=True, metavar="DIR", help=SPARSE_HELP)
@click.option("--history", "history", default="any", metavar="any|full",
              help="full: wait (within --wait) until the checkout's history is complete; a cold node's first "
                   "answer has the commit alone (history: shallow) and its history follows in the background. "
                   "Default any: what is there.")
@click.option("--base", default=None, metavar="COMMIT",
              help="Also answer merge_base, the merge base of COMMIT and this commit (the review's base), "
                   "deepening a shallow history only as far as the two need.")
@settings_options(Config)
@pass_context
def ensure(ctx: Context, repo: str, commit: str, wait: str, scope: str, sparse: tuple[str, ...],
           history: str, base: str | None, **options) -> int:
    """Answer ready (with the path), cloning, or failed for COMMIT of REPO."""
    try:
        load_config(ctx, options)
        seconds = parse_wait(wait)
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    bar = ProgressBar() if seconds > 0 and sys.stderr.isatty() else None  # a person is watching
    try:
        answer = ctx.cache().ensure(repo, commit, wait=seconds, scope=scope, on_progress=bar, sparse=sparse,
                                    history=history, base=base)
    finally:
        if bar is not None:
            bar.close()
    emit_answer(answer, ctx.as_json)
    return answer.exit_code


@cli.command()
@click.option("--dry-run", is_flag=True, help="Report what would be removed; change nothing.")
@settings_options(Config)
@pass_context
def gc(ctx: Context, dry_run: bool, **options) -> int:
    """Evict least recently used checkouts over the limits, reap dead clones, tidy mirrors."""
    from checkoutcache.cli.output import emit_json, gc_text
    from checkoutcache.upkeep.gc import run_gc

    try:
        config = load_config(ctx, options)
        check_root(ctx, write=not dry_run)
        report = run_gc(ctx.cache().paths, config, dry_run=dry_run, record_as="gc")
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
@settings_options(Config)
@pass_context
def status(ctx: Context, repo: str | None, scope: str, **options) -> int:
    """Show checkouts, clones in flight, failures and totals against the limits."""
    from checkoutcache.cli.output import emit_json, status_text
    from checkoutcache.upkeep.status import build_status

    try:
        config = load_config(ctx, options)
        check_root(ctx, write=False)
        key = repo_key_in(ctx, repo, scope)
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    report = build_status(ctx.cache().paths, config, key)
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
@settings_options(Config)
@pass_context
def verify(ctx: Context, repo: str | None, commit: str | None, scope: str, remove_broken: bool, **options) -> int:
    """Compare checkouts with their commits; exit 1 if any is broken."""
    from checkoutcache.cli.output import emit_json, verify_text
    from checkoutcache.repospec import parse_commit
    from checkoutcache.upkeep.verify import run_verify

    try:
        config = load_config(ctx, options)
        check_root(ctx, write=remove_broken)
        key = repo_key_in(ctx, repo, scope)
        sha = parse_commit(commit) if commit is not None else None
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    from checkoutcache.git.transport import pick_backend

    report = run_verify(ctx.cache().paths, pick_backend(config.transport), key, sha, remove_broken)
    if ctx.as_json:
        emit_json(report)
    else:
        click.echo(verify_text(report))
    return 1 if report["broken"] else 0


@cli.command()
@click.argument("repo")
@click.argument("commit", required=False)
@click.option("--scope", default="default", metavar="NAME", help="The owner scope of REPO.")
@click.option("--force", is_flag=True,
              help="Also evict checkouts used within the grace window (never a held one or a running clone).")
@settings_options(Config)
@pass_context
def evict(ctx: Context, repo: str, commit: str | None, scope: str, force: bool, **options) -> int:
    """Remove COMMIT's checkouts (every cone) of REPO, or without COMMIT all of REPO: its
    checkouts, mirror and LFS objects. Exit 1 (IN_USE) when something had to stay."""
    from checkoutcache.cli.output import emit_json, evict_text
    from checkoutcache.errors import CheckoutCacheError as Error
    from checkoutcache.repospec import parse_commit
    from checkoutcache.upkeep.evict import run_evict

    try:
        config = load_config(ctx, options)
        check_root(ctx, write=True)
        key = repo_key_in(ctx, repo, scope)
        sha = parse_commit(commit) if commit is not None else None
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    assert key is not None
    try:
        from checkoutcache.store.create import refuse_newer_layout

        refuse_newer_layout(ctx.cache().paths.repo(key), repo)  # a newer version's store is never touched
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    report = {"repo": repo, **run_evict(ctx.cache().paths, key, sha, config.grace, force)}
    if report["kept"]:
        detail = ", ".join(f"{k['name'][:52]} ({k['why']})" for k in report["kept"])
        error = Error("IN_USE", detail=detail)
        report.update({"error": error.code, "message": error.message, "next": error.next})
    if ctx.as_json:
        emit_json(report)
    else:
        click.echo(evict_text(report))
    return 1 if report["kept"] else 0


@cli.command(name="exec", context_settings={"ignore_unknown_options": True})
@click.argument("repo")
@click.argument("commit")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--wait", default="10m", metavar="SECONDS", help="Wait up to this long for the checkout. Default 10m.")
@click.option("--scope", default="default", metavar="NAME", help="Owner scope.")
@click.option("--sparse", multiple=True, metavar="DIR", help=SPARSE_HELP)
@click.option("--writable", is_flag=True,
              help="Run COMMAND in a writable workspace of its own (a copy of the checkout, removed afterwards), "
                   "not in the shared read-only checkout.")
@settings_options(Config)
@pass_context
def exec_command(ctx: Context, repo: str, commit: str, command: tuple[str, ...], wait: str, scope: str,
                 sparse: tuple[str, ...], writable: bool, **options) -> int:
    """Run COMMAND in the checkout, holding it against eviction; exit with its status.

    Use `--` before COMMAND. If the checkout cannot be made ready, the answer
    goes to stderr and the status is 125 (the command did not run). With
    --writable the command runs in a workspace of its own, removed when it ends.
    """
    from checkoutcache.cli.execute import run_held, run_in_workspace

    if command and command[0] == "--":  # click keeps the separator once arguments have started
        command = command[1:]
    if not command:
        return fail(ctx, CheckoutCacheError("BAD_ARGUMENT", what="exec needs a command after --"))
    try:
        load_config(ctx, options)
        seconds = parse_wait(wait)
    except CheckoutCacheError as exc:
        emit_answer(Answer.from_error(exc), True, sys.stderr)
        return EXIT_EXEC_FAILED
    if writable:
        return run_in_workspace(ctx.cache(), repo, commit, list(command), seconds, scope, sparse)
    return run_held(ctx.cache(), repo, commit, list(command), seconds, scope, sparse)


@cli.group()
def workspace() -> None:
    """Writable workspaces: a review's own tree of a commit (docs/commands.md)."""


@workspace.command(name="create")
@click.argument("repo")
@click.argument("commit")
@click.option("--wait", default="10m", metavar="SECONDS", help="Wait up to this long for the checkout. Default 10m.")
@click.option("--scope", default="default", metavar="NAME", help="Owner scope.")
@click.option("--sparse", multiple=True, metavar="DIR", help=SPARSE_HELP)
@click.option("--owner-pid", type=int, default=None, metavar="PID",
              help="The process the workspace lives as long as. Default: the caller of this command (its parent).")
@click.option("--path", "path_only", is_flag=True, help="Print only the path, whatever stdout is (for `$(...)`).")
@settings_options(Config)
@pass_context
def workspace_create(ctx: Context, repo: str, commit: str, wait: str, scope: str, sparse: tuple[str, ...],
                     owner_pid: int | None, path_only: bool, **options) -> int:
    """Make a writable workspace of COMMIT, print its path and exit; a keeper process removes it
    when the owner ends (or at `workspace remove`)."""
    from checkoutcache.cli.output import emit_json
    from checkoutcache.workspaces import keep_for, make_workspace, owner_process

    try:
        load_config(ctx, options)
        seconds = parse_wait(wait)
        owner, owner_start = owner_process(owner_pid)
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    made = make_workspace(ctx.cache(), repo, commit, wait=seconds, scope=scope, sparse=sparse)
    if not made.made:
        emit_answer(made.answer, ctx.as_json)
        return made.answer.exit_code
    result = made.to_json()
    try:
        result["keeper"] = keep_for(made, owner, owner_start)
    except CheckoutCacheError as exc:
        made.remove()
        return fail(ctx, exc)
    result["owner_pid"] = owner
    if ctx.as_json and not path_only:
        emit_json(result)
    else:
        click.echo(result["path"])
    return 0


@workspace.command(name="remove")
@click.argument("path")
@settings_options(Config)
@pass_context
def workspace_remove(ctx: Context, path: str, **options) -> int:
    """Remove the workspace at PATH now (its keeper deletes it and exits)."""
    from checkoutcache.cli.output import emit_json
    from checkoutcache.workspaces import remove_kept, workspaces_dir

    try:
        load_config(ctx, options)
        result = remove_kept(workspaces_dir(ctx.cache()), path)
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    if ctx.as_json:
        emit_json(result)
    else:
        click.echo(f"removed {result['removed']}" if result["done"] else f"asked to remove {result['removed']}")
    return 0 if result["done"] else 1


@workspace.command(name="list")
@settings_options(Config)
@pass_context
def workspace_list(ctx: Context, **options) -> int:
    """List the workspaces (live or dead) in the workspaces directory."""
    from checkoutcache.cli.output import emit_json
    from checkoutcache.workspaces import list_workspaces, workspaces_dir

    try:
        load_config(ctx, options)
        paths = workspaces_dir(ctx.cache())
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    found = list_workspaces(paths)
    if ctx.as_json:
        emit_json({"workspaces_dir": paths.base, "workspaces": found})
    else:
        click.echo(f"workspaces in {paths.base}: {len(found)}")
        for w in found:
            state = "live" if w["alive"] else "dead"
            click.echo(f"  {w['path']}  {state}  {(w['commit'] or '?')[:12]}  pid {w['pid']}")
    return 0


@cli.command()
@settings_options(ServeSettings, Config)
@pass_context
def serve(ctx: Context, **options) -> int:
    """Run the sidecar: an HTTP JSON API (/v1/...), /healthz, /readyz, /metrics, and gc on a schedule."""
    import os

    from checkoutcache.serve.policy import ApiPolicy, load_tokens
    from checkoutcache.serve.server import serve as run_server
    from checkoutcache.serve.server import served_version

    try:
        settings = load_settings(ServeSettings, options)
        config = load_config(ctx, options)
        policy = ApiPolicy(tokens=load_tokens(settings.token_file, os.environ),
                           repo_patterns=settings.allow_repo, allow_local=settings.allow_local)
        # Multi-threaded: workers are started by the worker server, never forked from here.
        return run_server(Cache(ctx.root, config=config), config, settings, policy, served_version())
    except CheckoutCacheError as exc:
        return fail(ctx, exc)


@cli.command()
@click.option("--secret", metavar="NAME", default=None,
              help="Print them as the Kubernetes Secret NAME (JSON, for `kubectl apply -f -`): keys `tokens` "
                   "(serve's tokens file) and `review` (the review's own token), as deploy/ mounts them.")
@click.option("--dir", "directory", metavar="DIR", default=None,
              help="Write them into the new directory DIR as the files `tokens` and `review` (mode 0644: "
                   "compose's secrets, deploy/compose.yaml).")
@pass_context
def tokens(ctx: Context, secret: str | None, directory: str | None) -> int:
    """Make fresh API tokens for the shipped roles: the review's (ensure and hold in the default
    scope: all that code under review, which can read it, may do) and the operator's (status,
    workspaces, gc, metrics). Without options: serve's tokens file on stdout."""
    import json
    import os

    from checkoutcache.serve.policy import shipped_tokens

    made = shipped_tokens()
    if secret is not None and directory is not None:
        return fail(ctx, CheckoutCacheError("BAD_ARGUMENT", what="give --secret or --dir, not both"))
    if secret is not None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", secret):
            return fail(ctx, CheckoutCacheError("BAD_ARGUMENT", what=f"{secret[:60]!r} is not a Kubernetes name"))
        click.echo(json.dumps({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                               "metadata": {"name": secret}, "stringData": made}, indent=2))
        return 0
    if directory is not None:
        try:
            os.mkdir(directory, 0o755)
            for name, text in made.items():
                fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                with os.fdopen(fd, "w") as handle:
                    handle.write(text)
                os.chmod(os.path.join(directory, name), 0o644)  # read by the containers' uids, whatever the umask
        except OSError as exc:
            return fail(ctx, CheckoutCacheError("BAD_ARGUMENT", what=f"--dir {directory[:200]!r}: "
                                                                     f"{exc.strerror or exc} (it must not exist)"))
        click.echo(os.path.join(directory, "tokens"))
        return 0
    click.echo(made["tokens"], nl=False)
    return 0


@cli.group()
def bundle() -> None:
    """Fleet seeding: git bundles of mirrors in a shared store (docs/fleets.md)."""


@bundle.command(name="publish")
@click.argument("repos", nargs=-1, metavar="[REPO]...")
@click.option("--to", "to", default=None, metavar="URI",
              help="The store: s3://bucket/prefix or file:///dir. Default: --bundle-uri ($CHECKOUTCACHE_BUNDLE_URI).")
@click.option("--scope", default="default", metavar="NAME", help="The owner scope of the REPOs.")
@click.option("--full", is_flag=True, help="Start a new chain with a full bundle, whatever the list holds.")
@settings_options(PublishSettings, Config)
@pass_context
def bundle_publish(ctx: Context, repos: tuple[str, ...], to: str | None, scope: str, full: bool, **options) -> int:
    """Fetch each REPO's branches and tags and publish them as a git bundle and a
    bundle list (every repository of the root with a mirror, without REPO)."""
    from checkoutcache.bundles.location import BUNDLE_URI_VAR, parse_bundle_uri
    from checkoutcache.cli.output import bundle_text, emit_json
    from checkoutcache.repospec import parse_repo
    from checkoutcache.bundles.publish import PublishOptions, Publisher, stored_repositories

    try:
        publishing = load_settings(PublishSettings, options)
        config = load_config(ctx, options)
        location = parse_bundle_uri(to) if to is not None else config.bundle_uri
        if location is None:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"no bundle store: pass --to or set {BUNDLE_URI_VAR}")
        if not location.writable:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{location} is read-only here: publish to the s3:// or "
                                                          f"file:// location behind it")
        options = PublishOptions(full=full, max_increments=publishing.max_increments,
                                 full_every=publishing.full_every, prune_after=publishing.prune_after)
        specs = [parse_repo(r, scope, lfs=config.lfs, submodules=config.submodules) for r in repos]
    except CheckoutCacheError as exc:
        return fail(ctx, exc)
    root_paths = ctx.cache().paths
    if not repos:
        try:  # every repository of the root: a root that is not there is a mistake, not an empty run
            check_root(ctx, write=True)
        except CheckoutCacheError as exc:
            return fail(ctx, exc)
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
@click.option("--keep/--no-keep", default=False, help="Keep the demo's directory to look at afterwards (it is "
                                                     "removed by default; the last line says where it was).")
@pass_context
def demo(ctx: Context, keep: bool) -> int:
    """Build a small repository locally and show the answers for one of its commits."""
    from checkoutcache.cli.demo import run_demo

    return run_demo(ctx.root, ctx.as_json, keep)


def main(argv: list[str] | None = None) -> None:
    argv = global_options_first(list(sys.argv[1:] if argv is None else argv))  # cli/fast.py
    try:
        code = cli.main(args=argv, prog_name="checkoutcache", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        usage = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            command = exc.ctx.command_path
            usage = f"{exc.ctx.get_usage()}; try '{command} --help' for help"
        if _json_requested(argv):
            error = CheckoutCacheError("BAD_ARGUMENT", what=exc.format_message())
            answer = Answer.from_error(error)
            if usage:
                answer = attrs.evolve(answer, next=usage.replace("\n", " "))
            emit_answer(answer, True)
        else:
            exc.show()  # click's own: the usage line, the "Try ... -h" hint, the error
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
