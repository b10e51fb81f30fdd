"""The daemon shell: anyio + zmq around the engine and the pools' memory.

Only `kvd.cli` imports this package (an import-linter contract).
"""

from kvd.server.daemon import Daemon

__all__ = ["Daemon"]
