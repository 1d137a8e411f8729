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
