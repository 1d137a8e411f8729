"""A fixed mmap threshold for glibc's malloc in a store node's process.

glibc serves a block of 128 KiB or more from a mapping of its own, returned to the system
when freed, but raises that threshold (up to 32 MiB) each time such a block is freed. A
store node frees large blocks now and then (an index snapshot of a million values is
75 MB), after which every journal batch, decoded message and list of a thousand records
comes from the heaps of its threads, where the small blocks living among them keep the
pages resident once they are freed: after 1M x 256 B puts the node's heaps held 87 MB of
free memory (`mallinfo2`) that `malloc_trim` did not give back, 65 B a value beside its
61 B in the node table. With the threshold fixed at 64 KiB (which also stops its growth)
the same run left 2 MB free, and the node grew by 79 B a value instead of 131-155.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 64 << 10


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """For this whole process (glibc only; elsewhere, or if refused, nothing changes;
    ``MCR_MALLOC_DYNAMIC=1`` in the environment keeps glibc's own, for comparisons).
    Returns whether it was set."""
    if os.environ.get("MCR_MALLOC_DYNAMIC") == "1":
        return False
    try:
        ok = bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):  # not glibc
        return False
    if not ok:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) refused: malloc keeps its own threshold", nbytes)
    return ok
