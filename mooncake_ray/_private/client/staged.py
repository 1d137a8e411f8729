"""Device memory in the client's calls: registering it on the path ``device.choose_path``
picks, routing each buffer of a call to that path, and the staged path itself.

The staged path (``Stager``) moves a batch through a pinned host buffer registered with
the transport, cut in two halves, group by group:

    put:  copy group 0 into half A | put A while group 1 is copied into B | put B while
          group 2 is copied into A | ...
    get:  get group 0 into A | copy A out while group 1 is read into B | copy B out while
          group 2 is read into A (after A's copies are done) | ...

Each half has a copy stream of its own per (memory kind, device): a CUDA stream for device
memory (cuMemcpyAsync), a copy thread for host memory standing in for one. Only the
transfers run in the caller's thread; copies run beside them. A group's copies are waited
for only before its half is reused. An item larger than a half goes alone through a
buffer of its own size.

Stagers are pooled per client: each call takes a free one (a new one if none is free),
so a load and a save on two threads never wait for each other's buffer. Each holds
``client.local_buffer_size_bytes`` of pinned memory.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from mooncake_ray import errors
from mooncake_ray._private import device
from mooncake_ray._private.buffers import RangeSet, readable, spans, writable
from mooncake_ray._private.native import _native

ALIGN = 64
MAX_STAGERS = 8
_PLAIN = (bytes, bytearray, memoryview, tuple, np.ndarray)
_TUPLE = {tuple}
_SLOW = object()  # _route_ranges: route this value range by range


@dataclass
class Staged:
    """One buffer of a call on the staged path: ``nbytes`` at ``addr`` of ``kind`` memory."""

    addr: int
    nbytes: int
    kind: str
    device: int
    keep: Any = None


class Registration:
    """A buffer registered on the staged or direct device path (``register_buffer``'s
    answer for device memory, and for host memory when staging is forced)."""

    __slots__ = ("addr", "length", "kind", "device", "path", "region", "keep", "closed")

    def __init__(self, addr, length, kind, dev, path, region, keep):
        self.addr, self.length, self.kind, self.device = addr, length, kind, dev
        self.path, self.region, self.keep, self.closed = path, region, keep, False

    @property
    def rkey(self) -> bytes | None:
        """The packed remote key (direct path only: staged memory is not registered with UCX)."""
        return None if self.region is None else self.region.rkey

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
        self.closed = True

    def __repr__(self) -> str:
        return f"<Registration {self.path} {self.kind}:{self.device} addr=0x{self.addr:x} length={self.length}>"


def stream_marker(after: Any, dev: int):
    """A marker in the stream whose queued work must finish before device memory is read:
    ``after`` (a CudaMarker, a stream handle, a torch or cupy stream), else the current
    stream of ``dev`` (torch's if it is loaded, else cupy's, else the legacy default)."""
    if not _native.cuda_available():
        return None
    if isinstance(after, _native.CudaMarker):
        return after
    handle = after if isinstance(after, int) else getattr(after, "cuda_stream", getattr(after, "ptr", None))
    if handle is None:
        torch = sys.modules.get("torch")
        cupy = sys.modules.get("cupy")
        if torch is not None and torch.cuda.is_initialized():
            handle = torch.cuda.current_stream(dev).cuda_stream
        elif cupy is not None:
            handle = cupy.cuda.get_current_stream().ptr
        else:
            handle = 0
    return _native.CudaMarker(dev, int(handle))


def device_marker(stream: Any = None, device_index: int = 0):
    """A point in a CUDA stream (default: the device's current stream) to pass as ``after``
    to ``put_from`` / ``batch_put_from``: the bytes are read once the work queued on that
    stream before this call is done. Make it where the kernels were launched (e.g. in the
    forward thread) and put from any thread. None on a machine without CUDA."""
    return stream_marker(stream, device_index)


class Stager:
    """One pinned host buffer in two halves and the copy streams that fill and drain it."""

    def __init__(self, engine, nbytes: int):
        nbytes = max(2 * ALIGN, nbytes // (2 * ALIGN) * 2 * ALIGN)
        raw = np.empty(nbytes + 4096, dtype=np.uint8)
        start = (-raw.ctypes.data) % 4096
        self._buf = raw[start:start + nbytes]
        self.addr = self._buf.ctypes.data
        self.half = nbytes // 2
        self.region = engine.register(self._buf)
        self.pinned = _native.cuda_available() and _native.cuda_host_register(self.addr, nbytes)
        # A kernel may copy between it and device memory (many small ranges in one launch)
        self.addressable = bool(self.pinned) and _native.cuda_device_addressable(self.addr)
        self._streams: dict[tuple, Any] = {}

    def stream(self, kind: str, dev: int, half: int):
        key = (kind, dev, half)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = (_native.CudaCopyStream(dev) if kind == device.CUDA
                                      else _native.HostCopyStream())
        return s

    def sync(self, half: int | None = None) -> None:
        for (_k, _d, h), s in self._streams.items():
            if half is None or h == half:
                s.synchronize()

    def close(self) -> None:
        self.sync()
        self._streams.clear()
        if self.pinned:
            _native.cuda_host_unregister(self.addr)
        self.region.close()

    # ------------------------------------------------------------------ moves ----
    def _copy(self, items: Sequence[Staged], dsts: Sequence, srcs: Sequence, lens: Sequence[int],
              half: int, marker=None, in_buffer: bool = True) -> None:
        """Copy ``lens[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` on the items' streams; an
        item made of several ranges (a tuple on its side) is copied range by range.
        ``in_buffer``: every host address lies in this stager's pinned buffer."""
        by_stream: dict[tuple, tuple[list, list, list]] = {}
        for it, d, s, n in zip(items, dsts, srcs, lens):
            if not n:
                continue
            lists = by_stream.setdefault((it.kind, it.device), ([], [], []))
            if type(d) is int and type(s) is int:
                lists[0].append(d)
                lists[1].append(s)
                lists[2].append(n)
                continue
            for rel, a, m in spans(d if type(d) is not int else s, n):
                lists[0].append(a if type(d) is not int else d + rel)
                lists[1].append(a if type(s) is not int else s + rel)
                lists[2].append(m)
        for (kind, dev), (d, s, n) in by_stream.items():
            st = self.stream(kind, dev, half)
            if marker is not None and kind == device.CUDA:
                st.wait_marker(marker)
            st.copy_many(d, s, n, self.addressable and in_buffer)

    def _place(self, g: Sequence[int], items: Sequence[Staged], half: int):
        """Where group ``g``'s items sit: half ``half``, or a buffer of their own."""
        sizes = [items[i].nbytes for i in g]
        if len(g) == 1 and sizes[0] > self.half:
            own = np.empty(max(sizes[0], 1), dtype=np.uint8)
            return own, [own.ctypes.data]
        base = self.addr + half * self.half
        return None, [base + o for o in device.offsets(sizes, ALIGN)]

    def put(self, keys, items: Sequence[Staged], put_fn: Callable, marker=None) -> list:
        """Copy each item out of its memory and put it; ``put_fn(keys, [(addr, n)])``
        puts from host memory. Returns put_fn's results in the order of ``keys``."""
        gs = device.groups([it.nbytes for it in items], self.half, ALIGN)
        results: list = [None] * len(keys)
        placed = [None] * len(gs)

        def enqueue(gi: int) -> None:
            g = gs[gi]
            keep, addrs = self._place(g, items, gi % 2)
            placed[gi] = (keep, addrs)
            self._copy([items[i] for i in g], addrs, [items[i].addr for i in g], [items[i].nbytes for i in g],
                       gi % 2, marker, keep is None)

        try:
            enqueue(0)
            for gi, g in enumerate(gs):
                self.sync(gi % 2)
                if gi + 1 < len(gs):
                    enqueue(gi + 1)  # copied while this group is put
                own, addrs = placed[gi]
                got = put_fn([keys[i] for i in g], _sources(own, addrs, [items[i].nbytes for i in g]))
                for i, r in zip(g, got):
                    results[i] = r
                placed[gi] = None
        finally:
            self.sync()
        return results

    def get(self, keys, items: Sequence[Staged], get_fn: Callable) -> list:
        """Get each value into staging and copy it into its item; ``get_fn(keys, [(addr,
        n)])`` reads into host memory. Returns get_fn's results (a size or an error)."""
        gs = device.groups([it.nbytes for it in items], self.half, ALIGN)
        results: list = [None] * len(keys)
        keeps: list = []
        try:
            for gi, g in enumerate(gs):
                h = gi % 2
                self.sync(h)  # this half's copies of two groups ago are done
                own, addrs = self._place(g, items, h)
                if own is not None:
                    keeps.append(own)  # until its copies are done
                got = get_fn([keys[i] for i in g], _sources(own, addrs, [items[i].nbytes for i in g]))
                ok = [(i, a, r) for i, a, r in zip(g, addrs, got) if isinstance(r, int) and not isinstance(r, bool)]
                self._copy([items[i] for i, _, _ in ok], [items[i].addr for i, _, _ in ok], [a for _, a, _ in ok],
                           [r for _, _, r in ok], h, in_buffer=own is None)
                for i, r in zip(g, got):
                    results[i] = r
        finally:
            self.sync()
        return results


def _host_range(buf) -> tuple:
    """``(address, nbytes, keep)`` of host memory: bytes read-only, anything else writable."""
    return readable(buf) if isinstance(buf, bytes) else writable(buf)


def _sources(own, addrs: Sequence[int], sizes: Sequence[int]) -> list:
    """A group's host buffers: raw ranges of the (registered) staging half, or the one
    item's own buffer (unregistered: the transport bounces it through its own staging)."""
    if own is not None:
        return [own[:sizes[0]]]
    return [(a, n) for a, n in zip(addrs, sizes)]


class DeviceIO:
    """A client's device memory: registrations on the staged and direct paths, the routing
    of each buffer of a call, and a pool of stagers."""

    def __init__(self, engine, setting: str, staging_bytes: int):
        if setting not in device.PATHS:
            raise errors.ConfigError(f"client.device_path {setting!r} is not one of {device.PATHS}")
        self.engine, self.setting, self.staging_bytes = engine, setting, staging_bytes
        self.memory_types = tuple(engine.memory_types)
        self._regs: list[Registration] = []
        self._index = RangeSet()  # the same registrations, found by any address inside them
        self._lock = threading.Lock()
        self._free: list[Stager] = []
        self._stagers: list[Stager] = []
        self.stats = {"staged_puts": 0, "staged_gets": 0, "staged_bytes": 0, "direct_registrations": 0,
                      "staged_registrations": 0}

    def active(self) -> bool:
        return bool(self._regs)

    # ------------------------------------------------------------ registration ----
    def register(self, buffer: Any) -> Registration | None:
        """The registration of ``buffer`` if it is device memory, or host memory while
        staging is forced; None for host memory otherwise (the caller registers it).

        Raises:
            ConfigError: ``direct`` forced where the engine cannot register CUDA memory.
            InvalidArgumentError: empty or non-contiguous memory.
        """
        mem = device.describe(buffer)
        if mem is None:
            if self.setting != "staged":
                return None
            addr, n, keep = _host_range(buffer)
            kind, dev = device.HOST, -1
        else:
            addr, n, keep, kind, dev = mem.addr, mem.nbytes, mem.keep, device.CUDA, mem.device
        if n == 0:
            raise errors.InvalidArgumentError("cannot register an empty buffer")
        path = device.choose_path(kind, self.memory_types, self.setting)
        region = self.engine.register((addr, n), cuda=True) if path == "direct" else None
        reg = Registration(addr, n, kind, dev, path, region, keep)
        with self._lock:
            self._regs.append(reg)
            self._index.add(addr, n, reg)
        self.stats[f"{path}_registrations"] += 1
        return reg

    def unregister(self, addr: int) -> bool:
        with self._lock:
            for i, r in enumerate(self._regs):
                if r.addr == addr:
                    del self._regs[i]
                    self._index.remove(r)
                    r.close()
                    return True
        return False

    def _inside(self, addr: int, n: int) -> Registration | None:
        return self._index.find(addr, n)

    # ----------------------------------------------------------------- routing ----
    def route(self, buf: Any):
        """``None`` (host memory: the usual path), ``((addr, n), device)`` (direct device
        memory: a raw range the transport knows as CUDA memory) or a ``Staged`` item.

        A list of buffers routes as one value: all host memory, all direct device memory
        of one device (a list of raw ranges), or all staged memory of one kind and device
        (one ``Staged`` item of several ranges).

        Raises:
            InvalidArgumentError: non-contiguous device memory, or a list whose buffers
                take different paths.
        """
        if isinstance(buf, list):
            return self._route_list(buf)
        if isinstance(buf, tuple) and len(buf) == 2:
            if not self._regs or not all(type(v) is int for v in buf):
                return None
            r = self._inside(*buf)
            if r is None:
                return None
            return (buf, r.device) if r.path == "direct" else Staged(buf[0], buf[1], r.kind, r.device, None)
        mem = device.describe(buf)
        if mem is None:
            if not self._regs or self.setting != "staged":
                return None
            try:
                addr, n, keep = _host_range(buf)
            except errors.InvalidArgumentError:
                return None  # the usual path reports it
            r = self._inside(addr, n)
            return None if r is None else Staged(addr, n, device.HOST, -1, keep)
        r = self._inside(mem.addr, mem.nbytes)
        if r is not None and r.path == "direct":
            return ((mem.addr, mem.nbytes), r.device)
        return Staged(mem.addr, mem.nbytes, device.CUDA, mem.device, mem.keep)

    def _route_list(self, bufs: list):
        fast = self._route_ranges(bufs)
        if fast is not _SLOW:
            return fast
        routes = [self.route(b) for b in bufs]
        if all(r is None for r in routes):
            return None
        if all(isinstance(r, Staged) for r in routes) and len({(r.kind, r.device) for r in routes}) == 1:
            return Staged(tuple((r.addr, r.nbytes) for r in routes if r.nbytes), sum(r.nbytes for r in routes),
                          routes[0].kind, routes[0].device, [r.keep for r in routes])
        if all(isinstance(r, tuple) for r in routes) and len({r[1] for r in routes}) == 1:
            return [r[0] for r in routes], routes[0][1]
        paths = ["host" if r is None else f"staged {r.kind}:{r.device}" if isinstance(r, Staged)
                 else f"direct cuda:{r[1]}" for r in routes]
        raise errors.InvalidArgumentError(
            f"a list of buffers is one value: its buffers must take one path, got {sorted(set(paths))}")

    def _route_ranges(self, bufs: list):
        """``_route_list`` of a value made of raw ranges (a KV block's dozens) in
        registrations of one path and device, found in one native pass; ``_SLOW`` for
        anything else, which ``route`` takes range by range."""
        if not self._regs:
            return _SLOW
        starts, ends, items = self._index.snapshot()
        ks = _native.span_set(bufs, starts, ends)
        if ks is None:
            return _SLOW
        regs = [items[k][2] for k in ks]
        r0 = regs[0]
        if all(r.path == "direct" and r.device == r0.device for r in regs):
            return list(bufs), r0.device
        if all(r.path != "direct" and (r.kind, r.device) == (r0.kind, r0.device) for r in regs):
            return Staged(tuple(bufs), sum(n for _, n in bufs), r0.kind, r0.device, [None] * len(bufs))
        return _SLOW  # several paths: route names them in its error

    def split(self, bufs: Sequence[Any]) -> tuple[list, dict[int, Staged], set[int]]:
        """The call's buffers with direct device memory as raw ranges (and a list whose
        buffers take different paths as its InvalidArgumentError), the staged items by
        index (each staged index keeps its original buffer in the first list), and the
        devices of the direct ones."""
        out, staged, devices = list(bufs), {}, set()
        for i, b in enumerate(bufs):
            try:
                r = self.route(b)
            except errors.InvalidArgumentError as e:
                if isinstance(b, list):
                    out[i] = e  # the key's answer: the usual path would not know why
                continue  # the usual path reports it for this key
            if r is None:
                continue
            if isinstance(r, Staged):
                staged[i] = r
            else:
                out[i], dev = r
                devices.add(dev)
        return out, staged, devices

    def needed(self, bufs: Sequence[Any]) -> bool:
        """Whether a call with these buffers takes the routed path (cheap for host-only
        calls of a client with no device registrations)."""
        if self._regs:
            return True
        for b in bufs:
            if isinstance(b, list):
                # a value of raw ranges (a KV block's dozens): its types in one C-level pass
                if not set(map(type, b)) <= _TUPLE and self.needed(b):
                    return True
            elif not isinstance(b, _PLAIN) and device.describe(b) is not None:
                return True
        return False

    def registered(self, addr: int, n: int) -> bool:
        """Whether ``[addr, addr + n)`` lies in a staging buffer or direct device memory
        (raw ranges the usual path may then be given)."""
        for s in self._stagers:
            if s.addr <= addr and addr + n <= s.addr + 2 * s.half:
                return True
        r = self._inside(addr, n)
        return r is not None and r.path == "direct"

    def put_routed(self, keys, bufs, sizes, after, host_put: Callable) -> list:
        """A put whose buffers include device (or staged host) memory: direct device
        memory as raw ranges through ``host_put(keys, bufs, sizes)``, staged items through
        a staging buffer; results in the order of ``keys``."""
        bufs, staged, devices = self.split(bufs)
        out: list = [None] * len(keys)
        for i, it in list(staged.items()):
            if sizes is not None and sizes[i] is not None:
                if type(sizes[i]) is not int or not 0 <= sizes[i] <= it.nbytes:
                    out[i] = errors.InvalidArgumentError(
                        f"size {sizes[i]!r:.40} is outside the buffer of {it.nbytes} bytes")
                    del staged[i]
                    continue
                it.nbytes = sizes[i]
        for i, b in enumerate(bufs):
            if isinstance(b, errors.InvalidArgumentError):
                out[i] = b
        plain = [i for i in range(len(keys)) if i not in staged and out[i] is None]
        if plain:
            for dev in devices:  # before UCX reads direct device memory: its writers are done
                m = stream_marker(after, dev)
                if m is not None:
                    m.synchronize()
            got = host_put([keys[i] for i in plain], [bufs[i] for i in plain],
                           None if sizes is None else [sizes[i] for i in plain])
            for i, r in zip(plain, got):
                out[i] = r
        if staged:
            idx = sorted(staged)
            got = self.put([keys[i] for i in idx], [staged[i] for i in idx],
                           lambda ks, bs: host_put(ks, bs, None), after)
            for i, r in zip(idx, got):
                out[i] = r
        return out

    def get_routed(self, keys, bufs, host_get: Callable) -> list:
        """``put_routed``'s counterpart for reads into buffers (``host_get(keys, bufs)``)."""
        bufs, staged, _ = self.split(bufs)
        out: list = [b if isinstance(b, errors.InvalidArgumentError) else None for b in bufs]
        plain = [i for i in range(len(keys)) if i not in staged and out[i] is None]
        if plain:
            for i, r in zip(plain, host_get([keys[i] for i in plain], [bufs[i] for i in plain])):
                out[i] = r
        if staged:
            idx = sorted(staged)
            for i, r in zip(idx, self.get([keys[i] for i in idx], [staged[i] for i in idx], host_get)):
                out[i] = r
        return out

    # ------------------------------------------------------------------- moves ----
    def _take(self) -> Stager:
        with self._lock:
            if self._free:
                return self._free.pop()
            if len(self._stagers) >= MAX_STAGERS:
                raise errors.NoCapacityError(
                    f"{MAX_STAGERS} staged calls already run at once on this client")
            s = Stager(self.engine, self.staging_bytes)
            self._stagers.append(s)
            return s

    def _give(self, s: Stager) -> None:
        with self._lock:
            self._free.append(s)

    def put(self, keys, items: Sequence[Staged], put_fn: Callable, after: Any = None) -> list:
        cuda_devs = {it.device for it in items if it.kind == device.CUDA}
        marker = stream_marker(after, next(iter(cuda_devs))) if cuda_devs else None
        s = self._take()
        try:
            out = s.put(keys, items, put_fn, marker)
        finally:
            self._give(s)
        self.stats["staged_puts"] += len(keys)
        self.stats["staged_bytes"] += sum(it.nbytes for it, r in zip(items, out) if r is None)
        return out

    def get(self, keys, items: Sequence[Staged], get_fn: Callable) -> list:
        s = self._take()
        try:
            out = s.get(keys, items, get_fn)
        finally:
            self._give(s)
        self.stats["staged_gets"] += len(keys)
        self.stats["staged_bytes"] += sum(r for r in out if isinstance(r, int) and not isinstance(r, bool))
        return out

    def close(self) -> None:
        with self._lock:
            regs, self._regs = self._regs, []
            self._index = RangeSet()
            stagers, self._stagers, self._free = self._stagers, [], []
        for r in regs:
            r.close()
        for s in stagers:
            s.close()
