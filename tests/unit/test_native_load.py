"""Loading the native module: UCX's memory hooks are installed only where some transport
can use them (an RDMA device, a GPU, knem or xpmem), and a user's own setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mooncake_ray._private.native import memory_hooks_needed

# Prints whether loading the module rewrote the first bytes of libc's munmap (how UCX's
# default hook mode, "bistro", installs its hook) and what it left in the environment.
PROBE = """
import ctypes, os
libc = ctypes.CDLL("libc.so.6")
head = lambda: ctypes.string_at(ctypes.cast(libc.munmap, ctypes.c_void_p).value, 16)
before = head()
import mooncake_ray._private.native
print(head() != before, os.environ.get("UCX_MEM_EVENTS"))
"""


def probe(**env) -> tuple[bool, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_MEM_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0] == "True", out[1]


def test_no_registering_device_means_no_hooks_needed(tmp_path):
    rdma = tmp_path / "infiniband"
    assert not memory_hooks_needed(devices=(str(tmp_path / "nvidiactl"),), rdma_class=str(rdma))  # no class dir
    rdma.mkdir()
    assert not memory_hooks_needed(devices=(), rdma_class=str(rdma))  # an empty one


@pytest.mark.parametrize("present", ["device", "rdma"])
def test_a_gpu_or_rdma_device_keeps_the_hooks(tmp_path, present):
    rdma = tmp_path / "infiniband"
    rdma.mkdir()
    dev = tmp_path / "nvidiactl"
    if present == "device":
        dev.touch()
    else:
        (rdma / "mlx5_0").mkdir()
    assert memory_hooks_needed(devices=(str(dev),), rdma_class=str(rdma))


def test_loading_patches_libc_only_where_hooks_are_needed_and_leaves_the_environment_as_it_was():
    patched, left = probe()
    assert patched == memory_hooks_needed()
    assert left == "None"  # children decide for themselves


def test_a_user_setting_wins():
    patched, left = probe(UCX_MEM_EVENTS="y")
    assert patched and left == "y"
    patched, left = probe(UCX_MEM_EVENTS="n")
    assert not patched and left == "n"
