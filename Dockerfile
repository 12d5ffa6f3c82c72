# checkoutcache sidecar: `checkoutcache serve` as a non-root user, the cache on a volume.
#
#   docker build -t checkoutcache .
#   docker run -d --name cc -v cache:/cache -e CHECKOUTCACHE_MAX_CHECKOUTS=20 checkoutcache
#   docker run --rm -v cache:/cache --user 10002:10001 checkoutcache ensure https://github.com/org/repo SHA --wait 600
#
# With no settings it serves the API on the Unix socket /cache/checkoutcache.sock
# (the volume's group may use it; no token). For TCP, set CHECKOUTCACHE_LISTEN and a
# token (CHECKOUTCACHE_API_TOKEN or CHECKOUTCACHE_API_TOKEN_FILE). Every setting is
# an environment variable (docs/operations.md, "Settings"); docs/deployment.md
# walks through a pod (deploy/kubernetes.yaml) and one host (deploy/compose.yaml).
FROM python:3.11-slim-bookworm

# git: the fast transport and checkout; git-lfs: LFS files with their content; ssh for
# ssh:// remotes; tini: PID 1 that forwards signals (serve reaps its own clone workers:
# it is their subreaper, so the image works without tini too).
RUN apt-get update \
 && apt-get install -y --no-install-recommends git git-lfs openssh-client ca-certificates tini \
 && rm -rf /var/lib/apt/lists/*

# A fixed uid and gid: review containers join the group (--user UID:10001, a pod's
# fsGroup 10001) to share the store. /cache is setgid and group-writable, and a new
# volume starts as a copy of it; the store sets the modes of what it creates itself,
# whatever the umask of whoever creates it.
RUN groupadd --system --gid 10001 checkoutcache \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/checkoutcache \
            --shell /usr/sbin/nologin checkoutcache \
 && mkdir /cache && chown checkoutcache:checkoutcache /cache && chmod 2775 /cache

COPY pyproject.toml README.md /src/
COPY checkoutcache /src/checkoutcache
RUN pip install --no-cache-dir "/src[s3]" && rm -rf /src
COPY scripts/docker-entrypoint.sh scripts/docker-healthcheck scripts/checkoutcache-gc-cron /usr/local/bin/

ENV CHECKOUTCACHE_ROOT=/cache \
    CHECKOUTCACHE_UNIX_SOCKET=/cache/checkoutcache.sock
VOLUME ["/cache"]
USER checkoutcache
WORKDIR /home/checkoutcache
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 CMD ["docker-healthcheck"]
# serve's stop takes at most CHECKOUTCACHE_STOP_TIMEOUT (20 s): give `docker stop -t 30`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tini", "--", "docker-entrypoint.sh"]
