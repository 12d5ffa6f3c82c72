import sys

from checkoutcache.cli.fast import ready_answer

# The ready answer first, before click and attrs are imported (cli/fast.py).
code = ready_answer(sys.argv[1:])
if code is not None:
    sys.exit(code)

from checkoutcache.cli.commands import main  # noqa: E402

main()
