"""Inline: each part's embedding comes back in its ``/encode`` answer (a safetensors body).

No socket and no engine of the client's own: simple set-ups, and a client whose
parts bring nothing back to its pool (``encode_for_vllm``). A part is done when
its answer is; the answers' payloads are copied into one slot
(``CopyingReceiver``).
"""

from __future__ import annotations

from typing import Any

import trio

from epd_trio.client.answers import Answer, inline_message
from epd_trio.client.calls import EncoderCalls
from epd_trio.client.receiving.base import CopyingReceiver
from epd_trio.client.state import LiveRequest, PartState

__all__ = ["InlineReceiver"]


class InlineReceiver(CopyingReceiver):
    """Parts in the answers themselves."""

    async def deliver_for(self, encoder_url: str) -> dict[str, Any]:
        return {"backend": "inline"}

    async def take(self, req: LiveRequest, state: PartState, answer: Answer,
                   calls: EncoderCalls) -> None:
        state.message = inline_message(answer, req.req_id, state.part, len(req.parts),
                                       state.encoder_url)
        state.finished = trio.current_time()
