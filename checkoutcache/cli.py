"""The command line: `checkoutcache [--root DIR] [--json] COMMAND ...`.

Every command prints one JSON object with --json (or when stdout is not a
terminal) and short text otherwise. Exit statuses are documented in the
README: 0 ok/ready, 75 cloning, 1 failed, 2 bad input.
"""

from __future__ import annotations

import sys

import click

from .answers import EXIT_BAD_INPUT, Answer
from .cache import Cache
from .errors import CheckoutCacheError
from .output import ProgressBar, emit_answer, wants_json


class Context:
    def __init__(self, root: str | None, as_json: bool):
        self.root = root
        self.as_json = wants_json(as_json)

    def cache(self) -> Cache:
        return Cache(self.root)


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
    from .units import parse_duration

    return parse_duration(value, "--wait")


@cli.command()
@click.argument("repo")
@click.argument("commit")
@click.option("--wait", default="0", metavar="SECONDS",
              help="Wait up to this long for a clone to finish (900, 15m...). Default: answer at once.")
@click.option("--scope", default="default", metavar="NAME",
              help="Owner scope (tenant, deployment): distinct scopes never share a checkout.")
@pass_context
def ensure(ctx: Context, repo: str, commit: str, wait: str, scope: str) -> int:
    """Answer ready (with the path), cloning, or failed for COMMIT of REPO."""
    try:
        seconds = parse_wait(wait)
    except CheckoutCacheError as exc:
        emit_answer(Answer.from_error(exc), ctx.as_json)
        return EXIT_BAD_INPUT
    bar = ProgressBar() if seconds > 0 and sys.stderr.isatty() and not ctx.as_json else None
    try:
        answer = ctx.cache().ensure(repo, commit, wait=seconds, scope=scope, on_progress=bar)
    finally:
        if bar is not None:
            bar.close()
    emit_answer(answer, ctx.as_json)
    return answer.exit_code


@cli.command()
@click.option("--keep/--no-keep", default=True, help="Keep the demo's directory to look at afterwards.")
@pass_context
def demo(ctx: Context, keep: bool) -> int:
    """Build a small repository locally and show the answers for one of its commits."""
    from .demo import run_demo

    return run_demo(ctx.root, ctx.as_json, keep)


def main(argv: list[str] | None = None) -> None:
    try:
        code = cli.main(args=argv, prog_name="checkoutcache", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        as_json = "--json" in (argv if argv is not None else sys.argv[1:]) or not sys.stdout.isatty()
        error = CheckoutCacheError("BAD_ARGUMENT", what=exc.format_message())
        emit_answer(Answer.from_error(error), as_json)
        sys.exit(EXIT_BAD_INPUT)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
