"""``tensor_bytes``: the bytes of a tensor as they leave, without a torch op on the caller's thread."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from epd_trio.protocol import encode_safetensors
from epd_trio.protocol.payload import Payload, split_frames, tensor_bytes

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def reference(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


class TorchCalls(TorchFunctionMode):
    """The torch functions called in the block, by name (this thread's only: modes are per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


# What a contiguous CPU tensor's bytes may cost: attribute reads and calls that keep the GIL.
# A dispatched op (view, detach, cpu, contiguous, numpy, reshape) releases it, and the
# thread then waits for any other thread running Python to give it back.
GIL_KEEPING = {"__get__", "data_ptr", "is_contiguous", "dim"}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bytes_equal_the_tensors_for_every_dtype_and_offset(dtype: torch.dtype) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10).to(dtype)
    for t in (base, base[2:], base[1:3], base[:, 2:5], base.t()):
        view = tensor_bytes(t)
        assert view.readonly and view.format == "B" and view.nbytes == t.nbytes
        assert bytes(view) == reference(t)
    assert tensor_bytes(base[:0]).nbytes == 0


def test_the_view_keeps_the_tensor_alive() -> None:
    t = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    expected = reference(t)
    alive = weakref.ref(t)
    view = tensor_bytes(t)
    del t
    gc.collect()
    assert alive() is not None and bytes(view) == expected
    del view
    gc.collect()
    assert alive() is None


def test_a_contiguous_cpu_tensor_costs_no_dispatched_op() -> None:
    t = torch.zeros(4, 64, dtype=torch.bfloat16)
    with TorchCalls() as calls:
        tensor_bytes(t)
        encode_safetensors(t, dict(req_id="r", part_idx=0, num_parts=1, modality="image",
                                   token_counts=[4], grid_thw=[[1, 4, 4]]))
    assert set(calls.names) <= GIL_KEEPING, calls.names
    with TorchCalls() as strided:
        tensor_bytes(t.t())  # not contiguous: one copy, which is a torch op
    assert "contiguous" in strided.names


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_payload_copies_into_its_rows_of_a_larger_tensor_and_nowhere_else(dtype: torch.dtype) -> None:
    part = torch.arange(24, dtype=torch.float32).reshape(3, 8).to(dtype)
    payload = Payload.gather(split_frames(tensor_bytes(part), 10), dtype, (3, 8))
    dest = torch.full((10, 8), -1.0).to(dtype)
    with TorchCalls() as calls:
        payload.copy_into(dest, 4)
    assert set(calls.names) <= GIL_KEEPING | {"dim"}, calls.names
    assert torch.equal(dest[4:7].view(torch.uint8), part.view(torch.uint8))
    assert bool((dest[:4] == -1).all()) and bool((dest[7:] == -1).all())
    for row in (-1, 8):
        with pytest.raises(ValueError, match=f"from row {row}"):
            payload.copy_into(dest, row)
