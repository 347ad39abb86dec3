"""Freed memory kept for the next batch: glibc's malloc, tuned for forwards on a CPU.

A CPU forward allocates its activations (tens of MiB per batch: a batch of 16
images of the ``--quick`` tower makes MLP intermediates of ~23 MB) and frees them
when the batch ends; the next batch asks for the same again. Left alone, glibc
serves every block over its mmap threshold (128 KiB, rising to at most 32 MiB
as such blocks are freed) with a fresh ``mmap`` and gives it back with
``munmap``, and trims what is freed at the top of the heap past twice that:
the kernel then zeroes every page again on first touch. Measured on the
2-core AMD machine (``tools/bench_engine.py``'s ``--quick`` tower, batches of
336×336 images, ms and page faults per image, the first pass at each size):
batch 8 96–132 ms and 4–41 × 10³ faults, batch 24 126–155 ms, 40–67 × 10³
faults and 65–106 ms of system CPU, against 90–105 ms and under 8 × 10³ faults
(none once the heap has grown) for batches of 8–24 with the tuning below.
Larger batches then cost no more per image than small ones, which is what
makes batching a free choice on a CPU.

The tuning is process-wide and cannot be undone exactly (glibc has no getter,
and setting a value turns its dynamic threshold off for good), so it belongs to
whoever owns the process: ``epd-trio encoder`` applies it on a CPU device unless
``--no-cpu-keep-freed-memory``; a program that embeds an engine calls
``keep_freed_memory()`` itself, as ``tools/bench_engine.py`` does. The cost is
memory: the heap keeps its high-water mark (less what passes ``trim_bytes`` at
its top) instead of handing freed blocks back.
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = ["KEEP_TOP_BYTES", "keep_freed_memory"]

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

KEEP_TOP_BYTES = 1 << 30  # free memory kept at the heap's top before glibc trims it


def keep_freed_memory(trim_bytes: int = KEEP_TOP_BYTES) -> bool:
    """Have glibc's malloc keep freed blocks for reuse; True when applied.

    No block is served by ``mmap`` (``M_MMAP_MAX`` 0: large ones come from the
    heap, and freeing them keeps their pages), and the heap's free top is trimmed
    only past ``trim_bytes``. A worker thread's arena still maps a block over
    its 64 MiB heap size (glibc does so even with mmap off), so the very largest
    activations are still handed back. Not glibc (musl, macOS): nothing to do.
    """
    if trim_bytes < 0 or trim_bytes >= 1 << 31:
        raise ValueError(f"trim_bytes must be in 0..2**31-1 (mallopt takes an int), "
                         f"got {trim_bytes}")
    libc, version = platform.libc_ver()
    if libc != "glibc":
        log.info("malloc left as it is: the C library is %s, not glibc", libc or "unknown")
        return False
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, trim_bytes)):
        log.warning("glibc %s refused the malloc tuning (mallopt): freed memory goes "
                    "back to the kernel as usual", version)
        return False
    log.info("glibc %s malloc keeps freed memory for the next batch (no mmap; trim past %d MiB)",
             version, trim_bytes >> 20)
    return True
