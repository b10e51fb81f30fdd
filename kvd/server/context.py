"""What request handling shares: the server's state, and one message's call context.

`ServerState` is the one place the handlers find the running config (a
reload replaces it), the pools, the sessions and the counters. A `Call` is
one message being handled; a `SessionCall` is one whose connection has a
session, so its handlers read the session and its pool's engine without
checks.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvd_client import wire

from kvd.config import Config
from kvd.engine import Engine, Refusal
from kvd.server.pools import Pools
from kvd.server.security import Principal
from kvd.server.sessions import PeerCred, Session, SessionTable
from kvd.server.stats import RpcStats

__all__ = ["Call", "Outcome", "ServerState", "SessionCall"]

#: A handler's answer: a result map as it goes on the wire (the hot kinds build it
#: directly, same keys and order as their `wire.Result`'s ``to_map``), a `wire.Result`,
#: or an engine refusal.
Outcome = dict[str, Any] | wire.Result | Refusal


@dataclass(slots=True)
class ServerState:
    """The daemon's request-side state (read and changed under the request lock)."""

    config: Config
    pools: Pools
    sessions: SessionTable
    epoch: int
    addresses: list[str]
    clock: Callable[[], float] = time.monotonic
    rpc: RpcStats = field(init=False)
    started: float = field(init=False)
    #: A graceful drain is under way: kinds that start new work get SHUTTING_DOWN.
    draining: bool = False
    #: Sessions closed, by reason (goodbye, pid_exited, lease_expired, hello_again).
    closed_sessions: Counter[str] = field(default_factory=Counter)
    #: Sessions closed by lease expiry whose engine sessions (so their blocks) are
    #: kept until the deadline: (deadline, session), oldest first.
    quarantined: list[tuple[float, Session]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rpc = RpcStats(clock=self.clock)
        self.started = self.clock()


class Call:
    """One message being handled: who sent it and its extra frames."""

    __slots__ = ("extras", "identity", "peer", "user_id")

    def __init__(
        self,
        identity: bytes,
        peer: PeerCred | None,
        extras: Sequence[bytes],
        user_id: str | None = None,
    ) -> None:
        self.identity = identity
        #: The ipc connection's kernel credentials (None on tcp or when not read).
        self.peer = peer
        self.extras = extras
        #: The CURVE key (z85) of a tcp client (ZAP's User-Id); None on ipc.
        self.user_id = user_id

    @property
    def principal(self) -> Principal:
        """Who sent it, as far as the kernel or CURVE vouches."""
        return Principal.of(self.peer, self.user_id)


class SessionCall:
    """A message from a connection with a session: the session and its pool's engine."""

    __slots__ = ("defer", "engine", "extras", "identity", "session")

    def __init__(
        self, identity: bytes, extras: Sequence[bytes], session: Session, engine: Engine
    ) -> None:
        self.identity = identity
        self.extras = extras
        self.session = session
        self.engine = engine
        #: Whether its reply may wait for a tier promotion: not for an operation
        #: of a batch answered in one go (`Dispatcher.handle`'s batches).
        self.defer = True
