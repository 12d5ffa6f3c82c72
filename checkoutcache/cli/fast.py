"""The CLI's `ensure`, before click (and, when ready, attrs) is imported.

`checkoutcache [--root DIR] [--json] ensure REPO COMMIT [--scope NAME] [--sparse DIR]...
[--wait DURATION]` is the call made on nearly every tool call of every review.
When its checkout is ready, this module answers it with the standard library
and the package's small modules only (the same validation, key and marker
check as Cache.ensure, the same output as the full CLI) and the process exits.
When it is not, and nobody watches a progress bar, the library answers it from
here too (Cache.ensure, workers forked from this process): a new commit pays
for the clone, not for click. Anything else (other commands, other options,
bad input, a terminal that gets a progress bar) returns None, and the full
CLI answers as it always does.
"""

from __future__ import annotations

import json
import os
import sys


def exit_after_answer(code: int) -> None:
    """End the process once its answer is written: flushed, then os._exit. Nothing is left
    to run (a worker it started is detached in a session of its own, every record is
    written and closed), and the interpreter's teardown of the modules a new commit
    imported cost the caller 25-30 ms (benchmarks/RESULTS.md)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        os._exit(code or 1)  # the answer could not be delivered (a closed pipe): say so
    os._exit(code)


def hide_userinfo_in_argv(argv: list[str]) -> None:
    """A token in a URL of our argv shows in /proc/<pid>/cmdline, and in every child's
    between its fork and its exec (a git probe): retitle ourselves first thing."""
    from checkoutcache.credentials import strip_userinfo

    if any(strip_userinfo(arg) != arg for arg in argv):
        import setproctitle

        setproctitle.setproctitle(" ".join(["checkoutcache", *(strip_userinfo(arg) for arg in argv)]))


def ready_answer(argv: list[str]) -> int | None:
    hide_userinfo_in_argv(argv)
    request = _ensure_request(argv)
    if request is None:
        return None
    root, as_json, repo, commit, scope, sparse, wait, history, base = request
    from checkoutcache.cones import cone_digest, parse_cone
    from checkoutcache.errors import CheckoutCacheError
    from checkoutcache.repospec import (LFS_ON, LFS_SETTING_VAR, SUBMODULES_RECURSIVE, SUBMODULES_SETTING_VAR,
                                        parse_commit, parse_repo)
    from checkoutcache.store.layout import LAYOUT_VERSION, RootPaths, checkout_name, default_root, existing_key
    from checkoutcache.store.ready import history_of, layout_version_of, lfs_of, ready_record, submodules_of

    try:
        sha = parse_commit(commit)
        cone = parse_cone(sparse)
        spec = parse_repo(repo, scope, lfs=os.environ.get(LFS_SETTING_VAR) or LFS_ON,
                          submodules=os.environ.get(SUBMODULES_SETTING_VAR) or SUBMODULES_RECURSIVE)
    except CheckoutCacheError:
        return None  # the full CLI explains what is wrong
    root_paths = RootPaths(os.path.realpath(os.path.expanduser(root)) if root else default_root())
    paths = root_paths.repo(existing_key(root_paths, spec.key, spec.legacy_key))
    name = checkout_name(sha, cone_digest(cone) if cone else None)
    found = layout_version_of(paths.repo_json)
    if found is not None and found > LAYOUT_VERSION:
        return None  # a newer version's store: the full CLI refuses it (NEWER_LAYOUT), touching nothing
    unrecorded: list[str] = []

    def through_writer() -> bool:
        from checkoutcache.handoff import record_use

        why = record_use(root_paths.root, paths.checkout(name), spec.url, commit, scope, sparse, spec.lfs,
                         spec.submodules)
        if why:
            unrecorded.append(why)
        return not getattr(why, "not_ready", False)  # False: the writer says it is not ready

    try:
        record = ready_record(paths.ready_marker(name), on_unrecorded=through_writer)
    except OSError:
        return None  # a marker we may not open: the full CLI says what and where
    path = paths.checkout(name)
    merge_base = None
    if record is not None and (history not in ("any", "full") or (history == "full" and
                                                                   history_of(path) == "shallow")):
        # The library waits for the history (or says what is wrong with the value).
        return not_ready(root, as_json, repo, commit, scope, sparse, wait, history, base)
    if record is not None and base is not None:
        from checkoutcache.clone.history import merge_base_of  # with --base only

        merge_base = merge_base_of(paths, name, base.lower())
        if not merge_base:  # not found yet, none, or a malformed base: the library answers
            return not_ready(root, as_json, repo, commit, scope, sparse, wait, history, base)
    if record is None:
        import time

        started = time.monotonic()
        handed = hand_to_serve(root_paths, paths.checkout(name), spec, repo, commit, scope, sparse, wait) \
            if history == "any" and base is None else REFUSED_AT_ONCE
        if handed == READY:
            try:
                record = ready_record(paths.ready_marker(name))
            except OSError:
                record = None
        if record is None:  # what serve answered is checked on disk; the library answers the rest
            return not_ready(root, as_json, repo, commit, scope, sparse,
                             rest_of_wait(wait, time.monotonic() - started) if handed != REFUSED_AT_ONCE else wait,
                             history, base)
    if unrecorded:
        sys.stderr.write(f"checkoutcache: this use of {path} was not recorded: {unrecorded[0]}\n")
    if as_json or not sys.stdout.isatty():
        answer = {"commit": sha, "path": path, "repo": spec.url, "state": "ready", "history": history_of(path)}
        if merge_base:
            answer.update(base=base.lower(), merge_base=merge_base)
        if cone:
            answer["sparse"] = list(cone)
        if lfs_of(record) is not None:
            answer["lfs"] = lfs_of(record)
        if submodules_of(record) is not None:
            answer["submodules"] = submodules_of(record)
        sys.stdout.write(json.dumps(answer, sort_keys=True) + "\n")
    else:
        sys.stdout.write(f"ready {path}\n" + (f"merge base {merge_base} (with {base.lower()})\n" if merge_base else ""))
    sys.stdout.flush()
    return 0


READY, WAITED, REFUSED, REFUSED_AT_ONCE = "ready", "waited", "refused", "refused at once"
# What serve answers for its own reasons (its policy, its load, its stop): the library then
# answers as if there were no serve.
_SERVE_REFUSALS = ("SERVER_BUSY", "SHUTTING_DOWN", "UNAUTHORIZED", "NOT_FOUND", "PAYLOAD_TOO_LARGE")


def hand_to_serve(root_paths, path: str, spec, repo: str, commit: str, scope: str, sparse: list[str],
                  wait: str) -> str:
    """A new commit, waited for, handed to the serve listening on this root's socket
    (CHECKOUTCACHE_UNIX_SOCKET, else <root>/checkoutcache.sock): its warm worker server
    clones it, and this process pays for neither the library's imports nor a worker's.

    Only for a remote repository without a credential of the caller's (serve uses its own),
    and only a ready answer for the very path this process computed counts, checked on disk
    by the caller: any socket in the root may be anybody's, so nothing (the token least of
    all) is sent to a peer that is not ours, root's or the root directory owner's
    (handoff.py). READY; WAITED (serve waited, within its own cap, and did not get it
    ready: the library waits for the rest of --wait); REFUSED (its policy or load said no,
    or it never answered in time: the library does it all in what is left of --wait);
    REFUSED_AT_ONCE (nothing asked)."""
    from checkoutcache.credentials import CREDENTIAL_VARS, strip_userinfo
    from checkoutcache.handoff import HANDOFF_SLACK, NoWriter, post

    if wait in ("0", "") or spec.is_local or strip_userinfo(repo) != repo or sys.stderr.isatty() or \
            any(os.environ.get(var) for var in CREDENTIAL_VARS):
        return REFUSED_AT_ONCE  # (at a terminal the full CLI draws its progress bar for the whole wait)
    request = {"repo": repo, "commit": commit, "wait": wait, "scope": scope, **({"sparse": sparse} if sparse else {})}
    try:
        from checkoutcache.units import parse_duration

        status, answer = post(root_paths.root, "/v1/ensure", request, parse_duration(wait, "--wait") + HANDOFF_SLACK,
                              api_url=False)
    except NoWriter:
        return REFUSED_AT_ONCE
    except Exception:  # a dead socket, a malformed answer: none of them is ours to report
        return REFUSED
    if status == 200 and answer.get("state") == "ready" and answer.get("path") == path:
        return READY
    if status >= 400 and status != 503 or answer.get("error") in _SERVE_REFUSALS or answer.get("state") == "ready":
        return REFUSED
    return WAITED


def rest_of_wait(wait: str, spent: float) -> str:
    from checkoutcache.errors import CheckoutCacheError
    from checkoutcache.units import parse_duration

    try:
        return f"{max(0.0, parse_duration(wait, '--wait') - spent):.3f}"
    except CheckoutCacheError:
        return wait  # the library answers BAD_ARGUMENT for it


def not_ready(root: str | None, as_json: bool, repo: str, commit: str, scope: str, sparse: list[str],
              wait: str, history: str = "any", base: str | None = None) -> int | None:
    """The library's answer for a checkout that is not ready; None to leave it to the full CLI."""
    if wait not in ("0", "") and sys.stderr.isatty():
        return None  # a person watches: the full CLI draws the progress bar
    from checkoutcache.answers import Answer
    from checkoutcache.cache import Cache
    from checkoutcache.errors import CheckoutCacheError
    from checkoutcache.units import parse_duration

    try:
        seconds = parse_duration(wait or "0", "--wait")
        cache = Cache(root, fork_workers=True)  # the CLI owns its process: workers fork from it
        cache.config  # a malformed setting is answered here, naming its variable
        answer = cache.ensure(repo, commit, wait=seconds, scope=scope, sparse=sparse, history=history, base=base)
    except CheckoutCacheError as exc:
        answer = Answer.from_error(exc)
    except Exception as exc:  # a bug: one answer a program can read, and the trace for a person (as the full CLI)
        import traceback

        traceback.print_exc()
        answer = Answer.from_error(CheckoutCacheError("INTERNAL_ERROR", detail=f"{type(exc).__name__}: {exc}"[:300]))
    if as_json or not sys.stdout.isatty():
        sys.stdout.write(json.dumps(answer.to_json(), sort_keys=True) + "\n")
        sys.stdout.flush()
    else:
        from checkoutcache.cli.output import emit_answer

        emit_answer(answer, False)
    return answer.exit_code


def _ensure_request(argv: list[str]) -> tuple[str | None, bool, str, str, str, list[str], str, str,
                                              str | None] | None:
    """(root, as_json, repo, commit, scope, sparse directories, wait, history, base) of a plain
    ensure, else None.
    `--json` and `--root DIR` may come before or after `ensure`, as in the full CLI."""
    args = global_options_first(list(argv))
    root, as_json = None, False
    while args and args[0] in ("--root", "--json"):
        if args[0] == "--json":
            as_json = True
            del args[0]
        elif len(args) >= 2:
            root = args[1]
            del args[:2]
        else:
            return None
    if not args or args[0] != "ensure":
        return None
    scope, positional, sparse, wait, rest = "default", [], [], "0", args[1:]
    history, base = "any", None
    while rest:
        arg = rest.pop(0)
        if arg == "--scope" and rest:
            scope = rest.pop(0)
        elif arg == "--history" and rest:
            history = rest.pop(0)
        elif arg == "--base" and rest:
            base = rest.pop(0)
        elif arg == "--sparse" and rest:
            sparse.append(rest.pop(0))
        elif arg == "--wait" and rest:
            wait = rest.pop(0)
        elif arg.startswith("-"):
            return None  # --wait, --help, anything else: the full CLI
        else:
            positional.append(arg)
    if len(positional) != 2:
        return None
    return root, as_json, positional[0], positional[1], scope, sparse, wait, history, base


def global_options_first(argv: list[str]) -> list[str]:
    """`--json` and `--root DIR` are the group's options; given after the command
    (`checkoutcache ensure REPO SHA --json`), they are moved before it. Nothing after
    `--` moves: that is exec's command line."""
    front, rest, index = [], [], 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            return front + rest + argv[index:]
        if arg == "--json":
            front.append(arg)
        elif arg == "--root" and index + 1 < len(argv):
            front += argv[index:index + 2]
            index += 1
        elif arg.startswith("--root="):
            front.append(arg)
        else:
            rest.append(arg)
        index += 1
    return front + rest
