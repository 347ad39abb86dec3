"""vLLM's shared-storage EC delivery: one safetensors file per item, named by its ``mm_hash``.

The layout is vLLM 0.32's ``ECExampleConnector``: ``{path}/{mm_hash}/
encoder_cache.safetensors`` holding one tensor ``ec_cache`` of shape
``(embeddings, width)`` in the encoder's dtype (Qwen3-VL: its embedding and
each DeepStack level side by side, as vLLM's own encoder concatenates them). A
vLLM consumer on the same path finds the file when it schedules the item and
loads it instead of running its encoder.

A consumer must never read half a file: each is written under a temporary
name in its own directory, flushed to disk (``fsync``), then renamed over
the final name, and the directory is synced so the rename survives a crash.
An item that appears twice in a request is written once. A file already
there is replaced (same name, same content).

The request's ``hashes`` are the items' ``mm_hash``es (the vLLM face computes
them); the answer is the request's metadata, from which the face builds
``ec_transfer_params``. Nothing listens for a failure: a consumer that finds
no file runs vLLM's own encoder, so ``fail`` has no one to tell.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

import trio

from epd_trio.delivery.base import Answer, DeliveryContext, map_exceptions
from epd_trio.errors import EPDError, PeerUnavailable, RequestError
from epd_trio.protocol.requests import EncodeMeta, EncodeRequest

if TYPE_CHECKING:
    import torch

__all__ = ["FILE_NAME", "TENSOR_NAME", "VllmStorageDelivery", "write_item"]

FILE_NAME: Final = "encoder_cache.safetensors"
TENSOR_NAME: Final = "ec_cache"


def write_item(root: Path, mm_hash: str, embedding: torch.Tensor) -> Path:
    """Write one item's ``embedding`` atomically under ``root/mm_hash`` (blocking)."""
    from safetensors.torch import save

    data = save({TENSOR_NAME: embedding.detach().to("cpu").contiguous()})
    folder = root / mm_hash
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / FILE_NAME
    temporary = folder / f".{FILE_NAME}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, final)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    _sync_directory(folder)
    return final


def _sync_directory(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class VllmStorageDelivery:
    """Writes each item of one request into vLLM's shared storage."""

    def __init__(self, root: Path, hashes: Sequence[str], threads: trio.CapacityLimiter) -> None:
        self.root = root
        self.hashes = tuple(hashes)
        self._threads = threads

    @classmethod
    def for_request(cls, request: EncodeRequest, context: DeliveryContext) -> VllmStorageDelivery:
        if context.vllm_storage is None:
            raise RequestError("this encoder has no vLLM shared storage (--ec-transfer-config)",
                               req_id=request.req_id)
        if request.hashes is None or len(request.hashes) != len(request.mm_items):
            raise RequestError("a vLLM delivery needs one mm_hash per item", req_id=request.req_id)
        return cls(Path(context.vllm_storage), request.hashes, context.threads)

    def admitted(self) -> None:
        """Nothing to announce: the consumer looks for the files by name."""

    def sized(self, meta: EncodeMeta) -> Answer | None:
        return None  # nothing to reserve: the files appear when they are whole

    async def deliver(self, embedding: torch.Tensor, meta: EncodeMeta) -> Answer:
        if len(meta.token_counts) != len(self.hashes):
            raise EPDError(f"{len(meta.token_counts)} embeddings for {len(self.hashes)} items")
        with map_exceptions({OSError: PeerUnavailable}, f"writing to the shared storage {self.root}"):
            await trio.to_thread.run_sync(self._write_all, embedding, meta.token_counts,
                                          limiter=self._threads)
        return Answer(meta)

    def _write_all(self, embedding: torch.Tensor, token_counts: Sequence[int]) -> None:
        start, written = 0, set()
        for mm_hash, count in zip(self.hashes, token_counts, strict=True):
            if mm_hash not in written:
                write_item(self.root, mm_hash, embedding[start:start + count])
                written.add(mm_hash)
            start += count

    async def fail(self, error: EPDError) -> None:
        return None  # a consumer without the file encodes the item itself

    async def aclose(self) -> None:
        return None
