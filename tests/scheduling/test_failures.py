"""Telling a dead device from an out-of-memory one and from a bad input."""

from __future__ import annotations

import pytest
import torch

from epd_trio.errors import EncodeError, WorkerDeadError
from epd_trio.scheduling.failures import is_device_error, is_device_out_of_memory

CUDA_CRASH = "CUDA error: an illegal memory access was encountered"


def chained(exc: BaseException, cause: BaseException) -> BaseException:
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize(("exc", "device"), [
    (RuntimeError(CUDA_CRASH), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),  # see below
    (RuntimeError("device-side assert triggered"), True),
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`"), True),
    (WorkerDeadError("injected"), True),
    (RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1 GB"), False),
    (RuntimeError("shape '[2, 3]' is invalid for input of size 7"), False),
    (ValueError("cuda"), False),  # not a RuntimeError: an input problem raised by our code
    (EncodeError("encoder produced 3 tokens, expected 4"), False),
    # By type, whatever the message says.
    (torch.OutOfMemoryError("Tried to allocate 2.00 GiB"), False),
    (torch.AcceleratorError("an illegal memory access was encountered"), True),
    (type("CudaError", (RuntimeError,), {})("an illegal memory access was encountered"), True),
    (RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"), True),
    # Ordinary mistakes name the device or a kernel on a GPU: not the device's failure.
    (RuntimeError("Expected all tensors to be on the same device, but found at least two "
                  "devices, cuda:0 and cpu!"), False),
    (RuntimeError("Input type (torch.cuda.FloatTensor) and weight type "
                  "(torch.cuda.BFloat16Tensor) should be the same"), False),
    (RuntimeError("\"addmm_cuda\" not implemented for 'Int'"), False),
    # torch.compile (and others) wrap what they meet: the cause counts.
    (chained(ValueError("compiling failed"), RuntimeError(CUDA_CRASH)), True),
    (chained(ValueError("bad input"), KeyError("pixel_values")), False),
])
def test_device_errors_are_told_from_input_errors(exc: BaseException, device: bool) -> None:
    assert is_device_error(exc) is device


@pytest.mark.parametrize(("exc", "oom"), [
    (torch.OutOfMemoryError("Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (chained(ValueError("compiling failed"), torch.OutOfMemoryError("CUDA out of memory")), True),
    (RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1 GB"), False),
    (RuntimeError(CUDA_CRASH), False),
    (ValueError("CUDA out of memory"), False),  # not torch's: our own code's words
])
def test_device_out_of_memory_is_recognised(exc: BaseException, oom: bool) -> None:
    assert is_device_out_of_memory(exc) is oom
    if oom:  # the worker lives on: the allocator recovers from it
        assert not is_device_error(exc)


def test_a_cycle_in_the_chain_ends() -> None:
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert not is_device_error(a) and not is_device_out_of_memory(a)
