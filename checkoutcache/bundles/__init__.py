"""Fleet seeding: git bundles of a repository's mirror kept in shared storage
(an S3-compatible bucket, a shared directory, or an https server to read from).

- bundlelist.py git's bundle list format, and the choices made from a list (pure)
- objectstore.py reading and writing the store's objects: s3://, file://, https://
- seed.py       a new mirror takes the newest usable bundles before it fetches

What CHECKOUTCACHE_BUNDLE_URI names and the store's layout are bundleuri.py's
(in the base layer: the settings parse it). Publishing (`checkoutcache bundle publish`) lives in upkeep/publish.py. A bundle
store is only ever a speed-up: nothing here is the reason a clone fails.
"""
