# checkoutcache sidecar: `checkoutcache serve` as a non-root user, the cache on a volume.
#
#   docker build -t checkoutcache .
#   docker run -v cache:/cache -e CHECKOUTCACHE_MAX_CHECKOUTS=20 checkoutcache
#
# Settings come from the environment (README "Settings"; CHECKOUTCACHE_LISTEN,
# CHECKOUTCACHE_UNIX_SOCKET and CHECKOUTCACHE_GC_INTERVAL for the server).
FROM python:3.11-slim-bookworm

# git: the fast transport and checkout; tini: PID 1 that reaps detached clone
# workers once they exit (they are reparented to PID 1); ssh for ssh:// remotes;
# git-lfs: LFS files are checked out with their content (README "Git LFS").
RUN apt-get update \
 && apt-get install -y --no-install-recommends git git-lfs openssh-client ca-certificates tini \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin checkoutcache \
 && mkdir /cache && chown checkoutcache:checkoutcache /cache

COPY pyproject.toml README.md /src/
COPY checkoutcache /src/checkoutcache
RUN pip install --no-cache-dir "/src[s3]" && rm -rf /src
COPY scripts/docker-entrypoint.sh scripts/docker-healthcheck scripts/checkoutcache-gc-cron /usr/local/bin/

ENV CHECKOUTCACHE_ROOT=/cache \
    CHECKOUTCACHE_LISTEN=127.0.0.1:8787 \
    CHECKOUTCACHE_GC_INTERVAL=5m \
    CHECKOUTCACHE_GRACE=15m
VOLUME ["/cache"]
USER checkoutcache
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 CMD ["docker-healthcheck"]
ENTRYPOINT ["tini", "--", "docker-entrypoint.sh"]
