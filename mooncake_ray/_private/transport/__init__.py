"""Python face of the native UCX transport (``native/src/transport``).

    from mooncake_ray._private.transport import Engine, Region, RemoteRegion, Handle

See :class:`Engine` for the API and ``engine.py`` for the read/write paths.
"""

from mooncake_ray._private.transport.engine import Engine, Handle, Peer, Region, RemoteRegion

__all__ = ["Engine", "Handle", "Peer", "Region", "RemoteRegion"]
