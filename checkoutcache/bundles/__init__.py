"""Fleet seeding: git bundles of a repository's mirror kept in shared storage
(an S3-compatible bucket, a shared directory, or an https server to read from).
Everything of bundles lives here:

- location.py   what CHECKOUTCACHE_BUNDLE_URI names and the store's layout (pure: the
                settings parse it, so it sits in the base layer)
- bundlelist.py git's bundle list format, and the choices made from a list (pure)
- objectstore.py reading and writing the store's objects: s3://, file://, https://
- gitbundle.py  git's side: verify a bundle, take it into a mirror, create one
- seed.py       a new mirror takes the newest usable bundles before it fetches
- publish.py    `checkoutcache bundle publish`: bundles of a mirror into the store

A bundle store is only ever a speed-up: nothing here is the reason a clone fails.
"""
