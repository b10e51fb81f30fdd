"""`Client` (blocking) and `AsyncClient` (anyio): one API, defined once.

Every operation is written once, as a generator of the sans-I/O core
(`kvd_client.core`), and exposed through the `operation` descriptor. The
descriptor's type depends on the client an object is bound to: on a
``Sequence[Client]`` ``seq.commit(n)`` returns the result, on a
``Sequence[AsyncClient]`` it returns an awaitable of it. So `Sequence`, `Pin`
and `Batch` are single classes parametrised by their client, and the two
clients share `ClientBase`; each client only adds its driver (``_run``),
``connect`` and closing::

    with Client.connect(pool="default") as kv:
        seq = kv.allocate("req-7", prompt, reserve=len(prompt) + 256)
        ...  # write KV of prompt[seq.num_cached_tokens:] into kv.pool views
        seq.commit()
        seq.append([next_token])
        seq.free()

    async with AsyncClient.connect(pool="default") as kv:
        seq = await kv.allocate("req-7", prompt)
        await seq.commit()

Sessions: any request renews the lease; an idle process keeps its session
because the daemon renews the leases of sessions whose pid is alive (same
host). `heartbeat()` renews it explicitly. After ``SESSION_LOST`` the call
raises `SessionLost`, every older `Sequence`/`Pin` raises it too, and the next
session call re-attaches (a new hello, requiring the same layout).

One request is in flight per client (a lock); a `Client` may be shared by
threads, an `AsyncClient` by tasks. Not fork-safe: connect after forking.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine, Generator, Iterable
from collections.abc import Sequence as PySequence
from types import TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    ParamSpec,
    Self,
    TypeVar,
    Unpack,
)

import anyio
import numpy as np
import numpy.typing as npt

from kvd_client.connect import Connection, ConnectOptions
from kvd_client.core import Admission, ClientSession, Deferred, Op, PinState, SeqState
from kvd_client.errors import InvalidRequest, KvdError
from kvd_client.operation import Bound, operation
from kvd_client.pool import PoolMapping
from kvd_client.transport import AsyncTransport, BlockingTransport
from kvd_client.wire import (
    CheckResult,
    CommitResult,
    GrantResult,
    LookupResult,
    Notice,
    PingResult,
    PoolLayout,
)

__all__ = [
    "AsyncClient",
    "Batch",
    "Client",
    "ClientBase",
    "Pin",
    "Sequence",
    "operation",
]

#: Goodbye waits at most this long: closing must not hang on a dead daemon.
_CLOSE_TIMEOUT = 1.0

T = TypeVar("T")
P = ParamSpec("P")
if TYPE_CHECKING:
    # PEP 696 default: a bare ``Sequence`` annotation means ``Sequence[Client]``.
    from typing_extensions import TypeVar as _TypeVarDefault

    C = _TypeVarDefault("C", bound="ClientBase[Any]", default="Client")
else:
    C = TypeVar("C", bound="ClientBase[Any]")
CL = TypeVar("CL", bound="ClientBase[Any]")


def _sequence(client: CL, op: Op[SeqState]) -> Op[Sequence[CL]]:
    return Sequence(client, (yield from op))


def _new_sequence(client: CL, session: ClientSession, op: Op[SeqState]) -> Op[Sequence[CL]]:
    """`_attached` and `_sequence` in one generator (allocate: one layer less per call)."""
    if session.info is None:
        yield from session.ensure()
    return Sequence(client, (yield from op))


def _pin(client: CL, op: Op[PinState]) -> Op[Pin[CL]]:
    return Pin(client, (yield from op))


def _attached(session: ClientSession, op: Op[T]) -> Op[T]:
    if session.info is None:  # the common case skips the generator of `ClientSession.ensure`
        yield from session.ensure()
    return (yield from op)


class Sequence(Bound[C]):
    """A request's tokens and block table, held by the client's session.

    ``block_table`` is a read-only int32 array of block ids, token ``i``
    lives in slot ``i % block_size`` of block ``block_table[i // block_size]``.
    After `SessionLost` every operation raises `SessionLost`; after `free`,
    `NotFound`.
    """

    __slots__ = ("_client", "_state")

    def __init__(self, client: C, state: SeqState) -> None:
        self._client = client
        self._state = state

    def _run(self, op: Op[Any]) -> Any:
        return self._client._run(op)

    @property
    def client(self) -> C:
        return self._client

    @property
    def seq_id(self) -> str:
        return self._state.seq_id

    @property
    def block_table(self) -> npt.NDArray[np.int32]:
        """Block ids in token order (read-only; replaced, never mutated, by operations)."""
        return self._state.table

    @property
    def num_tokens(self) -> int:
        return self._state.length

    @property
    def num_committed(self) -> int:
        """Tokens declared written by `commit`."""
        return self._state.committed

    @property
    def num_cached_tokens(self) -> int:
        """Leading tokens served from the prefix cache at allocation (their KV is there)."""
        return self._state.cached

    @property
    def alive(self) -> bool:
        """False once freed or once its session was lost."""
        return self._state.alive

    def slots(self, start: int = 0, stop: int | None = None) -> npt.NDArray[np.int64]:
        """Flat slot index ``block * block_size + offset`` of tokens ``start:stop``.

        The index into a layer's ``[2, num_blocks * block_size, heads, head_dim]``
        reshaping, as ``reshape_and_cache``-style kernels take it.
        """
        layout = self._state.session.layout
        assert layout is not None
        stop = self._state.length if stop is None else stop
        if not 0 <= start <= stop <= self._state.length:
            raise InvalidRequest(f"slots {start}:{stop} outside 0:{self._state.length}")
        bs = layout.block_size
        pos = np.arange(start, stop, dtype=np.int64)
        return self._state.table[pos // bs].astype(np.int64) * bs + pos % bs

    def __repr__(self) -> str:
        s = self._state
        state = "alive" if s.alive else "dead"
        return (
            f"<Sequence {s.seq_id!r} {state} tokens={s.length} blocks={len(s.table)} "
            f"committed={s.committed} cached={s.cached}>"
        )

    @operation
    def commit(self, n: int | None = None) -> Op[CommitResult]:
        """The first ``n`` tokens (all when None) are written; full blocks become cached."""
        return self._state.commit(n)

    @operation
    def append(self, tokens: npt.ArrayLike) -> Op[None]:
        """Grow by ``tokens``; copy-on-write copies are done on the pool before returning."""
        return self._state.append(tokens)

    @operation
    def fork(self, child_id: str, reserve: int | None = None) -> Op[Sequence[C]]:
        """A new sequence sharing every block (parallel sampling, beam search)."""
        return _sequence(self._client, self._state.fork(child_id, reserve))

    @operation
    def truncate(self, n: int) -> Op[None]:
        """Keep the first ``n`` tokens (roll back rejected speculative tokens)."""
        return self._state.truncate(n)

    @operation
    def free(self) -> Op[None]:
        """Release the sequence; its committed full blocks stay cached."""
        return self._state.free()

    @operation
    def pin(self, n: int | None = None) -> Op[Pin[C]]:
        """Pin the committed full blocks of the first ``n`` tokens against eviction."""
        return _pin(self._client, self._state.pin(n))


class Pin(Bound[C]):
    """A pinned prefix; counts against the session's quota until `unpin`."""

    __slots__ = ("_client", "_state")

    def __init__(self, client: C, state: PinState) -> None:
        self._client = client
        self._state = state

    def _run(self, op: Op[Any]) -> Any:
        return self._client._run(op)

    @property
    def pin_id(self) -> int:
        return self._state.pin_id

    @property
    def num_blocks(self) -> int:
        return self._state.blocks

    def __repr__(self) -> str:
        return f"<Pin {self._state.pin_id} blocks={self._state.blocks}>"

    @operation
    def unpin(self) -> Op[None]:
        """Release the pin."""
        return self._state.unpin()


class Batch(Bound[C]):
    """Operations of one scheduler step, sent in one round trip.

    Each method queues an operation (checking its arguments now; token ids
    are checked once, by the payload encoding, when the batch is sent) and
    returns a `Deferred` whose ``result()`` is available after `send`. Operations run
    in order on the daemon, each on its own: a refused one (e.g.
    `OutOfBlocks`) fails alone. ``with kv.batch() as b`` (``async with`` on an
    `AsyncClient`) sends on leaving the block unless it raised.
    """

    __slots__ = ("_client", "_generation", "_items", "_sent", "_session")

    def __init__(self, client: C, session: ClientSession) -> None:
        self._client = client
        self._session = session
        self._generation = session.generation
        self._items: list[Deferred[Any]] = []
        self._sent = False

    def _run(self, op: Op[Any]) -> Any:
        return self._client._run(op)

    def __len__(self) -> int:
        return len(self._items)

    def _add(self, op: Op[T]) -> Deferred[T]:
        if self._sent:
            op.close()
            raise InvalidRequest("this batch was already sent")
        item = Deferred(op)
        self._items.append(item)
        return item

    def _own(self, obj: Sequence[C] | Pin[C]) -> None:
        if obj._state.session is not self._session:
            raise InvalidRequest(f"{obj!r} belongs to another client")

    def allocate(
        self,
        seq_id: str,
        tokens: npt.ArrayLike,
        reserve: int | None = None,
        keys: PySequence[bytes] | None = None,
    ) -> Deferred[Sequence[C]]:
        op = self._session.allocate(seq_id, tokens, reserve, keys)
        return self._add(_sequence(self._client, op))

    def can_allocate(self, num_tokens: int, reserve: int | None = None) -> Deferred[Admission]:
        return self._add(self._session.can_allocate(num_tokens, reserve))

    def commit(self, seq: Sequence[C], n: int | None = None) -> Deferred[CommitResult]:
        self._own(seq)
        return self._add(seq._state.commit(n))

    def append(self, seq: Sequence[C], tokens: npt.ArrayLike) -> Deferred[None]:
        self._own(seq)
        return self._add(seq._state.append(tokens))

    def fork(
        self, seq: Sequence[C], child_id: str, reserve: int | None = None
    ) -> Deferred[Sequence[C]]:
        self._own(seq)
        return self._add(_sequence(self._client, seq._state.fork(child_id, reserve)))

    def truncate(self, seq: Sequence[C], n: int) -> Deferred[None]:
        self._own(seq)
        return self._add(seq._state.truncate(n))

    def free(self, seq: Sequence[C]) -> Deferred[None]:
        self._own(seq)
        return self._add(seq._state.free())

    def pin(self, seq: Sequence[C], n: int | None = None) -> Deferred[Pin[C]]:
        self._own(seq)
        return self._add(_pin(self._client, seq._state.pin(n)))

    def unpin(self, pin: Pin[C]) -> Deferred[None]:
        self._own(pin)
        return self._add(pin._state.unpin())

    def lookup(self, keys: PySequence[bytes], hold: bool = False) -> Deferred[LookupResult]:
        return self._add(self._session.lookup(keys, hold))

    def grant(self, n: int) -> Deferred[GrantResult]:
        return self._add(self._session.grant(n))

    def publish(
        self,
        hold: int,
        blocks: npt.ArrayLike,
        keys: PySequence[bytes],
        tokens: npt.ArrayLike,
        parent: bytes | None = None,
    ) -> Deferred[int]:
        return self._add(self._session.publish(hold, blocks, keys, tokens, parent))

    def release(self, hold: int, blocks: npt.ArrayLike | None = None) -> Deferred[int]:
        return self._add(self._session.release(hold, blocks))

    def _send(self) -> Op[list[Deferred[Any]]]:
        if self._sent:
            raise InvalidRequest("this batch was already sent")
        self._sent = True
        yield from self._session.run_batch(self._items, self._generation)
        return list(self._items)

    #: Send every queued operation; returns the `Deferred` items, in order.
    send = operation(_send)

    def __enter__(self) -> Self:
        if self._client.IS_ASYNC:
            raise TypeError("use 'async with' for a batch of an AsyncClient")
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if et is None:
            self._run(self._send())

    async def __aenter__(self) -> Self:
        if not self._client.IS_ASYNC:
            raise TypeError("use 'with' for a batch of a Client")
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if et is None:
            await self._run(self._send())


class ClientBase(Bound[C]):
    """Everything both clients share: state, properties and the operation list."""

    IS_ASYNC: ClassVar[bool]

    def __init__(self, session: ClientSession, address: str, timeout: float) -> None:
        self._session = session
        self._address = address
        self.timeout = timeout
        self._closed = False

    @property
    def _me(self) -> C:
        return self  # type: ignore[return-value]

    @property
    def address(self) -> str:
        """The address this client talks to."""
        return self._address

    @property
    def attached(self) -> bool:
        """Whether a session is open now (False after `SessionLost` until the next call)."""
        return self._session.attached

    @property
    def session_id(self) -> int | None:
        info = self._session.info
        return None if info is None else info.session

    @property
    def epoch(self) -> int | None:
        """The daemon's epoch at the last hello (changes when the daemon restarts)."""
        info = self._session.info
        return None if info is None else info.epoch

    @property
    def lease_ms(self) -> int | None:
        info = self._session.info
        return None if info is None else info.lease_ms

    @property
    def namespace(self) -> str:
        info = self._session.info
        return self._session.identity.namespace if info is None else info.namespace

    @property
    def layout(self) -> PoolLayout | None:
        """The pool's layout (None on an operator connection)."""
        return self._session.layout

    @property
    def pool(self) -> PoolMapping:
        """The pool's memory in this process (mapped once per process per pool)."""
        return self._session.pool()

    @property
    def on_notice(self) -> Callable[[Notice], None] | None:
        """Called with each daemon notice (pressure), after the call that received it."""
        return self._session.on_notice

    @on_notice.setter
    def on_notice(self, callback: Callable[[Notice], None] | None) -> None:
        self._session.on_notice = callback

    def batch(self) -> Batch[C]:
        """A builder of operations sent together in one round trip."""
        return Batch(self._me, self._session)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"session={self.session_id}"
        return f"<{type(self).__name__} {self._address} pool={self._session.identity.pool} {state}>"

    def _closing(self) -> Op[None]:
        if self._closed:
            return
        try:
            yield from self._session.goodbye()
        except KvdError:
            pass  # the daemon is gone or forgot us: there is nothing left to close there
        finally:
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequest("this client is closed")

    @operation
    def allocate(
        self,
        seq_id: str,
        tokens: npt.ArrayLike,
        reserve: int | None = None,
        keys: PySequence[bytes] | None = None,
    ) -> Op[Sequence[C]]:
        """Match the longest cached prefix of ``tokens``, allocate the rest.

        ``reserve=N`` guarantees room to grow to N tokens, or the allocation
        is refused now (`OutOfBlocks`, `QuotaExceeded`: nothing changed).
        ``keys``: the keys of every full block of ``tokens`` when the caller
        has them already (`block_keys`, or a frontend that hashes requests
        as vLLM's does); without them the client computes them.
        """
        s = self._session
        return _new_sequence(self._me, s, s.allocate(seq_id, tokens, reserve, keys))

    @operation
    def can_allocate(self, num_tokens: int, reserve: int | None = None) -> Op[Admission]:
        """Would ``allocate`` of ``num_tokens`` (reserving ``reserve``) be admitted now?"""
        s = self._session
        return _attached(s, s.can_allocate(num_tokens, reserve))

    def block_keys(
        self, tokens: npt.ArrayLike, parent: bytes | None = None, first_block: int = 0
    ) -> list[bytes]:
        """kvd's keys of the full blocks of ``tokens`` in this session's namespace
        and adapter (``parent``: the key before ``tokens[0]``, at block
        ``first_block``); `SessionLost` before the first hello."""
        return self._session.block_keys(tokens, parent, first_block)

    @operation
    def lookup(self, keys: PySequence[bytes], hold: bool = False) -> Op[LookupResult]:
        """How many leading ``keys`` are cached in this namespace (``cached``).

        ``hold=True`` also holds those blocks (``blocks``, ``hold``) so no
        eviction takes them until `release`; refused like an allocation
        (`OutOfBlocks`, `QuotaExceeded`) when they cannot be held.
        """
        s = self._session
        return _attached(s, s.lookup(keys, hold))

    @operation
    def grant(self, n: int) -> Op[GrantResult]:
        """Hold ``n`` fresh blocks (``blocks``, ``hold``) to write, then `publish`/`release`."""
        s = self._session
        return _attached(s, s.grant(n))

    @operation
    def publish(
        self,
        hold: int,
        blocks: npt.ArrayLike,
        keys: PySequence[bytes],
        tokens: npt.ArrayLike,
        parent: bytes | None = None,
    ) -> Op[int]:
        """Granted ``blocks`` of ``hold`` are written: cache them under ``keys``
        (``tokens``: their token ids; ``parent``: the key before the first)."""
        s = self._session
        return _attached(s, s.publish(hold, blocks, keys, tokens, parent))

    @operation
    def release(self, hold: int, blocks: npt.ArrayLike | None = None) -> Op[int]:
        """Let go of ``blocks`` of ``hold`` (all when None), a hold made by any
        session of this namespace; how many were released (0: it was gone)."""
        s = self._session
        return _attached(s, s.release(hold, blocks))

    @operation
    def heartbeat(self) -> Op[None]:
        """Renew the session's lease."""
        s = self._session
        return _attached(s, s.heartbeat())

    @operation
    def stats(self, sections: Iterable[str] | None = None) -> Op[dict[str, Any]]:
        """The daemon's statistics: ``{section: {key: value}}``."""
        return self._session.stats(sections)

    @operation
    def clients(self) -> Op[dict[str, Any]]:
        """The connected sessions."""
        return self._session.clients()

    @operation
    def pools(self) -> Op[dict[str, Any]]:
        """The pools, their layouts and usage."""
        return self._session.pools()

    @operation
    def check(self) -> Op[CheckResult]:
        """Run the daemon's invariant checks now."""
        return self._session.check()

    @operation
    def flush(self, namespace: str | None = None) -> Op[int]:
        """Drop every evictable cached block (of ``namespace``); returns how many."""
        return self._session.flush(namespace)

    @operation
    def ping(self) -> Op[PingResult]:
        """The daemon's epoch and protocol version."""
        return self._session.ping()


class Client(ClientBase["Client"]):
    """The blocking client."""

    IS_ASYNC = False

    def __init__(
        self, session: ClientSession, transport: BlockingTransport, timeout: float
    ) -> None:
        super().__init__(session, transport.address, timeout)
        self._transport = transport
        self._lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        address: str | None = None,
        pool: str | None = "default",
        name: str | None = None,
        namespace: str = "",
        adapter: str | None = None,
        **options: Unpack[ConnectOptions],
    ) -> Client:
        """Connect and open a session on ``pool`` (``pool=None``: operator requests only).

        ``address`` defaults to `default_address` (``$KVD_ADDRESS``); ``name``
        to the program's name; the keyword options are `ConnectOptions`
        (``timeout`` defaults to `DEFAULT_TIMEOUT`). ``layout``/``hash_seed``,
        when given, must match the daemon's (else `LayoutMismatch`).
        ``create=True`` (with ``layout``) makes the daemon create the pool for
        ``layout`` on ``backend``/``device`` when it has none of that name
        (`Forbidden` when the operator disabled runtime pools,
        `QuotaExceeded`/`OutOfBlocks` when the cap or the memory refuses it);
        a re-attach after a daemon restart creates it again.
        ``timeout`` must cover the pool's allocation. ``curve`` =
        ``(server_public, public, secret)`` (z85 keys) for a tcp endpoint,
        which the daemon serves only with CURVE. Raises `DaemonUnavailable`
        when nothing answers within ``timeout`` seconds (an unlisted CURVE key
        included: the daemon drops such connections without a word).
        """
        c = Connection.of(
            address, pool, name=name, namespace=namespace, adapter=adapter, options=options
        )
        transport = BlockingTransport(c.address, c.curve)
        client = cls(ClientSession(c.identity, c.on_notice), transport, c.timeout)
        if pool is not None:
            try:
                client._run(client._session.hello())
            except BaseException:
                transport.close()
                raise
        return client

    def _run(self, op: Op[T], timeout: float | None = None) -> T:
        session = self._session
        try:
            with self._lock:
                self._check_open()
                wait = self.timeout if timeout is None else timeout
                roundtrip, encode, accept = (
                    self._transport.roundtrip,
                    session.encode,
                    session.accept,
                )
                try:
                    out = op.send(None)  # type: ignore[arg-type]
                    while True:
                        try:
                            reply = roundtrip(encode(out), out.id, accept, wait)
                        except KvdError as exc:
                            out = op.throw(exc)
                        else:
                            out = op.send(reply)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                finally:
                    op.close()
        finally:
            session.deliver_notices()

    def close(self) -> None:
        """Say goodbye (best effort, briefly) and close the socket; idempotent."""
        if self._closed:
            return
        try:
            self._run(self._closing(), timeout=min(self.timeout, _CLOSE_TIMEOUT))
        finally:
            self._transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient(ClientBase["AsyncClient"]):
    """The anyio client (asyncio or trio); every operation is awaited."""

    IS_ASYNC = True

    def __init__(self, session: ClientSession, transport: AsyncTransport, timeout: float) -> None:
        super().__init__(session, transport.address, timeout)
        self._transport = transport
        self._lock = anyio.Lock(fast_acquire=True)

    @classmethod
    def connect(
        cls,
        address: str | None = None,
        pool: str | None = "default",
        name: str | None = None,
        namespace: str = "",
        adapter: str | None = None,
        **options: Unpack[ConnectOptions],
    ) -> _Connecting:
        """Like `Client.connect`; await it, or use it as ``async with``."""
        c = Connection.of(
            address, pool, name=name, namespace=namespace, adapter=adapter, options=options
        )

        async def make() -> AsyncClient:
            transport = AsyncTransport(c.address, c.curve)
            client = cls(ClientSession(c.identity, c.on_notice), transport, c.timeout)
            if pool is not None:
                try:
                    await client._run(client._session.hello())
                except BaseException:
                    transport.close()
                    raise
            return client

        return _Connecting(make)

    async def _run(self, op: Op[T], timeout: float | None = None) -> T:
        session = self._session
        try:
            async with self._lock:
                self._check_open()
                wait = self.timeout if timeout is None else timeout
                roundtrip, encode, accept = (
                    self._transport.roundtrip,
                    session.encode,
                    session.accept,
                )
                try:
                    out = op.send(None)  # type: ignore[arg-type]
                    while True:
                        try:
                            reply = await roundtrip(encode(out), out.id, accept, wait)
                        except KvdError as exc:
                            out = op.throw(exc)
                        else:
                            out = op.send(reply)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                finally:
                    op.close()
        finally:
            session.deliver_notices()

    async def aclose(self) -> None:
        """Say goodbye (best effort, briefly) and close the socket; idempotent."""
        if self._closed:
            return
        try:
            await self._run(self._closing(), timeout=min(self.timeout, _CLOSE_TIMEOUT))
        finally:
            self._transport.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class _Connecting:
    """``AsyncClient.connect(...)``: awaitable, and an async context manager."""

    __slots__ = ("_client", "_make")

    def __init__(self, make: Callable[[], Coroutine[Any, Any, AsyncClient]]) -> None:
        self._make = make
        self._client: AsyncClient | None = None

    def __await__(self) -> Generator[Any, None, AsyncClient]:
        return self._make().__await__()

    async def __aenter__(self) -> AsyncClient:
        self._client = await self._make()
        return self._client

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._client is not None:
            await self._client.aclose()
