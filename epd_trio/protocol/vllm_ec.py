"""vLLM 0.32's Mooncake EC control plane, a producer's side of it, sans-IO.

vLLM's ``ECMooncakeConnector`` consumer binds a ZMQ REP socket on every
receiving tensor-parallel rank (a *shard*: ``ec_ip``, port ``ec_port`` + rank)
and answers JSON requests ``{"op": ...}`` with ``{"ok": true, "result": ...}``
or ``{"ok": false, "error": str}``. A producer connects REQ sockets and uses:

- ``peers`` → ``{"ports": [...]}``: every shard's port, on the same host;
- ``reserve_batch`` ``{"items": [{transfer_id, mm_hash, nbytes, shape, dtype}]}``
  → ``{"items": [{"ok", "result" | "error"}]}``, a result being where to write
  (``reservation_id``, ``dst_session`` host:port of the consumer's transfer
  engine, ``dst_ptr``, ``nbytes``) and what to do: ``write`` (false when
  another transfer already writes that ``mm_hash``), ``ready``/``cached``
  (the consumer holds it already), or ``cancelled`` (the consumer gave the
  transfer up);
- ``complete_batch`` ``{"items": [{transfer_id, reservation_id}]}`` after the
  bytes are written → ``{"items": [{"completed", "became_ready"}]}``;
- ``cancel`` ``{transfer_id, reservation_id, "abandon": true}`` →
  ``{"cancelled": bool}``: a producer lets go of a reservation it will not
  complete (an empty ``reservation_id`` names the transfer's, whatever it is).

(``status`` and ``event_port`` serve the consumer's own scheduler.) Replies
are checked here field by field: a peer's reply is data, never trusted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from epd_trio.errors import PeerUnavailable, ProtocolError

__all__ = [
    "MAX_SHARDS",
    "PushItem",
    "Reservation",
    "cancel_request",
    "complete_batch_request",
    "parse_cancelled",
    "parse_completions",
    "parse_reservations",
    "reserve_batch_request",
    "result_of",
    "shard_endpoints",
]

MAX_SHARDS: Final = 64  # tensor-parallel ranks of one consumer; more is not a consumer
PEERS: Final = {"op": "peers"}
_SESSION: Final = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")


@dataclass(frozen=True)
class PushItem:
    """One item's embedding, as a producer announces it in ``reserve``."""

    transfer_id: str
    mm_hash: str
    shape: tuple[int, int]
    dtype: str  # torch's name: float32, bfloat16, float16
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"transfer_id": self.transfer_id, "mm_hash": self.mm_hash, "nbytes": self.nbytes,
                "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class Reservation:
    """A shard's answer to one item of ``reserve_batch``."""

    reservation_id: str
    session: str  # the consumer's transfer engine, host:rpc_port
    address: int
    nbytes: int
    write: bool
    ready: bool
    cached: bool
    cancelled: bool

    @property
    def writable(self) -> bool:
        """Ours to write and complete (vLLM's producer writes exactly these)."""
        return self.write and not self.cached and not self.cancelled


def result_of(reply: Any, what: str) -> Any:
    """The ``result`` of a reply; a refusal is ``PeerUnavailable`` with the consumer's reason."""
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise ProtocolError(f"{what}: the EC consumer's reply is not {{ok, result | error}}")
    if not reply["ok"]:
        raise PeerUnavailable(f"{what}: the EC consumer refused: {_text(reply.get('error'))}")
    return reply.get("result")


def shard_endpoints(consumer: str, result: Any) -> tuple[str, ...]:
    """Each shard's control endpoint, from ``peers``: the consumer's host, each port."""
    ports = result.get("ports") if isinstance(result, dict) else None
    if not isinstance(ports, list) or not 1 <= len(ports) <= MAX_SHARDS or \
            not all(_is_int(p) and 1 <= p <= 65535 for p in ports):
        raise ProtocolError(f"peers: {consumer} did not name 1..{MAX_SHARDS} ports")
    host = consumer.rsplit(":", 1)[0]
    return tuple(dict.fromkeys(f"{host}:{port}" for port in ports))


def reserve_batch_request(items: Sequence[PushItem]) -> dict[str, Any]:
    return {"op": "reserve_batch", "items": [item.to_json() for item in items]}


def parse_reservations(result: Any, count: int) -> list[Reservation | str]:
    """Per item, its ``Reservation`` or the consumer's reason for refusing it."""
    items = result.get("items") if isinstance(result, dict) else None
    if not isinstance(items, list) or len(items) != count:
        raise ProtocolError(f"reserve_batch: the reply does not hold {count} items")
    parsed: list[Reservation | str] = []
    for entry in items:
        if not isinstance(entry, dict) or not isinstance(entry.get("ok"), bool):
            raise ProtocolError("reserve_batch: an item of the reply is not {ok, result | error}")
        parsed.append(_reservation(entry.get("result")) if entry["ok"] else _text(entry.get("error")))
    return parsed


def _reservation(result: Any) -> Reservation:
    if not isinstance(result, dict):
        raise ProtocolError("reserve_batch: a reservation is not an object")
    flags = {name: result.get(name, False) for name in ("write", "ready", "cached", "cancelled")}
    flags["write"] = result.get("write", True)
    rid, session = result.get("reservation_id", ""), result.get("dst_session", "")
    address, nbytes = result.get("dst_ptr", 0), result.get("nbytes", 0)
    if not all(isinstance(v, bool) for v in flags.values()) or not isinstance(rid, str) or \
            not isinstance(session, str) or not _is_int(address) or not _is_int(nbytes):
        raise ProtocolError("reserve_batch: a reservation's fields have the wrong types")
    reservation = Reservation(rid, session, address, nbytes, **flags)
    if reservation.writable and not (_SESSION.fullmatch(session) and rid and address > 0 and nbytes > 0):
        raise ProtocolError(f"reserve_batch: a reservation to write has no usable destination "
                            f"({session!r:.80} at {address})")
    return reservation


def complete_batch_request(done: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """``done``: (transfer_id, reservation_id) of each item written."""
    return {"op": "complete_batch",
            "items": [{"transfer_id": tid, "reservation_id": rid} for tid, rid in done]}


def parse_completions(result: Any, count: int) -> list[bool]:
    """Per item, whether the consumer took the completion (it knew the reservation)."""
    items = result.get("items") if isinstance(result, dict) else None
    if not isinstance(items, list) or len(items) != count or \
            not all(isinstance(i, dict) and isinstance(i.get("completed"), bool) for i in items):
        raise ProtocolError(f"complete_batch: the reply does not hold {count} completions")
    return [i["completed"] for i in items]


def cancel_request(transfer_id: str, reservation_id: str) -> dict[str, Any]:
    """Let go of a reservation this producer will not complete (vLLM's ``abandon``)."""
    return {"op": "cancel", "transfer_id": transfer_id, "reservation_id": reservation_id,
            "abandon": True}


def parse_cancelled(result: Any) -> bool:
    if not isinstance(result, dict) or not isinstance(result.get("cancelled"), bool):
        raise ProtocolError("cancel: the reply does not say whether it cancelled")
    return bool(result["cancelled"])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: Any) -> str:
    return value[:300] if isinstance(value, str) else "no reason given"
