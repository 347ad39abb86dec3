"""The demultiplexer's routing table, driven directly: which messages a part keeps."""

from __future__ import annotations

from epd_trio.client.demux import Demultiplexer
from epd_trio.client.routing import Part
from epd_trio.client.state import LiveRequest, PartState
from epd_trio.errors import RequestError
from epd_trio.protocol.messages import EmbeddingHeader, ErrorInfo

URL = "http://enc0:8000"


def live(req_id: str, parts: int) -> LiveRequest:
    states = [PartState(Part(i, "image", URL, (i,)), URL) for i in range(parts)]
    return LiveRequest(req_id, {}, states)


def header(req_id: str, part_idx: int, kind: str = "embedding") -> EmbeddingHeader:
    error = ErrorInfo(type="EncodeError", message="boom", status=500) if kind == "error" else None
    return EmbeddingHeader(v=1, kind=kind, req_id=req_id, part_idx=part_idx, num_parts=2,  # type: ignore[arg-type]
                           modality="image", dtype="float32", shape=(4, 8), token_counts=[4],
                           grid_thw=[[1, 4, 4]], error=error)


def test_an_embedding_for_a_failed_request_is_dropped_not_kept() -> None:
    demux, req = Demultiplexer(), live("r1", 2)
    demux.register(req)
    demux._deliver(header("r1", 0), None)
    assert req.parts[0].message is not None and req.parts[0].arrived.is_set()
    req.fail(RequestError("part 0 was refused"))
    demux._deliver(header("r1", 1), None)
    assert req.parts[1].message is None and not req.parts[1].arrived.is_set()
    assert demux.statistics().messages_dropped == 1


def test_an_error_for_a_failed_request_still_marks_its_part_answered() -> None:
    """The encoder is done with that part: no /abort is owed for it."""
    demux, req = Demultiplexer(), live("r1", 2)
    demux.register(req)
    demux._deliver(header("r1", 0, "error"), None)
    first = req.failure
    assert first is not None and req.parts[0].answered
    demux._deliver(header("r1", 1, "error"), None)
    assert req.parts[1].answered and req.parts[1].arrived.is_set()
    assert req.failure is first  # the first failure wins
    assert demux.statistics().messages_dropped == 0
