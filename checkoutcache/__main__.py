import sys

from checkoutcache.cli.fast import exit_after_answer, ready_answer

# The ready answer first, before click and attrs are imported (cli/fast.py).
code = ready_answer(sys.argv[1:])
if code is not None:
    exit_after_answer(code)

from checkoutcache.cli.commands import main  # noqa: E402

main()
