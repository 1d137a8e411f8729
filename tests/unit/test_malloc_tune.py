"""The store node's fixed mmap threshold (``malloc_tune``): a freed large block goes back
to the system even after a larger one raised glibc's dynamic threshold."""

import subprocess
import sys

CHILD = r"""
import ctypes, sys
from mooncake_ray._private import malloc_tune
if sys.argv[1] == "fixed":
    assert malloc_tune.fix_mmap_threshold()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1])
libc.free(libc.malloc(20 << 20))  # a large block freed: glibc raises its threshold to 20 MiB
base = anon()
blocks, pins = [], []
for _ in range(200):  # 50 MiB in blocks of 256 KiB, a smaller block living after each
    blocks.append(libc.malloc(256 << 10))
    ctypes.memset(blocks[-1], 1, 256 << 10)
    pins.append(libc.malloc(100 << 10))  # too large for the holes below: after the block
for b in blocks:
    libc.free(b)
print(anon() - base)
"""


def held_kib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_with_the_threshold_fixed_freed_large_blocks_are_given_back():
    assert held_kib("dynamic") > 40 << 10  # kept in the heap: the behaviour being fixed
    assert held_kib("fixed") < 4 << 10
