"""CRC-32C folded with AVX-512 carry-less multiplies (``native/src/spill/crc32c.cpp``:
``fold_raw``, runs of 512 bytes or more where the CPU has VPCLMULQDQ) against a table
computed here in Python, and against the crc32 instruction's chains (the same process with
``MCR_CRC_NO_FOLD``): lengths around every step of the kernel, unaligned starts, any
register. A put's copy-and-checksum takes the same kernel (``test_transfer.py`` checks it
against this one)."""

import json
import os
import random
import subprocess
import sys

import numpy as np

from mooncake_ray._private.native import _native

_POLY = 0x82F63B78
_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ (_POLY if _c & 1 else 0)
    _TABLE.append(_c)


def reference(data: bytes, crc: int = 0) -> int:
    """The standard CRC-32C (reflected, initial and final XOR) continued from ``crc``."""
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def native(buf: np.ndarray, start: int, n: int, crc: int = 0) -> int:
    return _native.spill_crc32c(buf.ctypes.data + start, n, crc)


LENGTHS = [0, 1, 255, 256, 511, 512, 513, 575, 767, 768, 1023, 1024, 1025, 4095, 4096, 8191, 24 * 1024 + 7,
           65536 + 129]


def test_the_folded_crc_is_the_standard_one():
    rng = random.Random(5)
    buf = np.frombuffer(rng.randbytes(70 * 1024), dtype=np.uint8)
    assert native(np.frombuffer(b"123456789", dtype=np.uint8), 0, 9) == 0xE3069283
    for n in LENGTHS + [rng.randrange(512, 66000) for _ in range(12)]:
        for start in (0, 1, 63, 64 + 5):
            crc = rng.randrange(1 << 32)
            assert native(buf, start, n, crc) == reference(bytes(buf[start:start + n]), crc), (n, start)


_OTHER = """
import json, sys, numpy as np
from mooncake_ray._private.native import _native
buf = np.frombuffer(np.random.default_rng(9).bytes(5 << 20), dtype=np.uint8)
out = [_native.spill_crc32c(buf.ctypes.data + s, n, c) for s, n, c in json.loads(sys.argv[1])]
print(json.dumps([_native.spill_crc32c_folded(), out]))
"""


def test_the_folded_crc_and_the_crc32_chains_agree_on_long_runs():
    rng = random.Random(6)
    cases = [(rng.randrange(4096), n, rng.randrange(1 << 32)) for n in
             [512, 4096, 1 << 20, (4 << 20) - 3, (4 << 20) + 1000] + [rng.randrange(512, 4 << 20) for _ in range(10)]]
    runs = {}
    for name, env in (("folded", {}), ("chains", {"MCR_CRC_NO_FOLD": "1"})):
        res = subprocess.run([sys.executable, "-c", _OTHER, json.dumps(cases)], capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=120, check=True)
        runs[name] = json.loads(res.stdout)
    assert runs["chains"][0] is False  # the switch works
    assert runs["folded"][1] == runs["chains"][1]
