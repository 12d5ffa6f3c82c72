"""serve's process: listeners, threads, signals, the bounded stop, PID 1 duty.

One process holds everything that must be shared (holds are open descriptors,
the metrics registry, the worker server, the gc schedule), so granian's HTTP
servers are embedded in it (granian.server.embed, pinned: its embedded mode is
marked experimental upstream; our tests drive it), one per listener, all on one
asyncio event loop (uvloop): the API on TCP (loopback unless --allow-remote,
a token always), on a Unix socket (0660), or both, and optionally the health port (/healthz, /readyz,
/metrics without a token, for a kubelet and Prometheus).

Order at start (each step for a reason):
1. become a child subreaper (reaper.py): workers are reaped by us;
2. raise the open-file limit: idle connections are descriptors;
3. fork the worker server while still single-threaded (workserver.py);
4. build the servers, then our logging (granian configures logging when built);
5. record the limits in force in the root (for status anywhere), then threads,
   each apart so none waits on another: hold expiry with the tokens file's watch
   and the reaper (no store file touched), the gc schedule, the clone queue's
   dispatcher (serve/admission.py), the journal follower.

SIGHUP: read the tokens file again (as a change to it does, seen within a
second): new tokens in force, dropped ones valid for the overlap (service.py).

SIGTERM (or SIGINT): stop accepting; requests waiting on a clone are answered
SHUTTING_DOWN (503, Retry-After) at once; in-flight answers get --stop-timeout
(20 s by default, under Kubernetes' 30 s); holds are released; the process
exits (stop_code: 0 when the stop did all it promises, clones it ended included; 1 when
something was lost). A watchdog thread holds
the bound whatever blocks. Clone workers are processes of their own, reparented
to us: they get what is left of the bound to publish; those still running near
its end get SIGTERM, which ends each cleanly (no failure or death recorded, its
scratch removed), and the next ask clones the commit again. (Without the stop,
a container's PID namespace going kills them with SIGKILL: their commits are
found absent too, with one death counted.)
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import resource
import signal
import socket
import stat
import sys
import threading
import time
import uuid
from pathlib import Path

from checkoutcache.cache import Cache
from checkoutcache.clone.spawn import use_worker_server
from checkoutcache.clone.submodules import POLICY_LOCAL_VAR, POLICY_REPOS_VAR
from checkoutcache.clone.workserver import WorkerServer
from checkoutcache.config import Config, ServeSettings
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.serve import logs
from checkoutcache.serve.app import Api, Listener, Pools, allowed_hosts
from checkoutcache.serve.policy import ApiPolicy
from checkoutcache.serve.reaper import Reaper, become_subreaper
from checkoutcache.serve.service import Service
from checkoutcache.store import locks, tree
from checkoutcache.store.create import init_root
from checkoutcache.upkeep.limits import limits_of

log = logging.getLogger("checkoutcache.serve")

OPENAPI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openapi.json")
# granian's header read deadline, also its idle keep-alive limit: a client that sends
# nothing for this long is closed (a slowloris cannot hold a connection).
HEADER_DEADLINE_MS = 5000
HEADER_BUFFER = 64 * 1024
LISTEN_BACKLOG = 2048


def parse_listen(value: str, allow_remote: bool) -> tuple[str, int]:
    """(host, port) of HOST:PORT, [V6]:PORT or :PORT (loopback); a non-loopback host only with allow_remote."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
        if not 0 < number < 65536:
            raise ValueError
    except ValueError:
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"--listen {value[:60]!r} is not HOST:PORT") from None
    if not allow_remote:
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"--listen {host!r} is not a loopback address; "
                                                          f"pass --allow-remote to listen there on purpose")
    return host, number


def prepare_unix_socket(path: str) -> None:
    """Only a dead server's socket is ever replaced: never a file of another kind, never a live server's."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"{path} exists and is not a socket; not touching it")
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(path)
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"another server is listening on {path}")
    except ConnectionRefusedError:
        os.unlink(path)  # a dead server's socket
    finally:
        probe.close()


def raise_open_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def make_server(app, settings: ServeSettings, address: tuple[str, int] | None = None, uds: str | None = None):
    from granian.constants import HTTPModes, Interfaces
    from granian.http import HTTP1Settings
    from granian.server.embed import Server

    common = dict(interface=Interfaces.RSGI, http=HTTPModes.http1, websockets=False, backlog=LISTEN_BACKLOG,
                  backpressure=settings.max_connections, log_enabled=False,
                  http1_settings=HTTP1Settings(header_read_timeout=HEADER_DEADLINE_MS, keep_alive=True,
                                               max_buffer_size=HEADER_BUFFER))
    if uds is not None:
        server = Server(app, uds=Path(uds), **common)
        server.uds_permissions = 0o660  # not an argument of the embedded Server: read when it binds
        return server
    return Server(app, address=address[0], port=address[1], **common)


def wait_listening(addresses: list[tuple[str, int]], sockets: list[str], deadline: float) -> bool:
    """Whether every listener accepts a connection before the deadline."""
    pending = [("tcp", a) for a in addresses] + [("unix", p) for p in sockets]
    while pending and time.monotonic() < deadline:
        kind, where = pending[0]
        try:
            if kind == "tcp":
                socket.create_connection(where, timeout=0.5).close()
            else:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.settimeout(0.5)
                    probe.connect(where)
            pending.pop(0)
        except OSError:
            time.sleep(0.02)
    return not pending


def serve(cache: Cache, config: Config, settings: ServeSettings, policy: ApiPolicy, version: str) -> int:
    unix = settings.unix
    address = parse_listen(settings.api_address, settings.allow_remote) if settings.api_address else None
    health = parse_listen(settings.health_listen, allow_remote=True) if settings.health_listen else None
    if address is not None and not policy.tokens:
        raise CheckoutCacheError("BAD_ARGUMENT", what="serving over TCP needs a bearer token: set "
                                                      "CHECKOUTCACHE_API_TOKEN or --token-file (or serve on --unix "
                                                      "only)")
    if unix:
        prepare_unix_socket(unix)
    refuse_a_taken_address(address)
    refuse_a_taken_address(health)
    reaper = Reaper()
    subreaper = become_subreaper()
    raise_open_file_limit()
    init_root(cache.paths)
    tree.make_private_dir(cache.paths.serve_dir)
    # An older version's store: its writers-only directories made so at once, whether or not a
    # gc can run (a reader holding an old gc.lock descriptor keeps every gc from it).
    tree.keep_private_dirs([*cache.paths.private_dirs,
                            *(d for key in cache.paths.repo_keys() for d in cache.paths.repo(key).private_dirs)])
    # Named by a nonce, not by our pid alone: every container's serve has the same pid,
    # and two of them may share this root (invariant 3).
    journal = cache.paths.serve_journal(os.getpid(), uuid.uuid4().hex[:16])
    os.environ["CHECKOUTCACHE_CLONE_JOURNAL"] = journal  # workers we start report to us
    # The policy goes to our workers too: a .gitmodules names nothing the API could not.
    os.environ[POLICY_REPOS_VAR] = ",".join(policy.repo_patterns)
    os.environ[POLICY_LOCAL_VAR] = "1" if policy.allow_local else "0"
    # Forked while we are still single-threaded: it forks our clone workers later.
    worker_server = WorkerServer()
    use_worker_server(worker_server)
    reaper.own.add(worker_server.pid)
    # Taken after the fork: a worker server that inherited it would keep it held past our death.
    journal_lock = locks.serve_journal_owned(journal)
    service = Service(cache, config, settings, journal, policy, version)
    adopt_running_workers(service, reaper)
    pools = Pools(settings.max_waiting, settings.max_waiting_per_token)
    with open(OPENAPI, "rb") as handle:
        openapi = handle.read()
    servers = []
    if unix:
        servers.append(make_server(Api(service, Listener(False, None), pools, openapi), settings, uds=unix))
    if address:
        listener = Listener(True, allowed_hosts(*address))
        servers.append(make_server(Api(service, listener, pools, openapi), settings, address=address))
    if health:
        servers.append(make_server(Api(service, Listener(True, None, health_only=True), pools, openapi), settings,
                                   address=health))
    logs.configure(settings.log_format, settings.log_level)
    # The log writer and the pools take the GIL from the event loop: switch often, so a
    # batch of log lines never holds a ready answer for the default 5 ms.
    sys.setswitchinterval(0.001)
    if not subreaper:
        log.warning("could not become a child subreaper: orphaned clone workers go to PID 1")

    threads = [threading.Thread(target=service.keep_leases, name="cc-leases", daemon=True,
                                kwargs={"on_tick": reaper.sweep}),
               threading.Thread(target=service.run_gc_schedule, name="cc-gc", daemon=True),
               threading.Thread(target=service.clones.run, name="cc-clones", daemon=True, args=(service.stopping,)),
               threading.Thread(target=service.follow_journal, name="cc-journal", daemon=True)]
    service.record_limits()
    for thread in threads:
        thread.start()
    code = _run(servers, service, settings, address, health, unix, reaper)
    service.release_all()
    pools.shutdown()
    use_worker_server(None)
    worker_server.close()
    remove_own_journal(journal_lock)
    if unix:
        try:
            if stat.S_ISSOCK(os.lstat(unix).st_mode):
                os.unlink(unix)
        except FileNotFoundError:
            pass
    log.info("stopped", extra={"event": "stopped", "code": code})
    logs.flush()
    # os._exit: interpreter exit joins pool threads, and one stuck in flock() or a wait
    # would hold the exit past any bound.
    os._exit(code)


def adopt_running_workers(service: Service, reaper: Reaper) -> None:
    """Clone workers an earlier serve of this root left running (it was killed; they live on, and
    come to us as their subreaper) take clone slots until they end (serve/admission.py)."""
    from checkoutcache.store.inventory import NO_SIZES, inventory
    from checkoutcache.store.liveness import same_pid_namespace

    try:
        repos = inventory(service.cache.paths, sizes=NO_SIZES)
    except (OSError, CheckoutCacheError):
        return
    running = [c.pid for info in repos for c in info.clones
               if c.alive and c.pid and c.pid != os.getpid() and same_pid_namespace(c.pidns) and reaper.is_worker(c.pid)]
    service.clones.adopt(running)


def refuse_a_taken_address(address: tuple[str, int] | None) -> None:
    """Never a second server on an address one answers at (same uid's sockets may share a port:
    each would hold its own holds and nonces)."""
    if address is None:
        return
    try:
        socket.create_connection(address, timeout=0.5).close()
    except OSError:
        return
    raise CheckoutCacheError("BAD_ARGUMENT", what=f"another server is listening on {address[0]}:{address[1]}")


def remove_own_journal(held: locks.Lock) -> None:
    """Our journal, and only ours: removed while its lock is still ours and only if the path
    still names the file we locked (nothing a peer put there)."""
    try:
        if os.path.samestat(os.fstat(held.fileno()), os.lstat(held.path)):
            os.unlink(held.path)
    except OSError:
        pass
    held.release()


def _run(servers: list, service: Service, settings: ServeSettings, address, health, unix, reaper: Reaper) -> int:
    import uvloop

    async def main() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # SIGHUP reloads the tokens (its default action, exit 129, lost every hold).
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.run_in_executor(None, service.reload_tokens, "sighup"))
        tasks = [asyncio.ensure_future(s.serve()) for s in servers]
        listening = [a for a in (address, health) if a]
        up = await loop.run_in_executor(None, wait_listening, listening, [unix] if unix else [], time.monotonic() + 15)
        if not up:
            log.error("the listeners did not come up", extra={"event": "start_failed"})
            stop.set()
        else:
            where = " and ".join(w for w in (unix, address and f"http://{address[0]}:{address[1]}") if w)
            log.info("checkoutcache %s serving %s on %s", service.version, service.cache.root, where, extra={
                "event": "serving", "version": service.version, "root": service.cache.root, "api": where,
                "health": f"http://{health[0]}:{health[1]}" if health else None, "pid": os.getpid(),
                "limits": limits_of(service.config), "gc_interval": settings.gc_interval,
                "max_waiting": settings.max_waiting, "max_connections": settings.max_connections,
                "max_holds": settings.max_holds, "tokens_file": settings.token_file,
                "token_overlap": settings.token_overlap})
            if settings.ready_file:
                try:
                    with open(settings.ready_file, "w") as handle:
                        handle.write(json.dumps({"listening": where, "pid": os.getpid(), "unix": unix,
                                                 "tcp": f"http://{address[0]}:{address[1]}" if address else None,
                                                 "health": f"http://{health[0]}:{health[1]}" if health else None}))
                except OSError as exc:  # checked when read; gone since: said, and the stop exits 1
                    log.error("CHECKOUTCACHE_READY_FILE %r could not be written: %s", settings.ready_file,
                              exc.strerror or exc, extra={"event": "start_failed"})
                    up = False
                    stop.set()
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        failed = [t for t in tasks if t in done and t.exception() is not None]
        for task in failed:
            log.error("a listener stopped: %s", task.exception(), extra={"event": "listener_failed"})
        started = time.monotonic()
        # The bound holds whatever blocks the loop: a watchdog thread exits past it.
        watchdog = threading.Timer(settings.stop_timeout + 1.0, os._exit, (1,))
        watchdog.daemon = True
        watchdog.start()
        service.stopping.set()  # waiting requests answer SHUTTING_DOWN now; new ones too
        log.info("stopping: in-flight answers get %gs", settings.stop_timeout, extra={"event": "stopping"})
        for server in servers:
            server.stop()  # stop accepting, close idle keep-alive connections, let in-flight answers finish
        _, pending = await asyncio.wait(tasks, timeout=settings.stop_timeout)
        log.info("drained in %.2fs, %d listener(s) cut off", time.monotonic() - started, len(pending),
                 extra={"event": "drained", "seconds": round(time.monotonic() - started, 3), "cut_off": len(pending)})
        clones_left = await finish_clones(reaper, started + settings.stop_timeout)
        watchdog.cancel()
        return stop_code(up, len(failed), len(pending), clones_left)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def stop_code(up: bool, listeners_failed: int, cut_off: int, clones_left: int) -> int:
    """serve's exit status after a stop. 0: the stop did what it promises, clones it had to
    end included (SIGTERMed, each cleanly: nothing recorded, cloned again on the next ask).
    That is routine in every rollout; under Kubernetes a non-zero status reads as the
    container's failure (reason Error: alerts, and a Job pod's sidecar failing the pod).
    1: something was lost or never worked: the listeners never came up or one failed,
    answers in flight were cut off at the bound, or a clone worker did not end within it
    (it dies with the container: a death counted against its commit)."""
    return 1 if not up or listeners_failed or cut_off or clones_left else 0


async def finish_clones(reaper: Reaper, deadline: float) -> int:
    """Our clone workers get what is left of the stop bound to publish; those still running
    near its end are SIGTERMed, which ends each cleanly (no failure, no death, no scratch:
    worker.on_stop), so the next start, or any asker, clones their commits again. A worker
    that cannot be reached in time dies with the container's PID namespace instead, and is
    counted as a death once (store/liveness: its lock is free, its record a dead owner's)."""
    reserve = min(1.0, max(0.0, deadline - time.monotonic()) / 4)  # for the SIGTERMed to clean up
    running = reaper.workers()
    if running:
        log.info("waiting for %d clone(s) in flight", len(running), extra={"event": "waiting_for_clones",
                                                                           "clones": len(running)})
    while running and time.monotonic() < deadline - reserve:
        await asyncio.sleep(0.05)
        running = reaper.workers()
    if not running:
        return 0
    log.warning("stopping %d clone(s) that could not finish within the stop timeout; their commits are cloned "
                "again on the next ask", len(running), extra={"event": "stopping_clones", "clones": len(running)})
    reaper.stop_workers(running)
    while running and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        running = reaper.workers()
    if running:
        log.error("%d clone worker(s) did not end within the stop timeout", len(running),
                  extra={"event": "clones_left", "clones": len(running)})
    return len(running)


def served_version() -> str:
    try:
        from importlib.metadata import version

        return version("checkoutcache")
    except Exception:
        return "unknown"
