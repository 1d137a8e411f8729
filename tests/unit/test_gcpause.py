"""The collector pause around batch calls: off inside, restored after, shared by threads."""

import gc
import threading

from mooncake_ray._private.buffers import _data_address, new_bytes
from mooncake_ray._private.client import gcpause


def test_paused_restores_the_collector_as_it_found_it():
    assert gc.isenabled()
    with gcpause.paused():
        assert not gc.isenabled()
        with gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer batch is still running
    assert gc.isenabled()
    gc.disable()
    try:
        with gcpause.paused():
            pass
        assert not gc.isenabled()  # the caller had it off: it stays off
    finally:
        gc.enable()


def test_concurrent_batches_keep_it_off_until_the_last_ends():
    inside, release = threading.Event(), threading.Event()

    def batch():
        with gcpause.paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=batch)
    t.start()
    inside.wait(10)
    with gcpause.paused():
        pass
    assert not gc.isenabled()  # the other thread's batch is not over
    release.set()
    t.join()
    assert gc.isenabled()


def test_paused_ends_on_an_exception():
    try:
        with gcpause.paused():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()


def test_new_bytes_gives_fresh_objects_and_their_storage_address():
    seen = []
    for n in (0, 1, 2, 255, 16 << 10, (16 << 10) + 1, 1 << 20):
        b, addr = new_bytes(n)
        assert len(b) == n and addr == _data_address(b)
        if n >= 1:
            assert all(b is not s for s in seen)  # never a shared (interned) object
            seen.append(b)
