"""A serving process of ours gives a large body's memory back to the system once the body is sent.

A /metrics body of a large directory (50 000 stores: several hundred MB) is made of blocks of a few hundred KB
(app.exposition.Exposition).  glibc's malloc serves an allocation from the heap below its mmap threshold, and
raises that threshold (up to 32 MiB) each time it frees a larger mmapped block: after the first large body,
every later one lands in the heap, whose freed pages stay with the process, one heap per thread that rendered a
body.  A fixed threshold keeps every block above it in a mapping of its own, unmapped when freed: the process's
memory follows the bodies it holds, not the most it ever held (measured: 721 MiB left after a 357 MiB body was
sent, 207 MiB with it fixed).

Only for processes that are ours alone (the address server, the aggregator's workers, ``serve``): a rank's
process is the host's, and how it allocates is none of our business.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("nixl_prometheus_mp.malloc")

_M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>; setting it also turns the dynamic threshold off
MMAP_THRESHOLD = 128 << 10  # glibc's own starting value, kept


def give_large_frees_back() -> bool:
    """Fix glibc's mmap threshold; False where that cannot be done (not glibc: musl maps large blocks anyway)."""
    try:
        # The symbols the process has loaded already (libc's among them): nothing to look up or to spawn
        # (ctypes.util.find_library runs ldconfig), in a server that is starting.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        log.debug("mallopt(M_MMAP_THRESHOLD) was refused: a large body's memory may stay with this process")
        return False
    return True
