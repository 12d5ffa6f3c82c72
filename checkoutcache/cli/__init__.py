"""cli: the command line, `checkoutcache [--root DIR] [--json] COMMAND ...`.

- fast.py      the ready answer of `ensure`, before click and attrs are imported.
- commands.py  the click commands and the full `main`.
- output.py    how answers and reports read: one JSON object, or short text,
               a progress bar on a terminal.
- execute.py   `exec`: a command run inside a held checkout.
- demo.py      `demo`: the whole story on a repository built on the spot.
"""

import sys


def main(argv: list[str] | None = None) -> None:
    """The console script: the ready answer without click when it can (fast.py)."""
    from checkoutcache.cli.fast import exit_after_answer, ready_answer

    code = ready_answer(sys.argv[1:] if argv is None else argv)
    if code is not None:
        if argv is not None:
            sys.exit(code)  # called in a process of the caller's (a test): its teardown is its own
        exit_after_answer(code)
    from checkoutcache.cli.commands import main as full_cli

    full_cli(argv)
