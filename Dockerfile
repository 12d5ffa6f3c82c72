# checkoutcache sidecar: `checkoutcache serve` as a non-root user, the cache on a volume.
#
#   docker build --build-arg REVISION="$(git rev-parse HEAD)" -t checkoutcache .
#   docker run -d --name cc -v cache:/cache -e CHECKOUTCACHE_MAX_CHECKOUTS=20 checkoutcache
#   docker run --rm -v cache:/cache:ro --user 10002:10001 checkoutcache ensure https://github.com/org/repo SHA --wait 600
#
# With no settings it serves the API on the Unix socket /cache/checkoutcache.sock
# (the store's group may use it; no token). For TCP, set CHECKOUTCACHE_LISTEN and a
# token (CHECKOUTCACHE_API_TOKEN or CHECKOUTCACHE_API_TOKEN_FILE). Every setting is
# an environment variable (docs/operations.md, "Settings"); docs/deployment.md
# walks through a pod (deploy/kubernetes.yaml) and one host (deploy/compose.yaml),
# where review containers of other uids read the store through a read-only mount.

# The base, pinned by digest: a rebuild gets the same base until this line is changed on
# purpose (the digest of the tag today: `skopeo inspect --format '{{.Digest}}'
# docker://docker.io/library/python:3.11-slim-bookworm`). Where no registry is reachable,
# give a local image instead: CI builds with --build-arg BASE_IMAGE=<the stand-in
# ../shared/tools/container-base makes>, tests/helpers/containers.py says how.
ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91
FROM ${BASE_IMAGE}

# git: the fast transport and checkout; git-lfs: LFS files with their content; ssh for
# ssh:// remotes; tini: PID 1 that forwards signals (serve reaps its own clone workers:
# it is their subreaper, so the image works without tini too). Without what a container
# never reads (manuals, translations, docs but the copyright files) and without apt's
# downloaded packages and caches: about 130 MB less, nothing lost (docs/deployment.md).
RUN printf '%s\n' 'path-exclude=/usr/share/doc/*' 'path-include=/usr/share/doc/*/copyright' \
        'path-exclude=/usr/share/man/*' 'path-exclude=/usr/share/info/*' 'path-exclude=/usr/share/locale/*' \
        > /etc/dpkg/dpkg.cfg.d/checkoutcache-slim \
 && apt-get update \
 && apt-get install -y --no-install-recommends git git-lfs openssh-client ca-certificates tini \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/log/apt /var/log/dpkg.log

# A fixed uid and gid, the store's one writer. /cache is its alone (0755) and a new volume
# starts as a copy of it: review containers of other uids mount it read-only. The store
# sets the modes of what it creates itself, whatever the umask (CHECKOUTCACHE_SHARING:
# writer, the default, or group for peers that trust each other, docs/deployment.md).
# /workspaces: where review containers of any uid make their own writable trees (sticky,
# as /tmp: none can rename or remove another's).
RUN groupadd --system --gid 10001 checkoutcache \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/checkoutcache \
            --shell /usr/sbin/nologin checkoutcache \
 && mkdir /cache && chown checkoutcache:checkoutcache /cache && chmod 0755 /cache \
 && mkdir /workspaces && chmod 1777 /workspaces

# The dependencies first (pyproject's, with the s3 extra), at the versions CI tests
# (constraints.txt): a layer that a change of the code does not rebuild. Then the project alone.
COPY constraints.txt pyproject.toml /src/
RUN python3 -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["s3"]))' > /src/requirements.txt \
 && pip install --no-cache-dir --disable-pip-version-check -c /src/constraints.txt -r /src/requirements.txt
COPY README.md /src/
COPY checkoutcache /src/checkoutcache
RUN pip install --no-cache-dir --disable-pip-version-check --no-deps "/src[s3]" \
 && pip check && rm -rf /src
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

# OCI labels, last (a new revision rebuilds no layer); version is pyproject's (tests/test_container.py checks), revision the commit
# built (pass --build-arg REVISION=...), source where that commit can be fetched.
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="checkoutcache" \
      org.opencontainers.image.description="A git checkout cache beside review containers: one checkout per commit, one writer" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="MIT"
