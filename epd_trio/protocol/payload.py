"""An embedding's bytes as they travel: cut into frames on the way out, gathered on the way in.

Why frames of ``PAYLOAD_FRAME_BYTES`` rather than one frame per tensor: libzmq
``malloc``s every received frame, and glibc serves a block above its mmap
threshold (at most 32 MiB) with fresh pages the kernel must fault in and zero,
for every message — slower than loopback TCP itself (``fresh buffer`` in
``tools/bench_transfer.py``). Blocks of 1 MiB stay under the threshold after
the first message, so the receiver's allocator hands back memory that is
already resident. Sending cuts views of the tensor (no copy); receiving keeps
the frames as they are until ``copy_into`` puts them where they belong — the
one copy a receiver makes anyway (into its pool slot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from epd_trio.errors import ProtocolError

__all__ = ["MAX_PAYLOAD_FRAMES", "PAYLOAD_FRAME_BYTES", "Payload", "split_frames", "tensor_bytes"]

PAYLOAD_FRAME_BYTES: Final = 1 << 20
# 512 MiB in 1 MiB frames is 512; a peer's million one-byte frames is refused.
MAX_PAYLOAD_FRAMES: Final = 1 << 14


class _HostMemory:
    """A CPU tensor's bytes as numpy's array interface, keeping the tensor alive.

    Why not ``tensor.view(torch.uint8).numpy()``: every torch op releases the GIL
    around its dispatch, and on a thread that must then wait for another thread
    running Python (a preprocessing worker, the device thread) to give it back,
    one op cost ~200 us of CPU and ~5-8 ms of wall time (measured on the trio
    thread beside a busy thread). ``data_ptr`` and ``nbytes``
    keep the GIL, so this view costs ~2 us either way.
    """

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor: torch.Tensor, *, writable: bool = False) -> None:
        self.tensor = tensor  # the array's base is this holder: the tensor outlives every view
        self.__array_interface__ = {"data": (tensor.data_ptr(), not writable),
                                    "shape": (tensor.nbytes,), "typestr": "|u1", "version": 3}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat, read-only byte view of ``tensor``'s memory (copied only if not contiguous CPU).

    A contiguous CPU tensor is viewed without a torch op (``_HostMemory`` says
    why; this also sidesteps bfloat16 having no numpy dtype). The memoryview
    keeps the tensor alive; its bytes must not change until the send is done.
    """
    t = tensor
    if not (t.is_cpu and t.is_contiguous()):
        t = t.detach().cpu().contiguous()
    if not t.nbytes:
        return memoryview(b"")  # cast() refuses a shape with a zero in it
    # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12; 3.11 has the protocol too.
    return memoryview(np.asarray(_HostMemory(t))).cast("B")  # type: ignore[arg-type]


def split_frames(data: memoryview, frame_bytes: int = PAYLOAD_FRAME_BYTES) -> list[memoryview]:
    """``data`` as consecutive views of at most ``frame_bytes`` (one frame when empty)."""
    if frame_bytes < 1:
        raise ValueError("frame_bytes must be >= 1")
    if -(-data.nbytes // frame_bytes) > MAX_PAYLOAD_FRAMES:
        raise ValueError(f"{data.nbytes} bytes in frames of {frame_bytes} exceed"
                         f" {MAX_PAYLOAD_FRAMES} frames")
    return [data[i:i + frame_bytes] for i in range(0, data.nbytes, frame_bytes)] or [data]


@dataclass(frozen=True, eq=False)
class Payload:
    """A tensor's bytes in one or more buffers, in order; nothing copied yet.

    The buffers alias what was received (ZMQ frames, an inline body), so a
    ``Payload`` is consumed soon: ``copy_into`` a destination, or ``tensor()``.
    """

    dtype: torch.dtype
    shape: tuple[int, int]
    frames: tuple[memoryview, ...]

    @classmethod
    def gather(cls, frames: Sequence[memoryview], dtype: torch.dtype,
               shape: tuple[int, int]) -> Payload:
        """Check that ``frames`` hold exactly the tensor's bytes; ``ProtocolError`` if not."""
        if not 1 <= len(frames) <= MAX_PAYLOAD_FRAMES:
            raise ProtocolError(f"{len(frames)} tensor frames (1 to {MAX_PAYLOAD_FRAMES} allowed)")
        payload = cls(dtype, shape, tuple(frames))
        expected = shape[0] * shape[1] * dtype.itemsize
        if payload.nbytes != expected:
            raise ProtocolError(f"tensor frames have {payload.nbytes} bytes, header says {expected}")
        return payload

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Payload:
        """A payload over a (CPU, contiguous, 2-D) tensor's own memory."""
        return cls(tensor.dtype, (tensor.shape[0], tensor.shape[1]), (tensor_bytes(tensor),))

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.frames)

    def copy_into(self, dest: torch.Tensor, first_row: int = 0) -> None:
        """Copy the bytes into rows ``first_row``.. of ``dest`` (contiguous CPU, this dtype and
        width, rows enough); blocking. Rows are addressed here, not sliced by the caller, so
        the copy runs no torch op (``_HostMemory``)."""
        rows, dim = self.shape
        if dest.dtype != self.dtype or dest.dim() != 2 or dest.shape[1] != dim \
                or not 0 <= first_row <= dest.shape[0] - rows or not (dest.is_cpu and dest.is_contiguous()):
            raise ValueError(f"destination {dest.dtype} {tuple(dest.shape)} from row {first_row} cannot"
                             f" take a contiguous CPU {self.dtype} {self.shape}")
        if self.nbytes == 0:
            return
        # numpy, not torch.frombuffer: a read-only buffer (bytes) copies without a warning.
        flat = np.asarray(_HostMemory(dest, writable=True))
        offset = first_row * dim * self.dtype.itemsize
        for frame in self.frames:
            flat[offset:offset + frame.nbytes] = np.frombuffer(frame, dtype=np.uint8)
            offset += frame.nbytes

    def tensor(self) -> torch.Tensor:
        """The tensor: a view of a single writable frame, else one new copy."""
        if len(self.frames) == 1 and not self.frames[0].readonly and self.nbytes:
            return torch.frombuffer(self.frames[0], dtype=self.dtype).view(self.shape)
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(out)
        return out
