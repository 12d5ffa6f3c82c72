#!/bin/sh
# The container's command: `checkoutcache serve` with its settings from the
# environment. Limits (CHECKOUTCACHE_MAX_CHECKOUTS, CHECKOUTCACHE_MIN_FREE, ...)
# are read by checkoutcache itself; arguments given to the container are added.
set -eu
: "${CHECKOUTCACHE_ROOT:?set CHECKOUTCACHE_ROOT to the cache volume}"
checkoutcache=${CHECKOUTCACHE_BIN:-checkoutcache}
if [ -n "${CHECKOUTCACHE_UNIX_SOCKET:-}" ]; then
  set -- --unix "$CHECKOUTCACHE_UNIX_SOCKET" "$@"
else
  set -- --listen "${CHECKOUTCACHE_LISTEN:-127.0.0.1:8787}" "$@"
fi
exec $checkoutcache --root "$CHECKOUTCACHE_ROOT" serve --gc-interval "${CHECKOUTCACHE_GC_INTERVAL:-5m}" "$@"
