"""upkeep: keeping a root within its limits and telling what it holds.

- eviction.py          the pure plan: which checkouts to evict, which to keep and why.
- gc.py                one gc run: its order and locks, eviction, repository drops, unmet limits.
- report.py            what a gc run says (Removed, KeptOver, GcReport and its JSON).
- leftovers.py         trash, dead processes' leftovers, and gc's one way to delete.
- workspace_upkeep.py  dead workspaces reaped, live ones measured and their pins bounded.
- spare_upkeep.py      which spares go (space short, past max-spares) and a spare's record.
- mirror_upkeep.py     a mirror's keep-refs, stale leftovers, repacks and LFS pruning.
- evict.py             removing whole repositories, and `checkoutcache evict` by hand.
- history.py           gc's part in a shallow mirror's background history.
- forget.py            records gc forgets once what they record is over (deaths, failures, journals).
- limits.py            the limits in force, recorded in the root for status.
- verify.py            the deep check of published checkouts.
- status.py            the status report (read-only).
"""
