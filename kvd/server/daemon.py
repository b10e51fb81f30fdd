"""The daemon's lifecycle: start in order, serve, drain on a signal, clean up.

Start order (readiness follows it): refuse a live daemon at the address and
remove a dead one's leftovers (socket file, shm segments); check the whole
pool set against the memory that is there and the node budget; create and
prefault every pool (in worker threads); bind the socket; then "ready"
(log line, ``READY=1`` under systemd, ``task_status.started``).

Serving is one root task group on the event loop (the maintenance loop:
pid watch, lease expiry, pressure notices; the signal receiver; the
systemd watchdog; when enabled, the metrics endpoint and KV events
publisher) plus one *request thread* that owns the ROUTER socket.

The request thread blocks in a plain receive on the socket, handles the
message and replies. The event loop never touches the socket: it holds its
own DEALER connected to the ROUTER over inproc (a random routing id), and
what it sends (pressure notices, deferred hello replies) goes through an
outbox; a one-frame wake-up on that connection, queued with the requests,
has the thread send the outbox (``stop`` ends the thread). So the thread
needs no ``zmq_poll`` over two sockets and no readiness checks: one
blocking receive per message, as a bare ZeroMQ server does. One lock
serialises the dispatcher and the engines: the request thread holds it
per message, the loop around each thing it does with them (maintenance,
drain checks, reload, stats for metrics and the watchdog, runtime-pool
creation); an engine call never runs in two threads at once. Engine events
queue under the lock and the loop hands them to the publisher. Why a
thread: an ``anyio.wait_readable`` wake-up costs ~20 µs per request on
this machine (asyncio's epoll callback, a future, a task step), more than
the whole handling of a PING; see docs/architecture.md, "Request path".

What no client may do (issue #14): the loop runs `guard.guard_connections`;
the request thread sends replies through `transport.ReplyQueues` (a peer
that does not read loses them and its session); freed heap goes back to
the kernel after a quiet period; a tcp hello first has its peer's pid found
(`local_tcp_pid`, in a worker thread) so it is watched as an ipc peer is.

SIGTERM/SIGINT start a graceful drain: requests that start new work
(hello, allocate, fork, pin, flush) get SHUTTING_DOWN, running sequences
may still append, commit, truncate and free; the drain ends when no
sequence is held or after ``server.drain_timeout_s``. A second signal
stops at once. Either way the socket file and the shm segments are
removed (runtime pools' included).

SIGHUP applies a re-read config file (`kvd.server.reload`); a file that
does not load changes nothing. Runtime pools (a hello with ``create``) are
created one at a time in a worker thread by one task, in order, while the
socket loop keeps serving; the hello is then answered as an attach.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import secrets
import signal
import threading
import time
import typing
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import structlog
import zmq
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from kvd_client import wire

from kvd.config import Config, PoolConfig
from kvd.errors import DaemonError, StartupError
from kvd.memory import remove_stale_segments
from kvd.server import transport
from kvd.server.dispatch import BatchRun, Dispatcher
from kvd.server.freezer import Freezer
from kvd.server.guard import guard_connections
from kvd.server.handshake import PendingHello
from kvd.server.kvevents import MEDIUM_CPU, MEDIUM_GPU, EventChannel, KVEventPublisher
from kvd.server.metrics import MetricsServer, loop_snapshot, snapshot_of, start_metrics_server
from kvd.server.pools import PoolRefusal, Pools
from kvd.server.reload import reload_config
from kvd.server.sdnotify import Notifier
from kvd.server.security import ZapHandler, load_client_keys, load_server_keys
from kvd.server.sessions import (
    DescriptorBudget,
    SessionTable,
    parse_peer_address,
    raise_nofile_limit,
)
from kvd.server.tcp_hellos import TcpHellos

__all__ = ["Daemon"]

log = structlog.get_logger("kvd.server")

# A plain int: pyzmq's flag enums cost an enum construction per operation.
_NOBLOCK: Final = int(zmq.NOBLOCK)
#: A body frame larger than this is handed to the decoder as a view, not copied.
_COPY_BODY_MAX: Final = 64 * 1024
#: Engine events move to the channels every 2 ms while they flow, up to 64 ms apart idle.
_EVENTS_INTERVAL, _EVENTS_IDLE = 0.002, 0.064


class Daemon:
    """One kvd daemon for ``config``; ``await run()`` serves until a signal or `stop`.

    ``reload`` (optional) returns a fresh Config on SIGHUP; ``env`` resolves the default
    socket path (tests pass their own); ``own_process``: the process is kvd.cli's (heap frozen).
    """

    def __init__(
        self,
        config: Config,
        *,
        env: Mapping[str, str] | None = None,
        reload: Callable[[], Config] | None = None,
        on_log_config: Callable[[Config], None] | None = None,
        handle_signals: bool = True,
        own_process: bool = False,
    ) -> None:
        self.config = config
        self.addresses = [config.server.address or wire.default_socket(env)]
        if config.server.tcp_address:
            self.addresses.append(config.server.tcp_address)
        self.instance = transport.instance_id(self.addresses[0])
        self.epoch = secrets.randbits(63)
        self._reload = reload
        self._on_log_config = on_log_config
        self._handle_signals = handle_signals
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        #: Vets the CURVE clients of a tcp endpoint (None without one).
        self._zap: ZapHandler | None = None
        self.pools = Pools(config, instance=self.instance)
        self._freezer = Freezer(self.pools.born) if own_process else None
        self._bound: list[Path] = []
        self._publisher: KVEventPublisher | None = None
        self._channels: dict[str, EventChannel] = {}
        #: Hellos waiting for a runtime pool, from the request thread to the creating task.
        self._pending: tuple[
            MemoryObjectSendStream[PendingHello], MemoryObjectReceiveStream[PendingHello]
        ] = anyio.create_memory_object_stream[PendingHello](max_buffer_size=float("inf"))
        self.dispatcher: Dispatcher | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._drain_requested = anyio.Event()
        #: Held by the request thread while it handles messages, and by the event
        #: loop around anything that reads or changes the dispatcher or engines.
        self._lock = threading.Lock()
        #: Frames (routing id first) the loop wants sent; the request thread sends them.
        self._outbox: collections.deque[list[bytes]] = collections.deque()
        #: Batch runs whose promoted operation ran, for the request thread to go on with.
        self._resumed: collections.deque[tuple[bytes, BatchRun]] = collections.deque()
        #: The loop's DEALER to the ROUTER (inproc), and the routing id it has there.
        self._wake: zmq.Socket[bytes] | None = None
        self._loop_id = b"\xffkvd-loop-" + secrets.token_bytes(16)
        self._thread_error: BaseException | None = None
        #: Engine events by pool, queued under the lock, moved to the channels by the loop.
        self._events: collections.deque[tuple[str, list[Any]]] = collections.deque()
        server = config.server
        #: The ROUTER's connections (its monitor's events) and which to shut down.
        self._watch = transport.ConnectionWatch(
            hello_timeout_s=server.hello_timeout_ms / 1e3,
            memory_budget=server.memory_guard_bytes,
        )
        self._monitor: zmq.Socket[bytes] | None = None
        #: Reply bytes libzmq holds per peer (the request thread's).
        self._replies = transport.ReplyQueues(server.max_queued_reply_bytes)
        #: Messages the request thread took (the loop trims memory when it stands still).
        self._handled = 0
        #: Tcp hellos waiting for their peer's pid (None: no tcp endpoint, or no pid watch).
        self._tcp_hellos: TcpHellos | None = None

    # ------------------------------------------------------------------
    # Start

    async def _start(self) -> None:
        self._ctx = zmq.Context()
        for address in self.addresses:
            await anyio.to_thread.run_sync(
                transport.check_address, address, self.config.server, self._ctx
            )
        # No live daemon answers at our address: any segment of our instance is stale.
        stale = await anyio.to_thread.run_sync(
            lambda: remove_stale_segments(self.instance, shm_dir=self.config.memory.shm_dir)
        )
        if stale:
            log.warning("stale_segments_removed", paths=stale)
        await anyio.to_thread.run_sync(self.pools.check_budget)
        for pool in self.config.pools:
            t0 = time.perf_counter()
            served = await anyio.to_thread.run_sync(self.pools.create, pool)
            self.pools.add(served)
            memory = served.memory
            log.info(
                "pool_ready",
                pool=pool.name,
                backend=pool.backend,
                blocks=pool.num_blocks,
                bytes=memory.size,
                startup_ms=round((time.perf_counter() - t0) * 1e3, 1),
                **{k: v for k, v in memory.info().items() if k.endswith("_ms") or k == "path"},
            )
        curve = None
        if any(wire.ipc_path(a) is None for a in self.addresses):
            server = self.config.server
            curve = load_server_keys(server.curve_secret_key_file)
            # The handler goes in before the CURVE endpoint: without one libzmq admits anyone.
            self._zap = ZapHandler(self._ctx, load_client_keys(server.curve_clients_dir))
        self._sock = await anyio.to_thread.run_sync(
            transport.bind_router, self._ctx, self.addresses, self.config.server, curve
        )
        # Tracked sends (the reply probes) must be zero-copy: a copied frame's tracker
        # is done at once. Plain sends copy as before.
        self._sock.copy_threshold = 0
        # Every accepted connection from the first on (the watch knows its descriptor).
        self._monitor = self._sock.get_monitor_socket(transport.MONITOR_EVENTS)
        # Only socket files this daemon bound are unlinked at exit: a failed
        # start must never remove a live daemon's socket.
        self._bound = [p for a in self.addresses if (p := wire.ipc_path(a)) is not None]

    def _start_events(self) -> tuple[KVEventPublisher, dict[str, EventChannel]]:
        ev = self.config.events
        try:
            publisher = KVEventPublisher(
                ev.endpoint,
                replay_endpoint=ev.replay_endpoint or None,
                buffer=ev.buffer,
                context=self._ctx,
            )
        except zmq.ZMQError as exc:
            raise StartupError(
                f"cannot publish KV events on {ev.endpoint}: {zmq.strerror(exc.errno or 0)}"
            ) from None
        self._publisher = publisher
        channels = {pool.name: self._channel(publisher, pool.config) for pool in self.pools}
        return publisher, channels

    def _channel(self, publisher: KVEventPublisher, pool: PoolConfig) -> EventChannel:
        medium = MEDIUM_GPU if pool.backend == "cuda" else MEDIUM_CPU
        return publisher.channel(self.config.events.topic.format(pool=pool.name), medium)

    def _cleanup(self, linger_ms: int) -> None:
        """Close the socket, unlink its file, release every pool. Idempotent, blocking."""
        if self._publisher is not None:  # a failed start: nothing left to send
            self._publisher.close()
            self._publisher = None
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None
        if self._sock is not None:
            self._sock.close(linger_ms)
            self._sock = None
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        while self._bound:
            self._bound.pop().unlink(missing_ok=True)
        self.pools.close()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------------
    # Run

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Start, serve until stopped, clean up. Raises StartupError/PoolTooLargeError."""
        cfg = self.config
        log.info("starting", address=self.addresses[0], pools=[p.name for p in cfg.pools])
        notifier = Notifier.from_env()
        linger_ms = 0
        try:
            await self._start()
            before, after = raise_nofile_limit()
            if after != before:
                log.info("nofile_limit_raised", before=before, after=after)
            sessions = SessionTable(cfg.server.lease_ms / 1e3, descriptors=DescriptorBudget())
            metrics = None
            if cfg.metrics.enabled:
                metrics = self._start_metrics()
            publisher, channels = self._start_events() if cfg.events.enabled else (None, {})
            self._channels = channels
            self.dispatcher = Dispatcher(
                cfg,
                self.pools,
                sessions,
                epoch=self.epoch,
                addresses=self.addresses,
                on_events=(lambda pool, events: self._events.append((pool, events)))
                if publisher is not None
                else None,
                observe=metrics.observe if metrics is not None else None,
            )
            if publisher is not None:
                self.dispatcher.info.sections["events"] = publisher.stats
            if self._zap is not None:
                self.dispatcher.info.sections["security"] = self._zap.stats
                if cfg.server.tcp_pid_watch:
                    self._tcp_hellos = TcpHellos(self.dispatcher, self._lock)
            self.dispatcher.info.sections["transport"] = functools.partial(
                transport.transport_stats, self._watch, self._replies
            )
            # The handlers go in before the socket is served: a signal sent as soon
            # as the daemon answers (or says READY=1) must never meet the default
            # action (SIGHUP's is to terminate).
            with contextlib.ExitStack() as stack:
                signals = (
                    stack.enter_context(
                        anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
                    )
                    if self._handle_signals
                    else None
                )
                await self._serve_all(notifier, publisher, signals, task_status)
            linger_ms = 200 if self.dispatcher.state.draining else 0
            if publisher is not None:
                publisher.close()
                self._publisher = None
            if metrics is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(metrics.close)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._cleanup, linger_ms)
            notifier.close()
            log.info("stopped", epoch=self.epoch)

    async def _serve_all(
        self,
        notifier: Notifier,
        publisher: KVEventPublisher | None,
        signals: AsyncIterator[signal.Signals] | None,
        task_status: anyio.abc.TaskStatus[Daemon],
    ) -> None:
        """The root task group: serve until a drain ends or `stop_now`."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            assert self._monitor is not None and self.dispatcher is not None
            if self._freezer is not None:  # first: nothing else runs while it freezes
                await tg.start(self._freezer.run)
                self.dispatcher.info.sections["gc"] = self._freezer.stats
            tg.start_soon(self._serve)
            if publisher is not None:
                tg.start_soon(self._move_events)
                tg.start_soon(publisher.run)
            tg.start_soon(self._maintain)
            tg.start_soon(self.dispatcher.tiers.serve, self._lock, self._send, self._resume)
            tg.start_soon(
                guard_connections,
                self._monitor,
                self._watch,
                self._replies,
                self._nudge,
                self.config.server.hello_timeout_ms,
            )
            if self._tcp_hellos is not None:  # a tcp endpoint: its hellos wait for a pid
                tg.start_soon(self._tcp_hellos.serve, self._send, self._pending[0].send_nowait)
            tg.start_soon(self._create_runtime_pools, self._pending[1])
            if self._zap is not None:
                tg.start_soon(self._zap.serve)
            if signals is not None:
                tg.start_soon(self._signals, notifier, signals)
            interval = notifier.watchdog_interval()
            if interval is not None:
                tg.start_soon(self._watchdog, notifier, interval)
            tg.start_soon(self._drain_when_asked, notifier)
            notifier.ready(status=self._status_line())
            log.info(
                "ready",
                address=self.addresses[0],
                addresses=self.addresses,
                epoch=self.epoch,
                pools=len(self.pools),
            )
            task_status.started(self)

    def _start_metrics(self) -> MetricsServer:
        try:
            return start_metrics_server(
                self.config.metrics.host,
                self.config.metrics.port,
                loop_snapshot(self._metrics_snapshot),
            )
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on {self.config.metrics.host}:{self.config.metrics.port}: "
                f"{exc.strerror} (set metrics.enabled = false or another metrics.port)"
            ) from None

    def _metrics_snapshot(self) -> dict[str, Any]:
        assert self.dispatcher is not None
        with self._lock:
            stats = self.dispatcher.info.stats()
        return snapshot_of(stats)

    def _status_line(self) -> str:
        assert self.dispatcher is not None
        with self._lock:
            stats = self.dispatcher.info.stats()
        used = sum(b["in_use"] for b in stats["blocks"].values())
        total = sum(b["total"] for b in stats["blocks"].values())
        return f"blocks in use {used}/{total}, {stats['clients']['sessions']} clients"

    def stop(self) -> None:
        """Begin a graceful drain (as SIGTERM does)."""
        self._drain_requested.set()

    def stop_now(self) -> None:
        """Stop at once (as a second signal does)."""
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    async def _serve(self) -> None:
        """Run the request thread until cancelled, then stop it and wait for it."""
        assert self._ctx is not None and self._sock is not None
        # The loop's own connection to the ROUTER: its wake-ups arrive in the same
        # queue as requests, so the thread blocks in one receive (no poll).
        endpoint = f"inproc://kvd-loop-{id(self)}"
        self._sock.bind(endpoint)
        wake: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        wake.setsockopt(zmq.LINGER, 0)
        wake.setsockopt(zmq.SNDHWM, 0)
        wake.setsockopt(zmq.ROUTING_ID, self._loop_id)
        wake.connect(endpoint)
        self._wake = wake
        token = anyio.lowlevel.current_token()
        thread = threading.Thread(
            target=self._request_thread, args=(token,), name="kvd-requests", daemon=True
        )
        thread.start()
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                wake.send(b"stop")
                await anyio.to_thread.run_sync(thread.join)
                self._wake = None
                wake.close(0)
            if self._thread_error is not None:
                raise self._thread_error

    def _request_thread(self, token: anyio.lowlevel.EventLoopToken) -> None:
        """Serve the ROUTER socket: blocking receive, handle, reply.

        The only thread that touches the socket once serving. A bug here stops
        the daemon (the error is raised again by `_serve`).
        """
        try:
            self._request_loop(token)
        except BaseException as exc:
            self._thread_error = exc
            anyio.from_thread.run_sync(self.stop_now, token=token)

    def _request_loop(self, token: anyio.lowlevel.EventLoopToken) -> None:
        sock = self._sock
        dispatcher = self.dispatcher
        assert sock is not None and dispatcher is not None
        handle = dispatcher.handle_sliced
        lock = self._lock
        outbox = self._outbox
        resumed = self._resumed
        loop_id = self._loop_id
        # Long batches being run a slice at a time, oldest first: one slice between
        # any two messages, so no connection waits for another's whole batch.
        runs: collections.deque[tuple[bytes, BatchRun]] = collections.deque()

        def step(finish: bytes | None = None) -> None:
            """The next slice of the oldest run; ``finish``: all of that peer's run
            (up to an operation that waits for a promotion: the run leaves ``runs``
            until the loop hands it back)."""
            for _ in range(len(runs)):
                peer_id, run = runs.popleft()
                if finish is None or peer_id == finish:
                    with lock:
                        reply = run.step()
                        while finish is not None and reply is None and not run.paused:
                            reply = run.step()
                    if reply is not None:
                        deliver(sock, peer_id, reply)
                    elif not run.paused:
                        runs.append((peer_id, run))
                    if finish is None:
                        return
                else:
                    runs.append((peer_id, run))

        # The Cython socket's own send and recv: zmq.Socket.send is a Python wrapper
        # around it, and Socket.get(RCVMORE) builds a SocketOption enum per call
        # (~1 µs); a received Frame carries its ``more`` flag.
        recv = zmq.backend.Socket.recv
        noblock = _NOBLOCK
        # Kinds whose connection's identity matters: HELLO (namespace policy, pid
        # watch) and, once security.admins is set, the admin kinds (else FLUSH
        # under enforced namespaces).
        vetted = {bytes((wire.Kind.HELLO,))}
        if dispatcher.policy.admins:
            vetted |= {bytes((k,)) for k, cls in wire.REQUESTS.items() if cls.ADMIN}
        elif dispatcher.policy.enforce:  # a tenant flushes only its own namespaces
            vetted.add(bytes((wire.Kind.FLUSH,)))
        curve = self._zap is not None
        tcp_hellos = self._tcp_hellos
        hello = bytes((wire.Kind.HELLO,))
        watch = self._watch
        heard, note = watch.heard, watch.note
        srcfd = int(zmq.SRCFD)
        deliver = self._deliver
        copy_max = _COPY_BODY_MAX
        while True:
            if runs:
                step()
            if runs or watch.asking:
                # A look before blocking (a failed one costs ~6 µs, so only when it
                # tells something): whether a slice is due, and for the memory guard
                # that all that was queued is heard.
                try:
                    ident = frame = recv(sock, noblock, False)
                except zmq.Again:
                    watch.drained = watch.tick
                    if runs:  # nothing else waits: the next slice
                        continue
                    watch.waiting = True
                    ident = frame = recv(sock, 0, False)
                    watch.waiting = False
            else:
                # Blocking: requests and the loop's wake-ups come through this one queue.
                ident = frame = recv(sock, 0, False)
            frames: list[bytes] = []
            while frame.more:
                frame = recv(sock, 0, False)
                if len(frames) == 1 and len(frame) > copy_max:
                    # A large body is read in place (the decoder takes a view): a
                    # refused 32 MB bomb costs libzmq's buffer only, not a copy too.
                    frames.append(typing.cast(bytes, frame.buffer))
                else:
                    frames.append(frame.bytes)
            identity = ident.bytes
            if not frames:  # a ROUTER always has a frame after the routing id; be safe
                continue
            if identity == loop_id:
                if frames[0] == b"stop":  # long batches are answered before stopping
                    for peer_id, _ in list(runs):
                        step(peer_id)
                with lock:
                    if frames[0] == b"stop":
                        transport.refuse_queued(sock, dispatcher.refuse_shutting_down)
                        return
                    while outbox:
                        queued = outbox.popleft()
                        deliver(sock, queued[0], queued[1:])
                while resumed:
                    runs.append(resumed.popleft())
                continue
            # The connection spoke: a complete message (the memory guard's test).
            fd = ident.get(srcfd)
            seen = heard.get(fd)
            if seen is None or seen.identity != identity:  # a new connection at fd
                seen = note(fd, identity)
            seen.tick = watch.tick
            self._handled += 1
            peer = user_id = None
            if frames[0] in vetted:
                # Kernel credentials of the connection (ipc only); see sessions.py.
                with contextlib.suppress(zmq.ZMQError):
                    peer = parse_peer_address(str(ident.get("Peer-Address")))
                if curve:  # the client's CURVE key, as the ZAP handler answered
                    with contextlib.suppress(zmq.ZMQError):
                        user_id = str(ident.get("User-Id")) or None
                if frames[0] == hello:
                    seen.hello = True
                    if peer is None and tcp_hellos is not None:
                        # tcp: its peer's pid is found first (tcp_hellos.py).
                        busy = tcp_hellos.offer(identity, frames, user_id, fd, token)
                        if busy is not None:  # queued ([]) or refused
                            if busy:
                                deliver(sock, identity, busy)
                            continue
            if runs:  # a peer's messages run in order: its own long batch first
                step(identity)
            with lock:
                reply = handle(identity, frames, peer, user_id)
            if isinstance(reply, BatchRun):  # a long batch: its slices take turns with others
                runs.append((identity, reply))
                continue
            if not reply:  # a hello waits for its pool: the loop's task creates it
                for job in dispatcher.take_pending():
                    anyio.from_thread.run_sync(self._pending[0].send_nowait, job, token=token)
                continue
            deliver(sock, identity, reply)

    def _deliver(self, sock: zmq.Socket[bytes], identity: bytes, reply: list[bytes]) -> None:
        """Send ``reply`` (request thread only); a peer past
        ``server.max_queued_reply_bytes`` loses it and its session."""
        if not self._replies.send(sock, identity, reply):
            self._close_unread(identity)

    def _close_unread(self, identity: bytes) -> None:
        """Close the session of a peer that does not read its replies (once)."""
        assert self.dispatcher is not None
        with self._lock:
            session = self.dispatcher.state.sessions.peek(identity)
            if session is not None:
                log.warning(
                    "replies_unread",
                    session=session.id,
                    client=session.name,
                    limit=self._replies.limit,
                    note="its replies are dropped until it reads them",
                )
                self.dispatcher.handshake.close(session, "replies_unread")

    # ------------------------------------------------------------------
    # Runtime pools

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        """Queue a reply for the request thread (the loop never touches the socket)."""
        if self._wake is not None:
            self._outbox.append([identity, *frames])
            self._nudge()

    def _resume(self, identity: bytes, run: BatchRun) -> None:
        """Hand a batch run whose promoted operation ran back to the request
        thread, which runs the rest in slices (loop only)."""
        if self._wake is not None:
            self._resumed.append((identity, run))
            self._nudge()

    def _nudge(self) -> None:
        """Wake the request thread (it sends what the outbox holds). Loop only."""
        if self._wake is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._wake.send(b"", zmq.NOBLOCK)

    async def _create_runtime_pools(self, jobs: MemoryObjectReceiveStream[PendingHello]) -> None:
        """Create the pools deferred hellos ask for, in order and one at a time; answer each."""
        dispatcher = self.dispatcher
        assert dispatcher is not None
        async for job in jobs:
            # Only this task adds pools once serving: a pool made for an earlier
            # hello is there, and this one attaches to it (or gets MISMATCH).
            refusal = None
            if job.config.name not in self.pools:
                refusal = await self._add_runtime_pool(job.config)
            with self._lock:
                frames = dispatcher.finish_hello(job, refusal)
            self._send(job.call.identity, frames)

    async def _add_runtime_pool(self, pool: PoolConfig) -> PoolRefusal | None:
        """Judge, create and serve ``pool``; the refusal when it is not made (nothing changed)."""
        t0 = time.perf_counter()
        # Not cancellable: memory once made must be served (and freed at exit).
        made = await anyio.to_thread.run_sync(self.pools.create_runtime, pool)
        if isinstance(made, PoolRefusal):
            with self._lock:
                self.pools.abandon(pool.name)
            return made
        if self._publisher is not None:
            self._channels[pool.name] = self._channel(self._publisher, pool)
        with self._lock:
            self.pools.add(made)
        log.info(
            "pool_created",
            pool=pool.name,
            backend=pool.backend,
            blocks=pool.num_blocks,
            bytes=made.memory.size,
            startup_ms=round((time.perf_counter() - t0) * 1e3, 1),
            runtime_pools=self.pools.runtime_count,
        )
        return None

    async def _maintain(self) -> None:
        dispatcher = self.dispatcher
        assert dispatcher is not None
        sessions = dispatcher.state.sessions
        handshake = dispatcher.handshake
        period = self.config.server.pid_watch_ms / 1e3
        seen, trimmed = self._handled, True
        while True:
            await anyio.sleep(period)
            # A period without messages after some: give the freed heap back (the
            # replies queued to peers that left, a burst's buffers).
            handled = self._handled
            if handled != seen:
                seen, trimmed = handled, False
            elif not trimmed:
                trimmed = True
                await anyio.to_thread.run_sync(transport.malloc_trim)
            with self._lock:
                for session in sessions.sweep_pids():
                    handshake.close(session, "pid_exited")
                for session in sessions.expired():
                    handshake.close(session, "lease_expired")
                handshake.release_quarantined()
                notices = dispatcher.info.pressure_notices()
            for identity, frames in notices:
                self._send(identity, frames)

    async def _move_events(self) -> None:
        """Hand the engines' events to their channels (the publisher is the loop's)."""
        events, delay = self._events, _EVENTS_INTERVAL
        while True:
            delay = _EVENTS_INTERVAL if events else min(2 * delay, _EVENTS_IDLE)
            while events:
                pool, batch = events.popleft()
                self._channels[pool].extend(batch)
            await anyio.sleep(delay)

    async def _watchdog(self, notifier: Notifier, interval: float) -> None:
        while True:
            notifier.watchdog()
            notifier.status(self._status_line())
            await anyio.sleep(interval)

    async def _signals(self, notifier: Notifier, signals: AsyncIterator[signal.Signals]) -> None:
        async for signum in signals:
            if signum == signal.SIGHUP:
                self._reload_config(notifier)
            elif not self._drain_requested.is_set():
                log.info("signal", signal=signal.Signals(signum).name, action="drain")
                self._drain_requested.set()
            else:
                log.warning("signal", signal=signal.Signals(signum).name, action="exit_now")
                self.stop_now()

    def _reload_config(self, notifier: Notifier) -> None:
        if self._reload is None:
            log.info("reload_skipped", reason="no config file")
            return
        notifier.reloading()
        try:
            fresh = self._reload()
        except DaemonError as exc:
            log.error("reload_failed", error=str(exc), note="still serving with the old config")
        else:
            assert self.dispatcher is not None
            if fresh.log != self.config.log and self._on_log_config is not None:
                self._on_log_config(fresh)
            with self._lock:
                report = reload_config(self.dispatcher.state, fresh)
            self.config = report.config
            log.info(
                "reloaded",
                applied=report.applied,
                needs_restart=report.needs_restart,
                refused=report.refused,
            )
        notifier.ready(status=self._status_line())

    async def _drain_when_asked(self, notifier: Notifier) -> None:
        await self._drain_requested.wait()
        dispatcher = self.dispatcher
        assert dispatcher is not None
        with self._lock:
            dispatcher.state.draining = True
        timeout = self.config.server.drain_timeout_s
        notifier.stopping(status="draining")
        log.info("draining", in_flight=self._in_flight(), timeout_s=timeout)
        deadline = time.monotonic() + timeout
        while self._in_flight() and time.monotonic() < deadline:
            await anyio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        left = self._in_flight()
        log.info("drained" if not left else "drain_timeout", in_flight=left)
        self.stop_now()

    def _in_flight(self) -> int:
        assert self.dispatcher is not None
        with self._lock:
            return self.dispatcher.info.in_flight()
