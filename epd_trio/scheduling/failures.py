"""What a failed forward means: the device is gone, it ran out of memory, or one input was bad.

The scheduler acts on the answer. A *device error* leaves the CUDA context
unusable (an illegal access, a device-side assert, a launch failure): the
worker is marked dead and its queue runs on the other devices. *Running out of
device memory* is not that: the caching allocator recovers, so the batch is
retried one request at a time (a smaller batch may fit) and a request that
still does not fit fails alone with 503. Anything else is an input's (or the
code's) problem: the batch is retried one request at a time, so one bad input
fails alone.

Torch (and torch.compile, which wraps what it meets while compiling) may
raise these as the cause of another exception, so the whole chain is read.
"""

from __future__ import annotations

from collections.abc import Iterator

from epd_trio.errors import OverloadedError, WorkerDeadError

__all__ = ["is_device_error", "is_device_out_of_memory", "raise_if_device_failure"]

# Lower-cased fragments of the messages torch raises when a device (not an
# input) failed: CUDA errors, device-side asserts, Triton's CUDA errors, and
# the CUDA libraries' own failures. Not a bare "cuda": on a GPU ordinary
# mistakes name the device or a kernel too ("... two devices, cuda:0 and
# cpu!", "Input type (torch.cuda.FloatTensor) and weight type ...",
# '"addmm_cuda" not implemented for ...'), and one request that hits such a
# path must fail alone, not kill every device in turn.
_DEVICE_ERROR_MARKERS = (
    "cuda error", "cuda driver", "cuda call failed", "error [cuda]",
    "device-side assert", "illegal memory access", "unspecified launch failure",
    "cublas", "cudnn", "cufft error", "cusolver error", "nccl", "nvml",
)
_DEVICE_ERROR_TYPES = ("AcceleratorError", "CudaError")  # by name: absent from older torch


def is_device_error(exc: BaseException) -> bool:
    """Whether the device failed (mark the worker dead), not the input or its size.

    True for an injected (or re-raised) ``WorkerDeadError``, torch's
    ``AcceleratorError`` and ``torch.cuda.CudaError``, and a ``RuntimeError``
    whose message reports a CUDA error, a device-side assert or a CUDA
    library's failure — anywhere in the cause chain. Device out-of-memory is
    not one (see ``is_device_out_of_memory``).
    """
    return any(_is_device_error(e) for e in _chain(exc))


def is_device_out_of_memory(exc: BaseException) -> bool:
    """Whether a device's allocator ran out (torch's ``OutOfMemoryError``, "CUDA out of
    memory"); a CPU allocation failure is a plain ``RuntimeError`` and is not one."""
    return any(type(e).__name__ == "OutOfMemoryError" or "cuda out of memory" in str(e).lower()
               for e in _chain(exc) if isinstance(e, RuntimeError))


def raise_if_device_failure(exc: BaseException, item: str, device: str) -> None:
    """For work on a device other than the forward (preprocessing): raise what ``exc`` means
    when it is the device's, not the input's — out of memory a 503 (retry later), a failed
    device ``exc`` itself (a 500, its traceback in the log). Else return: the caller's 400."""
    if is_device_out_of_memory(exc):
        raise OverloadedError(f"{item}: the preprocessing device ({device}) is out of memory") from None
    if is_device_error(exc):
        raise exc


def _is_device_error(exc: BaseException) -> bool:
    if isinstance(exc, WorkerDeadError):
        return True
    if not isinstance(exc, RuntimeError) or type(exc).__name__ == "OutOfMemoryError":
        return False
    if type(exc).__name__ in _DEVICE_ERROR_TYPES:
        return True
    message = str(exc).lower()
    return any(marker in message for marker in _DEVICE_ERROR_MARKERS)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then its causes (explicit, else implicit), each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
