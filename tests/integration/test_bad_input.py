"""Bad input gets a clear, typed error naming the bad value, and loses nothing stored."""

import numpy as np
import pytest

from mooncake_ray import InvalidArgumentError, NotRegisteredError, ObjectNotFoundError


@pytest.fixture(scope="module")
def store(ray_cluster):
    import mooncake_ray
    from mooncake_ray._private import deploy
    from tests.conftest import store_config

    cfg = store_config(segment_size_bytes="8mb")
    st = mooncake_ray.start(cfg)
    st.put("keep", b"precious")
    yield st
    st.close()
    deploy.teardown(cfg["namespace"])


@pytest.fixture
def s(store):
    yield store
    assert store.get("keep") == b"precious"  # nothing stored was lost


@pytest.mark.parametrize("key,match", [
    (123, "key must be a str, got int"),
    (b"bytes", "key must be a str, got bytes"),
    (None, "key must be a str, got NoneType"),
    ("", "must not be empty"),
    ("k" * 5000, "longer than max_key_bytes=4096"),
])
def test_bad_keys(s, key, match):
    with pytest.raises(InvalidArgumentError, match=match):
        s.put(key, b"v")
    with pytest.raises(InvalidArgumentError, match=match):
        s.get(key)
    with pytest.raises(InvalidArgumentError, match=match):
        s.exists(key)


@pytest.mark.parametrize("value,match", [
    ("text", "is a str: encode it"),
    (12345, "of type int is not bytes-like"),
    (object(), "of type object is not bytes-like"),
    (np.zeros((4, 4))[:, ::2], "not C-contiguous"),
])
def test_bad_values(s, value, match):
    with pytest.raises(InvalidArgumentError, match=match):
        s.put("v", value)
    assert not s.exists("v")


def test_value_larger_than_pool(s):
    with pytest.raises(InvalidArgumentError, match=r"value of 9437184 bytes is larger than any store node's arena"):
        s.put("big", bytes(9 << 20))


def test_buffer_too_small_reads_nothing(s):
    buf = bytearray(b"untouched")
    s.upsert("ten", b"0123456789")
    with pytest.raises(InvalidArgumentError, match=r"buffer of 9 bytes is smaller than the value of 'ten' \(10 bytes\)"):
        s.get_into("ten", buf)
    assert buf == b"untouched"


def test_read_only_buffer(s):
    with pytest.raises(InvalidArgumentError, match="read-only"):
        s.get_into("keep", b"immutable bytes")


def test_batch_length_mismatch(s):
    with pytest.raises(InvalidArgumentError, match="2 keys but 1 values"):
        s.batch_put(["a", "b"], [b"x"])
    assert not s.exists("a")


def test_put_from_size_outside_buffer(s):
    with pytest.raises(InvalidArgumentError, match="size 100 is outside the buffer of 10 bytes"):
        s.put_from("p", bytearray(10), 100)


def test_unregister_unknown_buffer(s):
    with pytest.raises(NotRegisteredError):
        s.unregister_buffer(bytearray(10))


def test_miss_is_keyerror(s):
    with pytest.raises(KeyError):
        s.get("never-stored")
    with pytest.raises(ObjectNotFoundError, match="'never-stored' is not in the store"):
        s.get("never-stored")


def test_lone_surrogate_key(s):
    key = "page/\udc80/x"
    for call in (lambda: s.put(key, b"v"), lambda: s.get(key), lambda: s.exists(key), lambda: s.remove(key)):
        with pytest.raises(InvalidArgumentError, match=r"'\\udc80' at position 5 is a lone surrogate"):
            call()


@pytest.mark.parametrize("replicas,match", [
    (0, "replicas must be an int from 1 to 64, got 0"),
    (-1, "replicas must be an int from 1 to 64, got -1"),
    (100, "replicas must be an int from 1 to 64, got 100"),
    ("x", "replicas must be an int from 1 to 64, got 'x'"),
    (2 ** 70, "replicas must be an int from 1 to 64, got 1180591620717411303424"),
    (True, "replicas must be an int from 1 to 64, got True"),
    (1.0, "replicas must be an int from 1 to 64, got 1.0"),
])
def test_bad_replicas(s, replicas, match):
    for call in (lambda: s.put("r", b"v", replicas=replicas),
                 lambda: s.put("r", bytes(40 << 20), replicas=replicas)):  # slab and two-call paths
        with pytest.raises(InvalidArgumentError, match=match):
            call()
    assert not s.exists("r")


def test_replicas_checked_by_the_master_too(s):
    """A client that skips the checks gets the same errors from the master."""
    from mooncake_ray._private import rpc

    got = s._master.call(rpc.PUT_START, [["r", 16, 0, False], ["r", 16, "x", False]], None, "owner")
    assert [rpc.to_exc(g).__class__ for g in got] == [InvalidArgumentError, InvalidArgumentError]
    assert "got 0" in str(rpc.to_exc(got[0])) and "got 'x'" in str(rpc.to_exc(got[1]))


@pytest.mark.parametrize("ttl,match", [
    ("abc", "got 'abc'"), (float("nan"), "got nan"), (float("inf"), "got inf"), (-1, "got -1"),
    (0, "got 0"), (2 ** 70, "got 1180591620717411303424"), (True, "got True"),
])
def test_bad_pin_ttl(s, ttl, match):
    with pytest.raises(InvalidArgumentError, match="ttl_s must be a finite number of seconds .*" + match):
        s.pin("keep", ttl_s=ttl)
    from mooncake_ray._private import rpc

    if not (type(ttl) is int and ttl >= 1 << 64):  # msgpack cannot carry 2**70 at all
        got = s._master.call(rpc.PIN, [["keep", False, ttl]])  # the master checks too
        assert isinstance(rpc.to_exc(got[0]), InvalidArgumentError)


def test_raw_ranges(s):
    arr = np.zeros(8192, np.uint8)
    with pytest.raises(InvalidArgumentError, match=r"\(-0x1000, 16\) is not a memory range"):
        s.get_into("keep", (-4096, 16))
    with pytest.raises(InvalidArgumentError, match=r"must be two ints, got \(float, int\)"):
        s.get_into("keep", (1.5, 16))
    # mapped memory, but not registered: refused, never written
    with pytest.raises(NotRegisteredError, match="is not inside a buffer registered with register_buffer"):
        s.get_into("keep", (arr.ctypes.data, 4096))
    with pytest.raises(NotRegisteredError, match="is not inside a buffer registered"):
        s.put_from("raw", (arr.ctypes.data, 4096))
    # unmapped memory cannot be registered (it would crash this process when read)
    with pytest.raises(InvalidArgumentError, match="is not mapped read-write in this process"):
        s.register_buffer((0x10000, 4096))
    reg = s.register_buffer((arr.ctypes.data, arr.nbytes))
    try:
        assert s.get_into("keep", (arr.ctypes.data + 4096, 4096)) == 8
        assert bytes(arr[4096:4104]) == b"precious"
        with pytest.raises(NotRegisteredError):  # runs past the registered buffer
            s.get_into("keep", (arr.ctypes.data + 4096, 8192))
    finally:
        s.unregister_buffer(reg)
    assert not s.exists("raw")


def test_batch_calls_answer_bad_keys_per_key(s):
    s.remove_prefix("b/")
    out = s.batch_put(["b/1", 123, "b/2", "", "b/3"], [b"1", b"x", "text", b"x", b"3"])
    assert out[0] is None and out[4] is None
    assert isinstance(out[1], InvalidArgumentError) and "got int" in str(out[1])
    assert isinstance(out[2], InvalidArgumentError) and "is a str" in str(out[2])
    assert isinstance(out[3], InvalidArgumentError) and "must not be empty" in str(out[3])
    got = s.batch_get(["b/1", None, "b/3", "b/none"])
    assert got[0] == b"1" and got[2] == b"3" and got[3] is None
    assert isinstance(got[1], InvalidArgumentError)
    bufs = [bytearray(8), b"read-only", bytearray(8)]
    got = s.batch_get_into(["b/1", "b/3", "b/3"], bufs)
    assert got[0] == 1 and got[2] == 1 and isinstance(got[1], InvalidArgumentError)
    assert s.batch_exists(["b/1", 5, "b/2"]) == [True, False, False]


def test_a_read_only_array_is_put_from_and_read_back(s):
    """A put only reads its buffer: a read-only array is a value like any other."""
    ro = np.arange(4096, dtype=np.uint16).view(np.uint8)[:4096].copy()
    ro.flags.writeable = False
    assert s.batch_put_from(["ro/1"], [ro]) == [None]
    s.put_from("ro/2", ro, 100)
    assert s.get("ro/1") == ro.tobytes() and s.get("ro/2") == ro[:100].tobytes()
    s.remove_prefix("ro/")
