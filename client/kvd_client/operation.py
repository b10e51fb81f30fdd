"""The `operation` descriptor: a core generator exposed as a client method.

On an object bound to a `Client` the method blocks and returns the result;
on one bound to an `AsyncClient` it returns an awaitable of it. The
object's ``_run`` is its client's driver.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import MethodType
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from kvd_client.core import Op

if TYPE_CHECKING:
    from kvd_client.client import AsyncClient, Client, ClientBase

__all__ = ["Bound", "operation"]

T = TypeVar("T")
P = ParamSpec("P")
C = TypeVar("C", bound="ClientBase[Any]")


class Bound(Generic[C]):
    """An object whose operations run on the driver of client ``C``."""

    __slots__ = ()

    def _run(self, op: Op[Any]) -> Any:
        raise NotImplementedError


class operation(Generic[P, T]):
    """Expose a core generator as a method: blocking on a Client, awaitable on an AsyncClient."""

    def __init__(self, fn: Callable[Concatenate[Any, P], Op[T]]) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

        def call(obj: Any, *args: Any, **kwargs: Any) -> Any:
            return obj._run(fn(obj, *args, **kwargs))

        call.__name__ = call.__qualname__ = fn.__name__
        call.__doc__ = fn.__doc__
        # Bound per access as a method object (one C allocation; its __doc__ is call's).
        self._call = call

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, obj: Bound[Client], owner: type[Any]) -> Callable[P, T]: ...
    @overload
    def __get__(self, obj: Bound[AsyncClient], owner: type[Any]) -> Callable[P, Awaitable[T]]: ...
    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        return MethodType(self._call, obj)
