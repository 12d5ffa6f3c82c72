#!/bin/sh
# The image's command. No arguments, or arguments that start with "-": `checkoutcache
# serve` with them (every setting is also read from the environment:
# docs/operations.md, "Settings"). Any other first argument is a checkoutcache command, so
# `docker run IMAGE status` or `docker run IMAGE ensure REPO SHA` work as written.
set -eu
case "${1:-}" in
  "" | -*) exec checkoutcache serve "$@" ;;
  *) exec checkoutcache "$@" ;;
esac
