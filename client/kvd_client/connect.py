"""The arguments of ``connect``, defined once for `Client` and `AsyncClient`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from kvd_client.core import Identity
from kvd_client.errors import InvalidRequest
from kvd_client.transport import CurveTriple
from kvd_client.wire import MAX_NAME_LEN, Notice, PoolLayout, default_address

__all__ = ["DEFAULT_TIMEOUT", "ConnectOptions", "Connection"]

#: Seconds to wait for the daemon before `DaemonUnavailable`.
DEFAULT_TIMEOUT = 5.0


class ConnectOptions(TypedDict, total=False):
    """The keyword options of `Client.connect` and `AsyncClient.connect` (see there)."""

    timeout: float
    layout: PoolLayout | None
    hash_seed: str | None
    on_notice: Callable[[Notice], None] | None
    create: bool
    backend: str | None
    device: int | None
    curve: CurveTriple | None


@dataclass(frozen=True, slots=True)
class Connection:
    """What both ``connect`` methods need, checked: the session's identity and the socket's."""

    identity: Identity
    address: str
    timeout: float
    on_notice: Callable[[Notice], None] | None
    curve: CurveTriple | None

    @classmethod
    def of(
        cls,
        address: str | None,
        pool: str | None,
        *,
        name: str | None,
        namespace: str,
        adapter: str | None,
        options: ConnectOptions,
    ) -> Connection:
        """Check the arguments of a ``connect`` (`InvalidRequest`) and apply the defaults."""
        layout = options.get("layout")
        create = options.get("create", False)
        backend = options.get("backend")
        device = options.get("device")
        if type(create) is not bool:
            raise InvalidRequest(f"create must be True or False, got {create!r}")
        if create and (pool is None or layout is None):
            raise InvalidRequest("create=True needs a pool name and its layout")
        if backend is not None and (type(backend) is not str or not backend):
            raise InvalidRequest(f"backend must be a non-empty string, got {backend!r}")
        if device is not None and (type(device) is not int or device < 0):
            raise InvalidRequest(f"device must be a GPU index >= 0, got {device!r}")
        if name is None:
            name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
        for what, value in (("pool", pool), ("name", name), ("adapter", adapter)):
            if value is not None and (type(value) is not str or not value):
                raise InvalidRequest(f"{what} must be a non-empty string, got {value!r}")
        if type(namespace) is not str or len(namespace) > MAX_NAME_LEN:
            raise InvalidRequest(f"namespace must be a string of at most {MAX_NAME_LEN} characters")
        hash_seed = options.get("hash_seed")
        identity = Identity(
            pool,
            name[:MAX_NAME_LEN],
            namespace,
            adapter,
            layout,
            hash_seed,
            create,
            backend,
            device,
        )
        return cls(
            identity,
            address or default_address(),
            options.get("timeout", DEFAULT_TIMEOUT),
            options.get("on_notice"),
            options.get("curve"),
        )
