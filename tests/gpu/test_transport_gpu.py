"""The direct device path: CUDA memory registered with the engine (``register_memory(...,
cuda=True)``) moved by ``transfer`` to and from a peer process's memory, byte for byte.

- GPU <-> host arena (torch and cupy buffers), the arena made either way a store node makes
  it: "file" (the default, elastic.keep_arena: a file in /dev/shm the client maps itself,
  pinned for the CUDA driver on first use) or "ucx" (allocated by UCX); per transport variant:
    auto            same host: the arena is mapped, the C++ copies with the CUDA driver
                    (stats read_cuda_bytes / write_cuda_bytes);
    auto-ucx        the same engines with read_mode=get, write_mode=put: UCX moves device
                    memory (shared memory + cuda_copy);
    tcp             protocol tcp on lo (UCX_TLS=tcp): UCX moves device memory, if it can;
    tcp+cuda_copy   protocol tcp with UCX_TLS=tcp,cuda_copy.
- GPU -> GPU across two processes, and back: the peer's tensor opened here through CUDA
  IPC (protocol auto, unless MCR_CUDA_IPC=0), else UCX's transports (cuda_ipc; tcp + cuda_copy).
- Where the driver copies (mapped arena, CUDA IPC), a batch of many small ranges goes
  through the copy kernel (MCR_CUDA_COPY_KERNEL unset): its launches are counted, and the
  same round trip runs again with the kernel off (DMA only).
- host memory <-> another process's GPU memory (a staged reader of a direct writer's
  blocks), last: were the peer's device memory ever "mapped", a memcpy from it would crash.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from tests.gpu.gpu_util import MiB, delta, say, sha_cupy, sha_torch

VARIANTS = {
    "auto": dict(protocol="auto"),
    "auto-ucx": dict(protocol="auto", read_mode="get", write_mode="put"),
    "tcp": dict(protocol="tcp"),
    "tcp+cuda_copy": dict(protocol="tcp", ucx_options={"TLS": "tcp,cuda_copy"}),
}
T = 20.0  # seconds a transfer may take here (at most 64 MiB): a path UCX cannot do fails soon
ARENA = 64 * MiB
LOCAL = 32 * MiB
# odd sizes and alignments, whole 32 KiB blocks, large pieces that stripe over lanes
SIZES = [1, 7, 4096, 12345, 65536, 65537, 1 * MiB, 3 * MiB + 5, 8 * MiB] + [32768] * 64


def _cuda_buffer(gpu, lib: str, n: int, seed: int):
    """(object, address, sha function) of n random bytes of device memory."""
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if lib == "torch":
        t = gpu.torch.from_numpy(data).to(gpu.device)
        gpu.sync()
        return t, t.data_ptr(), lambda ranges: sha_torch(t, ranges)
    cupy = pytest.importorskip("cupy")
    with cupy.cuda.Device(gpu.dev):
        a = cupy.asarray(data)
        cupy.cuda.runtime.deviceSynchronize()
    return a, a.data.ptr, lambda ranges: sha_cupy(a, ranges)


def _need_cuda(eng, variant: str):
    mt = list(eng.memory_types)
    if "cuda" not in mt:
        pytest.skip(f"{variant}: this engine's UCX registers no CUDA memory (memory_types {mt}): "
                    "its CUDA transports did not load, or the variant's UCX_TLS leaves them out")


@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("arena", ["file", "ucx"], ids=["file-arena", "ucx-arena"])
@pytest.mark.parametrize("variant", ["auto", "auto-ucx"])
def test_transport_gpu_to_host_arena(gpu, engines, spawn_peer, variant, arena, lib):
    _arena_roundtrip(gpu, engines, spawn_peer, variant, lib, arena)


def test_transport_gpu_to_host_arena_dma_only(gpu, engines, spawn_peer):
    """The same round trip with the copy kernel off: the DMA engines copy every range."""
    was = gpu.native.cuda_copy_kernel_mode(0)
    try:
        _arena_roundtrip(gpu, engines, spawn_peer, "auto", "torch", "file", kernel=False)
    finally:
        gpu.native.cuda_copy_kernel_mode(was)


def _kernel_expected(gpu) -> bool:
    """Whether the copy kernel must have run (a real GPU, the kernel on): the driver on the
    GPU machine takes the PTX, so a refusal is a failure, with the driver's reason."""
    if gpu.fake or gpu.native.cuda_copy_kernel_mode() == 0:
        return False
    why = gpu.native.cuda_copy_kernel_unavailable(gpu.dev)
    assert why == "", f"the copy kernel cannot run on this GPU: {why}"
    return True


def _arena_roundtrip(gpu, engines, spawn_peer, variant, lib, arena="file", kernel=True):
    kw = VARIANTS[variant]
    eng = engines(f"gpu-{variant}-{arena}-{lib}", **kw)
    _need_cuda(eng, variant)
    peer = spawn_peer(name=f"arena-{variant}-{arena}", arena_bytes=ARENA, seed=11, arena=arena, **kw)
    buf, addr, sha_local = _cuda_buffer(gpu, lib, LOCAL, seed=12)
    region = eng.register_memory(addr, LOCAL, True)
    assert region.length == LOCAL
    assert peer.arena_kind == arena, f"the peer could not make a {arena} arena (see its log)"
    _, rr = peer.import_into(eng)
    rng = np.random.default_rng(13)

    # reads: random arena ranges -> consecutive local ranges (odd local alignments)
    reads, loc = [], 0
    for n in SIZES:
        reads.append((int(rng.integers(0, ARENA - n + 1)), loc, n))
        loc += n
    assert loc <= LOCAL
    s0 = eng.stats()
    eng.transfer([(rr, ro, addr + lo, n) for ro, lo, n in reads], True, T)
    s1 = eng.stats()
    want = peer.sha("arena", [(ro, n) for ro, _, n in reads])
    got = sha_local([(lo, n) for _, lo, n in reads])
    assert got == want, f"{variant}/{lib}: bytes read into device memory differ from the arena's"

    # writes: local ranges (fresh data) -> non-overlapping arena ranges
    if lib == "torch":
        buf.random_(0, 256)
        gpu.sync()
    else:
        import cupy

        buf[:] = cupy.asarray(np.random.default_rng(14).integers(0, 256, buf.size, dtype=np.uint8))
        cupy.cuda.runtime.deviceSynchronize()
    writes, ro = [], 0
    for n in SIZES:
        writes.append((ro, int(rng.integers(0, LOCAL - n + 1)), n))
        ro += n + int(rng.integers(0, 4097))
    assert ro <= ARENA
    eng.transfer([(rr, ro_, addr + lo, n) for ro_, lo, n in writes], False, T)
    s2 = eng.stats()
    want = sha_local([(lo, n) for _, lo, n in writes])
    got = peer.sha("arena", [(ro_, n) for ro_, _, n in writes])
    assert got == want, f"{variant}/{lib}: bytes written from device memory differ in the arena"

    total = sum(SIZES)
    cuda_r, cuda_w = delta(s1, s0, "read_cuda_bytes"), delta(s2, s1, "write_cuda_bytes")
    ucx_r, ucx_w = delta(s1, s0, "read_get_bytes"), delta(s2, s1, "write_put_bytes")
    pin_refused = delta(s2, s0, "cuda_pin_refused")
    launches = delta(s2, s0, "cuda_kernel_launches")
    say(f"arena {variant}/{arena}/{lib}: mapped={rr.mapped} pin_refused={pin_refused} kernel_launches={launches} "
        f"read_path={rr.read_path} write_path={rr.write_path}; "
        f"read {total} B (cuda {cuda_r}, ucx get {ucx_r}), wrote {total} B (cuda {cuda_w}, ucx put {ucx_w}): "
        f"exact; memory_types {list(eng.memory_types)}")
    if variant == "auto":
        assert rr.mapped and rr.read_path == "memcpy", (
            f"same host, protocol auto: the peer's arena should be mapped (mapped={rr.mapped}, "
            f"read_path={rr.read_path}); is /dev/shm large enough for a {ARENA >> 20} MiB arena?")
    # device memory takes the CUDA driver where the arena is mapped and the engine may copy
    # (read_mode/write_mode not forced to get/put), else UCX
    driver = rr.mapped and kw.get("read_mode") != "get"
    if driver:
        assert cuda_r == total and cuda_w == total, (cuda_r, cuda_w, total)
        # the mapped arena is pinned for the driver (else every copy is a pageable one)
        assert pin_refused == 0 or gpu.fake, f"the driver refused to pin the mapped {arena} arena"
        # 73 ranges (odd sizes and alignments among them) a call: one launch each way
        assert launches == (2 if kernel and _kernel_expected(gpu) else 0), launches
    else:
        assert ucx_r == total and ucx_w == total and cuda_r == 0 and cuda_w == 0, (ucx_r, ucx_w, cuda_r, cuda_w)
    region.close()


def test_gpu_to_gpu_two_processes(gpu, engines, spawn_peer):
    _gpu_to_gpu(gpu, engines, spawn_peer, "auto")


def _gpu_to_gpu(gpu, engines, spawn_peer, variant):
    torch = gpu.torch
    kw = VARIANTS[variant]
    eng = engines(f"g2g-{variant}", **kw)
    _need_cuda(eng, variant)
    n = 64 * MiB
    peer = spawn_peer(name=f"g2g-peer-{variant}", arena_bytes=4 * MiB, cuda_bytes=n, cuda_seed=21, **kw)
    if peer.cuda_error or "cuda" not in peer.regions:
        pytest.fail(f"the peer could not register its CUDA tensor: {peer.cuda_error} "
                    f"(its memory_types {peer.memory_types})")
    mine = torch.zeros(n, dtype=torch.uint8, device=gpu.device)
    gpu.sync()
    region = eng.register_memory(mine.data_ptr(), n, True)
    _, rr = peer.import_into(eng, "cuda")
    base = mine.data_ptr()

    # the whole tensor in one op, then 256 blocks of 32 KiB from scattered offsets
    s0 = eng.stats()
    eng.transfer([(rr, 0, base, n)], True, T)
    s1 = eng.stats()
    assert sha_torch(mine) == peer.sha("cuda", [(0, n)]), f"{variant}: GPU->GPU read differs"
    blocks = np.random.default_rng(22).choice(n // 32768, 256, replace=False) * 32768
    mine.zero_()
    gpu.sync()
    k0 = eng.stats()
    eng.transfer([(rr, int(o), base + i * 32768, 32768) for i, o in enumerate(blocks)], True, T)
    k1 = eng.stats()
    assert sha_torch(mine, [(0, 256 * 32768)]) == peer.sha("cuda", [(int(o), 32768) for o in blocks])
    # and scattered back into other offsets of the peer's tensor (a write of many blocks)
    back = np.random.default_rng(23).choice(n // 32768, 256, replace=False) * 32768
    eng.transfer([(rr, int(o), base + i * 32768, 32768) for i, o in enumerate(back)], False, T)
    assert peer.sha("cuda", [(int(o), 32768) for o in back]) == sha_torch(mine, [(0, 256 * 32768)])
    k2 = eng.stats()

    # and back: our random bytes into the peer's tensor
    mine.random_(0, 256)
    gpu.sync()
    eng.transfer([(rr, 0, base, n)], False, T)
    assert peer.sha("cuda", [(0, n)]) == sha_torch(mine), f"{variant}: GPU->GPU write differs"
    moved = delta(s1, s0, "read_get_bytes") + delta(s1, s0, "read_cuda_bytes")
    say(f"gpu->gpu {variant}: mapped={rr.mapped} device_mapped={rr.device_mapped} read_path={rr.read_path}; read {n} B "
        f"(ucx get {delta(s1, s0, 'read_get_bytes')}, cuda {delta(s1, s0, 'read_cuda_bytes')}), "
        f"256 blocks, write {n} B: exact")
    assert moved == n
    if not gpu.fake:
        # same host, shared memory allowed: the peer's tensor is opened through CUDA IPC and
        # the driver copies; over tcp, UCX moves it
        want = variant == "auto" and os.environ.get("MCR_CUDA_IPC") != "0"
        assert rr.device_mapped == want, (variant, rr.device_mapped)
        if rr.device_mapped:
            assert delta(s1, s0, "read_cuda_bytes") == n
            # 256 blocks each way: one kernel launch each
            want_k = 1 if _kernel_expected(gpu) else 0
            assert (delta(k1, k0, "cuda_kernel_launches"), delta(k2, k1, "cuda_kernel_launches")) == (want_k, want_k)
    region.close()


def test_host_register_and_device_of(gpu):
    """The driver shim's pointer queries and pinning, against torch's view of the same memory."""
    if gpu.fake:
        pytest.skip("MCR_GPU_FAKE: no device pointers to query")
    torch, _native = gpu.torch, gpu.native
    t = torch.empty(1 << 20, dtype=torch.uint8, device=gpu.device)
    assert _native.cuda_device_of(t.data_ptr()) == gpu.dev
    assert _native.cuda_device_of(t.data_ptr() + 12345) == gpu.dev
    host = np.zeros(1 << 20, dtype=np.uint8)
    assert _native.cuda_device_of(host.ctypes.data) == -1
    assert _native.cuda_host_register(host.ctypes.data, host.nbytes)
    pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    assert _native.cuda_device_of(pinned.data_ptr()) == -1  # pinned host memory is host memory
    _native.cuda_host_unregister(host.ctypes.data)
    assert _native.cuda_device_count() >= 1
    say(f"device_of / host_register: ok on {gpu.name}")


def test_host_memory_and_gpu_of_another_process(gpu, engines, spawn_peer):
    """A host buffer reads from, and writes to, a peer's registered CUDA tensor."""
    eng = engines("host-g2h", protocol="auto")
    n = 16 * MiB
    peer = spawn_peer(name="g2h-peer", protocol="auto", arena_bytes=4 * MiB, cuda_bytes=n, cuda_seed=41)
    if peer.cuda_error or "cuda" not in peer.regions:
        pytest.skip(f"the peer could not register its CUDA tensor: {peer.cuda_error}")
    host = np.zeros(n, dtype=np.uint8)
    region = eng.register_memory(host.ctypes.data, n, False)
    _, rr = peer.import_into(eng, "cuda")
    say(f"host<->peer gpu: mapped={rr.mapped} read_path={rr.read_path} write_path={rr.write_path}")
    if rr.mapped and not gpu.fake:
        pytest.fail("the peer's CUDA memory imports as 'mapped' (ucp_rkey_ptr gave a pointer): a host-memory "
                    "reader would memcpy from a device address; import_remote should not map device memory")
    s0 = eng.stats()
    eng.transfer([(rr, 0, host.ctypes.data, n)], True, T)
    assert hashlib.sha256(host).hexdigest() == peer.sha("cuda", [(0, n)]), "host <- peer GPU differs"
    host[:] = np.random.default_rng(42).integers(0, 256, n, dtype=np.uint8)
    eng.transfer([(rr, 4096, host.ctypes.data, n - 8192)], False, T)
    assert peer.sha("cuda", [(4096, n - 8192)]) == hashlib.sha256(host[:n - 8192]).hexdigest(), \
        "host -> peer GPU differs"
    s1 = eng.stats()
    say(f"host<->peer gpu: read {n} B, wrote {n - 8192} B: exact; stats delta "
        f"{ {k: delta(s1, s0, k) for k in ('read_get_bytes', 'read_push_bytes', 'write_put_bytes', 'write_memcpy_bytes')} }")
    region.close()


# UCX over tcp last: a device-memory path UCX gets wrong could take this process down, and
# what ran before it is kept.
@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("variant", ["tcp", "tcp+cuda_copy"])
def test_transport_gpu_to_host_arena_tcp(gpu, engines, spawn_peer, variant, lib):
    _arena_roundtrip(gpu, engines, spawn_peer, variant, lib)


def test_gpu_to_gpu_two_processes_tcp(gpu, engines, spawn_peer):
    _gpu_to_gpu(gpu, engines, spawn_peer, "tcp+cuda_copy")
