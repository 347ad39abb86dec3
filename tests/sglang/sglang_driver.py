"""SGLang 0.5.23's own code, run for the interop tests in a subprocess.

The tests start this script with ``.sglang`` (``tools/sglang_env.sh``) on
``PYTHONPATH`` so that SGLang's tree never enters the test process; it imports
nothing from epd_trio. Lines meant for the test start with ``EPD-DRIVER``
(SGLang prints other things on stdout). Modes:

``decode DIR``
    For each case in ``DIR/manifest.json``, read its messages as SGLang's
    ``zmq_to_tokenizer`` receiver does (``safe_pickle_loads`` of frame 0, the
    part-id check, frame 1 into a tensor, ``MultiModalEmbeddingData`` merging),
    and write what SGLang saw to ``DIR/result.json`` and the tensors to
    ``DIR/result.safetensors``. A frame-0-only message that is no error (a
    Mooncake completion notice) is read, not merged: its bytes came by RDMA.
``decode-serve``
    The same for each directory read from stdin, one per line, in one process
    (SGLang's receiver is imported once): print ``READY``, then ``DONE <n>`` or
    ``FAILED <why>`` per directory (the traceback goes to stderr).
``registration-serve``
    SGLang's registration code, imported once, for commands read from stdin,
    one per line (print ``READY`` first):

    ``bootstrap``: run SGLang's ``EncoderBootstrapServer`` on 127.0.0.1, port 0;
    print ``PORT <port>``. ``urls``: print ``URLS <json>``, the URLs it holds, and
    stop it. ``register REGISTRY HOST PORT [HOST PORT ...]``: register an encoder
    at each HOST:PORT with SGLang's own encoder-side code
    (``http_server._register_encoder_url_with_bootstrap``); print ``REGISTERED``
    and the pairs. ``unregister``: unregister them the same way; print
    ``UNREGISTERED`` and the pairs. A warning from that code (a non-200 answer)
    ends the process at once with ``FAILED``.
``serve``
    Be an SGLang language server's encoder-facing half (``sglang_language_side.py``):
    print ``READY``, then for each JSON command line on stdin run one request
    through SGLang's own receiver code against real encoders and print
    ``RESULT <json>``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from enum import Enum
from pathlib import Path
from typing import Any


def say(*words: object) -> None:
    print("EPD-DRIVER", *words, flush=True)


def jsonable(value: Any) -> Any:
    """What SGLang decoded, as JSON the test can compare (it never unpickles)."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return {"tensor": {"dtype": str(value.dtype), "shape": list(value.shape),
                           "values": value.tolist()}}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value)}
    if isinstance(value, Enum):
        cls = type(value)
        return {"enum": f"{cls.__module__}.{cls.__qualname__}", "name": value.name,
                "value": value.value}
    return {"other": f"{type(value).__module__}.{type(value).__qualname__}", "repr": repr(value)}


def decode_case(name: str, case: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """Mirror ``MMReceiverBase._recv_mm_data`` on each message of one request."""
    import zmq
    from sglang.srt.disaggregation.encoder import receiver
    from sglang.srt.utils.common import safe_pickle_loads

    parts: list[dict[str, Any]] = []
    merged = None
    for index, files in enumerate(case["messages"]):
        frames = [zmq.Frame(Path(f).read_bytes()) for f in files]
        try:
            obj = safe_pickle_loads(frames[0])
        except Exception as exc:  # noqa: BLE001 - what SGLang's receiver would log and drop
            parts.append({"refused": f"{type(exc).__name__}: {exc}"})
            continue
        record: dict[str, Any] = {
            "class": f"{type(obj).__module__}.{type(obj).__qualname__}",
            "state": jsonable(vars(obj)),
            "receivers_modality": obj.modality is receiver.Modality(obj.modality.value),
        }
        record["matches"] = receiver._embedding_part_matches_request(obj, case["rid"])
        record["req_id_after_match"] = obj.req_id
        parts.append(record)
        if obj.error_msg is not None or not record["matches"] or len(frames) == 1:
            continue  # an error, another request's part, or a Mooncake completion notice
        receiver.WaitingZmqRequest._extract_embedding_from_buffer(None, obj, frames)
        tensors[f"{name}/part{index}"] = obj.embedding
        merged = receiver._aggregate_embedding_part(merged, obj, case.get("model_type"))
    result: dict[str, Any] = {"parts": parts, "ready": merged is not None and merged.ready}
    if result["ready"]:
        for modality, tensor in merged.get_embedding(is_concat=True).items():
            tensors[f"{name}/merged/{modality.name}"] = tensor.contiguous()
        result["extra_meta"] = jsonable(merged.get_mm_extra_meta())
    return result


def decode(directory: Path) -> None:
    from safetensors.torch import save_file

    manifest = json.loads((directory / "manifest.json").read_text())
    tensors: dict[str, Any] = {}
    results = {name: decode_case(name, case, tensors) for name, case in manifest.items()}
    (directory / "result.json").write_text(json.dumps(results))
    save_file(tensors, str(directory / "result.safetensors"))
    say("DONE", len(results))


def decode_serve(lines: Any) -> None:
    import traceback

    from sglang.srt.disaggregation.encoder import receiver  # noqa: F401 (the slow import, once)

    say("READY")
    for line in lines:
        try:
            decode(Path(line.strip()))
        except Exception as exc:  # noqa: BLE001 - this directory failed (printed); the next one is served
            traceback.print_exc()
            say("FAILED", f"{type(exc).__name__}: {exc}".replace("\n", " "))


def _start_bootstrap() -> Any:
    from sglang.srt.disaggregation.encoder.receiver import EncoderBootstrapServer

    server = EncoderBootstrapServer("127.0.0.1", 0, health_check_interval=0)
    deadline = time.monotonic() + 120
    while server._server is None or not server._server.started:  # uvicorn runs in its thread
        if time.monotonic() > deadline or not server.thread.is_alive():
            say("FAILED", "EncoderBootstrapServer did not start")
            sys.exit(3)
        time.sleep(0.01)
    say("PORT", server._server.servers[0].sockets[0].getsockname()[1])
    return server


class _FailFast(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        say("FAILED", record.getMessage())
        os._exit(3)


def _publish_encoder(registry: str, host: str, port: int) -> None:
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", encoder_only=True, host=host, port=port,
                      encoder_register_urls=[registry], device="cpu")
    publish(args, role="encoder")  # last publish wins: one encoder identity at a time


def _register(http_server: Any, registry: str, pairs: list[tuple[str, int]]) -> None:
    for host, port in pairs:
        _publish_encoder(registry, host, port)
        http_server._register_encoder_url_with_bootstrap()
        for thread in threading.enumerate():  # its worker ends once every registry said 200
            if thread.name == "encoder-bootstrap-register":
                thread.join()
    say("REGISTERED", *(w for pair in pairs for w in pair))


def _unregister(http_server: Any, registry: str, pairs: list[tuple[str, int]]) -> None:
    for host, port in pairs:
        _publish_encoder(registry, host, port)
        http_server._unregister_encoder_url_from_bootstrap()
    say("UNREGISTERED", *(w for pair in pairs for w in pair))


def registration_serve(lines: Any) -> None:
    from sglang.srt.disaggregation.encoder import http_server

    logging.getLogger(http_server.__name__).addHandler(_FailFast(level=logging.WARNING))
    server = None
    registry, pairs = "", []
    say("READY")
    for line in lines:
        command, *rest = line.split()
        if command == "bootstrap":
            server = _start_bootstrap()
        elif command == "urls":
            say("URLS", json.dumps(server.list_urls()))
            server.close()
        elif command == "register":
            registry, pairs = rest[0], [(rest[i], int(rest[i + 1])) for i in range(1, len(rest), 2)]
            _register(http_server, registry, pairs)
        elif command == "unregister":
            _unregister(http_server, registry, pairs)
        else:
            say("FAILED", f"unknown command {command!r}")


def main(argv: list[str]) -> None:
    mode, rest = argv[0], argv[1:]
    if mode == "decode":
        decode(Path(rest[0]))
    elif mode == "decode-serve":
        decode_serve(sys.stdin)
    elif mode == "registration-serve":
        registration_serve(sys.stdin)
    elif mode == "serve":
        from sglang_language_side import serve

        serve(say, sys.stdin)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
