"""The transport engine as the rest of mooncake-ray sees it.

A thin layer over the native ``TransportEngine`` (``native/src/transport``): it turns
Python buffers into (address, length) pairs, runs Python RPC handlers on dispatcher
threads, and makes handles awaitable. Every blocking native call releases the GIL.

Read paths (see ``native/src/transport/rma.cpp``): ``memcpy`` when the remote region is
mapped into this process (same host, UCX shared memory, arenas allocated by UCX),
``push`` over tcp (the owner's engine puts the bytes into our registered buffer, in C++),
``get`` otherwise. ``RemoteRegion.read_path`` says which one a region uses.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mooncake_ray import errors
from mooncake_ray._private.native import _native
from mooncake_ray.config import TransportConfig, validated

__all__ = ["Engine", "Region", "RemoteRegion", "Peer", "Handle"]

RemoteRegion = _native.RemoteRegion
Peer = _native.Peer

# (remote region, remote offset, local address or a multi-range value's ranges, length)
TransferOp = tuple[Any, "int | Any", "int | tuple[tuple[int, int], ...] | Any", "int | Any"]  # Any: an array column

_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _buffer_of(buf: Any) -> tuple[int, int, bool, Any, memoryview | None]:
    """(address, length, is_cuda, object to keep alive, host memoryview or None)."""
    if isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(v, int) for v in buf):
        addr, length = buf
        if addr <= 0 or length <= 0:
            raise errors.InvalidArgumentError(f"bad (addr, length) pair: {buf!r}")
        return addr, length, False, None, None
    mod = type(buf).__module__ or ""
    if mod.startswith("torch") and hasattr(buf, "data_ptr"):
        if not buf.is_contiguous():
            raise errors.InvalidArgumentError("torch tensor must be contiguous")
        length = buf.numel() * buf.element_size()
        if length == 0:
            raise errors.InvalidArgumentError("cannot register an empty tensor")
        if buf.is_cuda:
            return buf.data_ptr(), length, True, buf, None
        if buf.device.type != "cpu":
            raise errors.InvalidArgumentError(f"unsupported torch device {buf.device}")
        return buf.data_ptr(), length, False, buf, None
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:  # cupy and friends (untested here: no GPU)
        if cai.get("strides") not in (None, ()):
            raise errors.InvalidArgumentError("CUDA array must be C-contiguous")
        n = 1
        for d in cai["shape"]:
            n *= d
        itemsize = int(cai["typestr"][2:])
        return int(cai["data"][0]), n * itemsize, True, buf, None
    try:
        mv = memoryview(buf)
    except TypeError:
        raise errors.InvalidArgumentError(
            f"cannot register {type(buf).__name__}: need a writable buffer, a torch tensor "
            "or an (addr, length) tuple"
        ) from None
    if mv.readonly:
        raise errors.InvalidArgumentError(f"{type(buf).__name__} buffer is read-only")
    if not mv.c_contiguous:
        raise errors.InvalidArgumentError("buffer must be C-contiguous")
    if mv.nbytes == 0:
        raise errors.InvalidArgumentError("cannot register an empty buffer")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mv))
    return addr, mv.nbytes, False, buf, mv


class Region:
    """Local memory registered with the engine (an arena or user memory).

    Attributes:
        addr: start address.
        length: size in bytes.
        rkey: packed remote key; a peer passes it to ``Engine.import_remote``.
    """

    __slots__ = ("_native", "_obj", "_mv", "_engine", "addr", "length", "rkey", "__weakref__")

    def __init__(self, native: Any, obj: Any, mv: memoryview | None, engine: Engine):
        self._native = native
        self._obj = obj  # kept alive for the life of this object, even after close()
        self._mv = mv
        self._engine = engine
        self.addr: int = native.addr
        self.length: int = native.length
        self.rkey: bytes = native.rkey

    @property
    def is_arena(self) -> bool:
        return self._native.is_arena

    @property
    def closed(self) -> bool:
        return self._native.closed

    def view(self) -> memoryview:
        """A writable memoryview of the whole region.

        Raises:
            NotRegisteredError: the region is closed.
        """
        if self._native.closed:
            raise errors.NotRegisteredError("region is closed")
        if self._mv is not None:
            return self._mv
        if self._obj is not None and hasattr(self._obj, "numpy"):  # torch CPU tensor
            return memoryview(self._obj.numpy()).cast("B")
        return memoryview(self._native.view())

    def close(self, wait_s: float = 10.0) -> None:
        """Deregisters. Transfers still in flight keep the memory registered until they end
        (up to ``wait_s`` is spent waiting for them). Afterwards any transfer naming this
        memory raises NotRegisteredError. Idempotent."""
        if not self._native.close(wait_s):
            self._engine._graveyard.append((self._native, self._obj))

    def __repr__(self) -> str:
        kind = "arena" if self.is_arena else "user"
        state = " closed" if self.closed else ""
        return f"<Region {kind} addr=0x{self.addr:x} length={self.length}{state}>"


class Handle:
    """Completion of an asynchronous transfer or call.

    ``done()`` polls, ``wait(timeout_s)`` blocks (GIL released), ``result()`` returns a
    call's reply, ``await handle`` works from asyncio without blocking the loop.
    """

    __slots__ = ("_h", "_is_call", "_result")

    def __init__(self, native_handle: Any, is_call: bool):
        self._h = native_handle
        self._is_call = is_call
        self._result: bytes | None = None

    def done(self) -> bool:
        return self._h.done()

    def wait(self, timeout_s: float | None = None) -> None:
        """Blocks until complete.

        Raises:
            TransferTimeoutError: not complete within ``timeout_s`` (the operation goes on;
                wait again or ``cancel()``).
            NodeUnavailableError, TransferError, RemoteHandlerError, ...: it failed.
        """
        self._h.wait(timeout_s)

    def result(self, timeout_s: float | None = None) -> bytes | None:
        """Waits, then returns the reply of a call (None for a transfer)."""
        self._h.wait(timeout_s)
        if not self._is_call:
            return None
        if self._result is None:
            self._result = self._h.take_result()
        return self._result

    def cancel(self) -> None:
        """Gives up: a late reply is dropped; a late transfer no longer copies into
        unregistered memory (registered memory may still be written until it ends)."""
        self._h.cancel()

    def __await__(self):
        if not self._h.done():
            import asyncio

            loop = asyncio.get_running_loop()
            yield from _notifier_for(loop).watch(self._h).__await__()
        return self.result(0)


class _LoopNotifier:
    """One eventfd per event loop; the native engine writes completion tokens to it."""

    def __init__(self, loop: Any):
        self._loop = weakref.ref(loop)  # the loop owns us (through its reader), not the reverse
        self._n = _native.Notifier()
        self._futs: dict[int, Any] = {}
        self._next = 0
        loop.add_reader(self._n.fd, self._ready)

    def watch(self, h: Any) -> Any:
        tok = self._next
        self._next += 1
        fut = self._loop().create_future()
        self._futs[tok] = fut
        h.set_notify(self._n, tok)
        return fut

    def _ready(self) -> None:
        for tok in self._n.drain():
            fut = self._futs.pop(tok, None)
            if fut is not None and not fut.done():
                fut.set_result(None)


_notifiers: weakref.WeakKeyDictionary[Any, _LoopNotifier] = weakref.WeakKeyDictionary()


def _notifier_for(loop: Any) -> _LoopNotifier:
    n = _notifiers.get(loop)
    if n is None:
        n = _notifiers[loop] = _LoopNotifier(loop)
    return n


# The settings carried into the C++ engine: every TransportConfig field that names an
# EngineConfig field, except server_linger_us (None there: resolved per role).
_NATIVE_FIELDS = tuple(f for f in TransportConfig.model_fields
                       if f != "server_linger_us" and hasattr(_native.EngineConfig, f))


class Engine:
    """A UCX engine: registered memory, one-sided reads/writes, RPC.

    Every method may be called from any thread. Blocking methods release the GIL.

    ``Engine.from_config(cfg, name)`` makes one from a ``TransportConfig``; the keyword
    form takes the same settings one by one, e.g. ``Engine(protocol="tcp", devices=["lo"],
    read_mode="push", name="bench")``, those not given keeping TransportConfig's defaults.
    Each setting's default and meaning: ``mooncake_ray/config.py``, ``TransportConfig``.

    Args:
        protocol, devices, num_lanes, ucx_options: as in TransportConfig (positional too).
        name: shown in errors and in peers' views of this engine.
        serve_linger_us: TransportConfig's ``server_linger_us`` for this engine (a server's;
            not given: the engine does not linger after serving).
        **settings: any other TransportConfig field (read_mode, chunk_bytes, spin_us, ...).

    Raises:
        ConfigError: a setting is invalid or UCX rejects it.
    """

    def __init__(
        self,
        protocol: str | None = None,
        devices: Sequence[str] | str | None = None,
        num_lanes: int | None = None,
        ucx_options: dict[str, Any] | None = None,
        name: str = "client",
        *,
        serve_linger_us: int | None = None,
        **settings: Any,
    ):
        given = {"protocol": protocol, "devices": devices, "num_lanes": num_lanes,
                 "ucx_options": ucx_options, "server_linger_us": serve_linger_us}
        settings.update((k, v) for k, v in given.items() if v is not None)
        if settings.get("ucx_options"):
            settings["ucx_options"] = {str(k): str(v) for k, v in settings["ucx_options"].items()}
        cfg = validated(TransportConfig, settings)
        self._open(cfg, name, cfg.server_linger_us)

    @classmethod
    def from_config(cls, cfg: TransportConfig, name: str = "client", *, server: bool = False,
                    **overrides: Any) -> Engine:
        """An engine with the settings of ``cfg`` (``overrides``: fields to change, e.g.
        ``num_lanes=1``). ``server``: the engine of a master or store node, whose progress
        threads linger after serving (``cfg.linger_us()``); a client's never do."""
        if overrides:
            cfg = validated(TransportConfig, {**cfg.model_dump(), **overrides})
        eng = cls.__new__(cls)
        eng._open(cfg, name, cfg.linger_us() if server else None)
        return eng

    def _open(self, cfg: TransportConfig, name: str, server_linger_us: int | None) -> None:
        native_cfg = _native.EngineConfig()
        native_cfg.name = name
        for field in _NATIVE_FIELDS:
            setattr(native_cfg, field, getattr(cfg, field))
        if server_linger_us is not None:
            native_cfg.server_linger_us = server_linger_us
        self.name = name
        self.protocol = cfg.protocol
        self.default_timeout_s = cfg.default_timeout_s
        self._native = _native.TransportEngine(native_cfg)
        self._rpc_threads = cfg.rpc_threads
        self._handlers: dict[int, Callable[[bytes], bytes]] = {}
        self._dispatchers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._graveyard: list[Any] = []  # regions closed with transfers in flight
        _live_engines.add(self)

    # ---- identity -------------------------------------------------------------------
    @property
    def address(self) -> bytes:
        """Everything a peer needs to connect (all lanes' worker addresses)."""
        return self._native.address

    @property
    def uid(self) -> int:
        return self._native.uid

    @property
    def num_lanes(self) -> int:
        return self._native.num_lanes

    @property
    def closed(self) -> bool:
        return self._native.closed

    # ---- memory ---------------------------------------------------------------------
    def alloc_arena(self, size: int) -> Region:
        """Allocates ``size`` bytes through UCX (shareable with same-host peers, which
        then read it with a plain memcpy), pre-faulted.

        Raises:
            InvalidArgumentError: size <= 0. EngineClosedError.
        """
        if size <= 0:
            raise errors.InvalidArgumentError(f"arena size must be > 0, got {size}")
        return Region(self._native.alloc_arena(int(size)), None, None, self)

    def register(self, buf: Any, cuda: bool = False) -> Region:
        """Registers user memory for zero-copy transfers: a writable buffer (bytearray,
        numpy, memoryview), a torch tensor, a CUDA array or an (addr, length) tuple
        (``cuda=True``: device memory). Keeps a reference to ``buf`` while the Region lives.
        Device memory needs ``"cuda"`` in ``memory_types``.

        Raises:
            InvalidArgumentError: read-only, non-contiguous or empty buffer; device memory
                UCX cannot register.
        """
        addr, length, is_cuda, obj, mv = _buffer_of(buf)
        return Region(self._native.register_memory(addr, length, is_cuda or cuda), obj, mv, self)

    @property
    def memory_types(self) -> list[str]:
        """Memory types UCX registers in this engine: ``host``, plus ``cuda`` where a UCX
        with CUDA transports found a GPU (then device memory is registered directly)."""
        return list(self._native.memory_types)

    def unregister(self, region: Region) -> None:
        """Same as ``region.close()``."""
        region.close()

    # ---- peers ----------------------------------------------------------------------
    def connect(self, address: bytes, timeout_s: float | None = None) -> Peer:
        """Endpoint to the engine at ``address`` (cached; a dead peer is evicted and the
        next connect makes a new one). Safe to retry.

        Raises:
            NodeUnavailableError: the peer does not answer within the timeout.
            InvalidArgumentError: not an engine address.
        """
        t = self.default_timeout_s if timeout_s is None else timeout_s
        return self._native.connect(bytes(address), float(t))

    def import_remote(self, peer: Peer, rkey: bytes, base: int, length: int, map_path: str = "",
                      map_offset: int = 0, populate: bool = True) -> RemoteRegion:
        """A remote region [base, base+length) under ``rkey`` (cached per peer).

        ``map_path``: the file on this host that holds the remote memory (a store node's
        arena kept in named shared memory, ``store/arena.py``; the caller checks it is the
        owner's), ``map_offset`` the file offset of ``base``. Used only where UCX cannot map
        the memory itself; reads and writes are then plain copies, as for UCX's own.
        ``populate``: fill this process's page tables for a same-host mapping now (false:
        at each page's first touch; for a few writes into a large region).

        Raises:
            NotRegisteredError: the key cannot be unpacked. NodeUnavailableError.
        """
        return self._native.import_remote(peer, bytes(rkey), int(base), int(length), map_path, int(map_offset),
                                          bool(populate))

    # ---- transfers ------------------------------------------------------------------
    def write(self, ops: Iterable[TransferOp], timeout_s: float | None = None) -> None:
        """Writes local bytes into remote regions: ops are (rr, remote_offset, local_addr,
        length), local_addr an address or a multi-range value's ((address, length), ...)
        (one op per range, contiguous in the remote region, up to length bytes). An op may
        also give remote_offset, local_addr and length as 1-D arrays of 64-bit ints (numpy
        uint64 or int64, C-contiguous, of one length; an int repeats for every row): one op
        per row, read without a Python object per row (a block table's ranges built with
        numpy). Completes when the bytes are visible at the target. Idempotent.

        Raises:
            NotRegisteredError: a remote range outside its RemoteRegion or a local range in
                a closed Region (checked before anything is sent).
            InvalidArgumentError: an op of another shape, or an array column that is not
                1-D, contiguous, of 64-bit ints, as long as the others and non-negative
                (the op and the fault named in the message).
            TransferTimeoutError, NodeUnavailableError, TransferError.
        """
        t = self.default_timeout_s if timeout_s is None else timeout_s
        self._native.transfer(ops, False, t)

    def write_checksummed(self, ops: Iterable[TransferOp], timeout_s: float | None = None) -> list[int | None]:
        """``write``, returning per op the CRC-32C of the bytes written where this process
        copied them itself (a peer's arena mapped on this host, a gathered staging piece):
        the checksum is taken in the copy, each piece of the source read once. None where
        UCX moved the bytes (over the network, from device memory); 0 for an op of no bytes.
        Same errors as ``write``."""
        t = self.default_timeout_s if timeout_s is None else timeout_s
        return self._native.write_checksummed(ops, t)

    def read(self, ops: Iterable[TransferOp], timeout_s: float | None = None) -> None:
        """Reads remote bytes into local memory; same ops and errors as ``write``."""
        t = self.default_timeout_s if timeout_s is None else timeout_s
        self._native.transfer(ops, True, t)

    def write_async(self, ops: Iterable[TransferOp]) -> Handle:
        """Starts a write; local memory must stay valid until the handle completes."""
        return Handle(self._native.transfer_async(ops, False), False)

    def read_async(self, ops: Iterable[TransferOp]) -> Handle:
        """Starts a read; local memory must stay valid until the handle completes."""
        return Handle(self._native.transfer_async(ops, True), False)

    # ---- RPC ------------------------------------------------------------------------
    def serve(self, handler_id: int, fn: Callable[[bytes], bytes], inline: bool = False) -> None:
        """Serves ``fn(payload) -> bytes`` under ``handler_id``. It runs on a dispatcher
        thread (never the progress thread) holding the GIL only for the call, so it may
        itself make engine calls. An exception reaches the caller as RemoteHandlerError.

        ``inline=True`` runs it on the progress thread instead (one thread hand-off less
        per call, ~10 µs here): only for handlers that make no engine calls and never wait
        on a thread that does."""
        if not callable(fn):
            raise errors.InvalidArgumentError("handler must be callable")
        if inline:
            with self._lock:
                self._handlers.pop(int(handler_id), None)
                self._native.serve_inline(int(handler_id), fn)
            return
        with self._lock:
            self._handlers[int(handler_id)] = fn
            self._native.serve_external(int(handler_id))
            while len(self._dispatchers) < self._rpc_threads:
                t = threading.Thread(
                    target=self._dispatch_loop, name=f"mcr-rpc-{self.name}-{len(self._dispatchers)}",
                    daemon=True,
                )
                t.start()
                self._dispatchers.append(t)

    def serve_master(self, handler_id: int, index, fn: Callable[[bytes], bytes], hold_commits: bool = False) -> None:
        """Serves the master's RPC: ``index`` (a native ``MasterIndex``) answers the calls
        it can in C++, ``fn`` the rest, inline on the progress thread (see ``serve``).
        ``hold_commits``: the replies to the commits the index answers are logged in it,
        not sent; the master sends them with ``reply`` once they are durable."""
        with self._lock:
            self._handlers.pop(int(handler_id), None)
            self._native.serve_master(int(handler_id), index, fn, hold_commits)

    def hold_request(self) -> tuple | None:
        """Inside an inline handler: keep the request being served, to answer it later
        with ``reply`` (what the handler returns is then not sent). Returns the reply
        token, or None when called outside a handler."""
        return self._native.hold_request()

    def reply(self, token: tuple, data: bytes) -> None:
        """Answers a request kept by ``hold_request`` (or logged by the master's index),
        from any thread. A caller that has gone away is skipped."""
        self._native.reply(token, 0, data)

    def serve_echo(self, handler_id: int) -> None:
        """Serves a built-in C++ echo handler (runs on the progress thread; benchmarks)."""
        self._native.serve_echo(int(handler_id))

    def unserve(self, handler_id: int) -> None:
        with self._lock:
            self._handlers.pop(int(handler_id), None)
            self._native.unserve(int(handler_id))

    def call(self, peer: Peer, handler_id: int, payload: bytes, timeout_s: float | None = None) -> bytes:
        """Calls ``handler_id`` on ``peer`` and returns its reply. Not retried: whether a
        retry is safe depends on the handler.

        Raises:
            RemoteHandlerError: the handler raised, or no handler has that id.
            TransferTimeoutError: no reply within the timeout (a late reply is dropped).
            NodeUnavailableError: the peer is dead or unreachable.
        """
        t = self.default_timeout_s if timeout_s is None else timeout_s
        return self._native.call(peer, int(handler_id), payload, t)

    def call_async(self, peer: Peer, handler_id: int, payload: bytes) -> Handle:
        """Starts a call; ``handle.result()`` returns the reply."""
        return Handle(self._native.call_async(peer, int(handler_id), payload), True)

    def call_many(
        self, calls: Iterable[tuple[Peer, int, bytes]], timeout_s: float | None = None
    ) -> list[bytes | Exception]:
        """Issues all calls at once; returns each reply or the exception it raised."""
        t = self.default_timeout_s if timeout_s is None else timeout_s
        return self._native.call_many(list(calls), t)

    def _dispatch_loop(self) -> None:
        nat = self._native
        while True:
            req = nat.next_request(None)
            if req is None:
                return  # engine closed
            token, hid, payload = req
            fn = self._handlers.get(hid)
            try:
                if fn is None:
                    nat.reply(token, 204, f"no handler registered for id {hid}".encode())
                    continue
                out = fn(payload)
                nat.reply(token, 0, b"" if out is None else out)
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
                try:
                    nat.reply(token, 203, f"{type(e).__name__}: {e}".encode(errors="replace"))
                except errors.MooncakeRayError:
                    pass

    # ---- misc -----------------------------------------------------------------------
    def set_auth_secret(self, secret: bytes) -> None:
        """Sets the cluster's shared secret (at least 16 bytes), before this engine connects
        or is connected to; it cannot be changed afterwards. Peers then authenticate each
        other in the handshake (both must hold the same secret) and every later message
        carries a session token; anything else is dropped (``stats()["auth_rejected"]``).

        Raises:
            InvalidArgumentError: the secret is too short, already set, or peers exist.
            AuthenticationError: (later, from ``connect``) a peer without this secret.
        """
        self._native.set_auth_secret(bytes(secret))

    def stats(self) -> dict[str, int]:
        """Counters: bytes per path (read_memcpy/get/push, write_memcpy/put, staged), calls."""
        return dict(self._native.stats())

    def close(self) -> None:
        """Closes endpoints (peers see us as dead), fails pending operations with
        EngineClosedError, stops threads. Idempotent."""
        self._native.close()
        for t in self._dispatchers:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._graveyard.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Engine {self.name!r} protocol={self.protocol} lanes={self.num_lanes}>"


@atexit.register
def _close_all() -> None:
    for eng in list(_live_engines):
        try:
            eng.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
