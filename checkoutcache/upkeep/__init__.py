"""upkeep: keeping a root within its limits and telling what it holds.

- eviction.py  the pure plan: which checkouts to evict, which to keep and why.
- gc.py        one gc run: trash, dead leftovers, eviction, mirror maintenance.
- forget.py    records gc forgets once what they record is over (deaths, failures, journals).
- verify.py    the deep check of published checkouts.
- status.py    the status report (read-only).
"""
