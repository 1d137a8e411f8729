"""``args.sources``: the one native call that reads a batch's plain values (bytes, numpy
arrays, bare or ``Sized``) answers what ``args.source`` answers for each, and leaves every
other value, and every bad one, to ``source`` and its typed errors."""

import numpy as np
import pytest

from mooncake_ray._private.client.args import Sized, convert, source, sources
from mooncake_ray.errors import InvalidArgumentError


def _cases():
    base = np.arange(64, dtype=np.uint8)
    ro = np.arange(10, dtype=np.uint8)
    ro.flags.writeable = False
    fortran = np.asfortranarray(np.ones((4, 4), np.float32))
    return [
        b"abc", Sized(b"abc", 2), Sized(b"abc", 0), base, base[8:24], Sized(base[8:24], 5),
        np.ones(6, np.float16), np.zeros(0, np.uint8), ro, bytearray(b"xy"), memoryview(b"q"),
        [b"a", b"bc"], Sized([b"a", b"bc"], None),
    ], [
        Sized(b"abc", 5), Sized(b"abc", -1), Sized(b"abc", True), Sized(b"abc", 2.0), Sized(base, 65),
        fortran, Sized(fortran, None), np.ones(9, np.uint8)[::2], "text", 7, None,
    ]


def test_plain_values_are_read_as_source_reads_them():
    good, _bad = _cases()
    want = convert(good, lambda v: source(v, None), {})
    got = sources(good, None, {})
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, v in zip(got, good):  # what keeps the bytes alive: the buffer itself, or more
        assert g[2] is not None
        if isinstance(v, (bytes, np.ndarray)):
            assert g[2] is v


def test_a_read_only_array_is_a_value_to_put():
    ro = np.arange(10, dtype=np.uint8)
    ro.flags.writeable = False
    (got,) = sources([Sized(ro, None)], None, {})
    assert got[:2] == (ro.ctypes.data, 10)


@pytest.mark.parametrize("value", _cases()[1], ids=[str(i) for i in range(len(_cases()[1]))])
def test_bad_values_get_sources_errors(value):
    want, got = {}, {}
    convert([b"ok", value], lambda v: source(v, None), want)
    out = sources([b"ok", value], None, got)
    assert list(got) == list(want) == [1] and str(got[1]) == str(want[1])
    assert isinstance(got[1], InvalidArgumentError)
    assert out[1] is None and out[0][1] == 2


def test_entries_of_bad_keys_are_left_out():
    bad = {1: InvalidArgumentError("bad key")}
    out = sources([b"a", b"b", b"c"], None, bad)
    assert out[1] is None and out[0][1] == 1 and out[2][1] == 1
