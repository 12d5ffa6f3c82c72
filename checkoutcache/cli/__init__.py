"""cli: the command line, `checkoutcache [--root DIR] [--json] COMMAND ...`.

- commands.py  the click commands and `main` (the console script).
- output.py    how answers and reports read: one JSON object, or short text,
               a progress bar on a terminal.
- execute.py   `exec`: a command run inside a held checkout.
- demo.py      `demo`: the whole story on a repository built on the spot.
"""

from checkoutcache.cli.commands import main

__all__ = ["main"]
