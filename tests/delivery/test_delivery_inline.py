"""Inline delivery: the answer's body, and large bodies built off the event loop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import trio

from epd_trio.delivery import inline
from epd_trio.delivery.inline import InlineDelivery
from epd_trio.protocol.codec import decode_safetensors
from epd_trio.protocol.requests import EncodeMeta


def meta_for(embedding: torch.Tensor) -> EncodeMeta:
    tokens, dim = embedding.shape
    return EncodeMeta(req_id="r", part_idx=0, num_parts=1, modality="image", tokens=tokens,
                      dim=dim, dtype="float32", token_counts=[tokens], grid_thw=[[1, 2, tokens * 2]])


async def test_the_body_is_the_protocols_safetensors_file() -> None:
    embedding = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    answer = await InlineDelivery(threads=trio.CapacityLimiter(1)).deliver(embedding, meta_for(embedding))
    assert answer.body is not None and answer.nbytes is None
    tensor, values = decode_safetensors(answer.body)
    assert torch.equal(tensor, embedding)
    assert (values["req_id"], values["token_counts"], values["grid_thw"]) == ("r", [3], [[1, 2, 6]])


@pytest.mark.parametrize("big", [False, True])
async def test_a_large_body_is_built_in_a_worker_thread_while_the_loop_runs(
        big: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build waits until another trio task has run: possible only off the loop.

    On the loop the build would block the task it waits for, so the small
    (on-loop) case must see no progress, and the large one must."""
    loop_ran = threading.Event()
    seen: dict[str, Any] = {}
    real = inline.encode_safetensors

    def build(embedding: torch.Tensor, metadata: Any) -> bytes:
        seen["thread"] = threading.get_ident()
        seen["loop_ran"] = loop_ran.wait(timeout=None if big else 0.05)
        return real(embedding, metadata)

    async def other_request() -> None:
        await trio.lowlevel.checkpoint()
        loop_ran.set()

    monkeypatch.setattr(inline, "encode_safetensors", build)
    delivery = InlineDelivery(threads=trio.CapacityLimiter(1), offload_bytes=1024)
    embedding = torch.zeros(64 if big else 4, 4)  # 1 KiB: at the threshold; 64 B: below
    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_request)
        with trio.fail_after(30):
            answer = await delivery.deliver(embedding, meta_for(embedding))
    assert answer.body is not None
    assert seen["loop_ran"] is big
    assert (seen["thread"] != threading.get_ident()) is big
    assert delivery.built_off_loop == int(big)
