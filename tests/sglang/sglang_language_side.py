"""An SGLang 0.5.23 language server's encoder-facing half, built from SGLang's own classes.

Imported only by ``sglang_driver.py serve`` (SGLang's tree on ``PYTHONPATH``,
never in the test process). Everything that touches an encoder is SGLang's
code, unmodified:

- the tokenizer side: ``MMReceiverHTTP._send_encode_request`` (its
  ``_extract_url_data``, its item assignment, its ``/encode`` bodies) and, for
  ``zmq_to_tokenizer``, ``MMReceiverHTTP.recv_mm_data`` (its PULL socket);
- the scheduler side, one ``MMReceiverHTTP`` per TP rank:
  ``process_waiting_requests`` ticks (its ``/scheduler_receive_url`` calls
  from its registration runner, its shared PULL socket, ``safe_pickle_loads``,
  ``MultiModalEmbeddingData`` merging, its TP status all-reduce over a real
  one-rank gloo group, its abort path); for ``mooncake`` its
  ``WaitingRDMARequest`` (``/scheduler_receive_meta_data`` then ``/send``
  with SGLang's own ``MooncakeTransferEngine`` over TCP).

Stand-ins, all configuration or consumers after the decode path: the
``Scheduler`` (only the attributes ``create_req`` reads on a failure), the
language model's multimodal processor (it records what SGLang hands it), a
rank's ``tp_size`` (two ranks share this process's one-rank group), and the
Mooncake landing pool's *allocation* (SGLang's ``EmbeddingPool`` allocator,
built on a CPU tensor instead of ``cuda:N``, registered with the engine).
With ``EPD_SGLANG_LANDING=cuda`` (a GPU machine, ``tools/gpu_check.sh``) there
is no pool at all: SGLang's unmodified per-request CUDA landing buffer.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import queue
import socket
import threading
import time
import urllib.request
from array import array
from types import SimpleNamespace
from typing import Any

import torch

TICK = 0.002  # the scheduler loop's pause between ticks; a busy loop on 2 cores starves the encoder
DEADLINE = 150.0  # seconds for one request, far beyond SGLang's needs on a quiet machine


class MMInputs:
    """What the language model's processor would return; weak-referenceable like SGLang's."""

    def __init__(self, embedding: dict[Any, torch.Tensor], meta: dict[str, Any]) -> None:
        self.embedding = embedding
        self.meta = meta
        self.input_ids = [1, 2, 3]
        self.mm_items: list[Any] = []


class RecordingProcessor:
    """The language model's multimodal processor: SGLang hands it the merged embeddings."""

    prefer_tokenized_input = False

    def get_validated_mm_data(self, prompt: Any, embedding: dict[Any, torch.Tensor],
                              **meta: Any) -> MMInputs:
        return MMInputs(embedding, meta)


def scheduler_stand_in() -> SimpleNamespace:
    """The attributes ``MMReceiverBase.create_req`` reads when it aborts a request."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return SimpleNamespace(
        model_config=SimpleNamespace(hf_eos_token_id=None, vocab_size=64), tokenizer=None,
        disaggregation_mode=DisaggregationMode.NULL, dllm_config=None,
        metrics_reporter=SimpleNamespace(enable_metrics=False), metrics_collector=None)


def init_process_group() -> None:
    """SGLang's own one-rank gloo world and model-parallel groups, on CPU."""
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", device="cpu", language_only=True,
                      encoder_transfer_backend="zmq_to_scheduler")
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    with socket.socket() as probe:  # a free port for the one-rank rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(backend="gloo")


def cpu_embedding_pool(engine: Any, size_bytes: int) -> Any:
    """SGLang's ``EmbeddingPool`` on a CPU tensor (its constructor hard-codes ``cuda``)."""
    from sglang.srt.disaggregation.encoder.receiver import EmbeddingPool

    pool = EmbeddingPool.__new__(EmbeddingPool)
    pool.gpu_id, pool.size_bytes, pool.engine = 0, size_bytes, engine
    pool.buffer = torch.zeros(size_bytes, dtype=torch.uint8)
    pool.base = pool.buffer.data_ptr()
    engine.register(pool.base, pool.buffer.nbytes)
    pool._segments_free = [(0, size_bytes)]
    pool._inflight, pool._next_slot_id, pool._total_inflight = {}, 0, 0
    pool._lock = threading.Lock()
    pool._cond = threading.Condition(pool._lock)
    return pool


class LogTap(logging.Handler):
    """Keeps SGLang's receiver warnings: how a failed request looks to its operator."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class LanguageSide:
    """Receivers built once per (backend, rank count) and reused, as a server would."""

    def __init__(self) -> None:
        from sglang.srt.disaggregation.encoder import receiver

        init_process_group()
        self.tap = LogTap()
        logging.getLogger(receiver.__name__).addHandler(self.tap)
        self.model_type: str | None = None
        self._ranks: dict[tuple[str, int], list[Any]] = {}
        self._tokenizers: dict[str, Any] = {}

    def _receiver(self, backend: str, *, scheduler: Any) -> Any:
        """SGLang's own choice of receiver class: ``SGLANG_ENCODER_MM_RECEIVER_MODE``
        (``http``, its default: ``MMReceiverHTTP``; ``grpc``: ``MMReceiverGrpc``)."""
        from sglang.srt.disaggregation.encoder.receiver import create_mm_receiver
        from sglang.srt.runtime_context import get_disagg
        from sglang.srt.server_args import ServerArgs

        args = ServerArgs(model_path="dummy", device="cpu", language_only=True,
                          encoder_transfer_backend=backend)
        with get_disagg().override(encoder_transfer_backend=backend):
            made = create_mm_receiver(args, dtype=torch.float32, scheduler=scheduler, encode_urls=[])
        made.mm_processor = RecordingProcessor()
        return made

    def tokenizer(self, backend: str) -> Any:
        if backend not in self._tokenizers:
            self._tokenizers[backend] = self._receiver(backend, scheduler=None)
        made = self._tokenizers[backend]
        made.model_type = self.model_type
        return made

    def ranks(self, backend: str, count: int) -> list[Any]:
        key = (backend, count)
        if key not in self._ranks:
            made = [self._receiver(backend, scheduler=scheduler_stand_in()) for _ in range(count)]
            for rank in made:
                rank.tp_size = count  # its receive_count: every rank registers with the encoder
                if backend != "mooncake":
                    continue
                rank.gpu_id = 0  # where its per-request landing buffer goes (device="cpu" says none)
                if os.environ.get("EPD_SGLANG_LANDING") != "cuda":
                    rank.embedding_pool = cpu_embedding_pool(rank.embeddings_engine, 64 << 20)
            self._ranks[key] = made
        for rank in self._ranks[key]:
            rank.model_type = self.model_type
        return self._ranks[key]


def generate_request(rid: str, items: dict[str, list[Any]]) -> Any:
    from sglang.srt.managers.io_struct import GenerateReqInput

    return GenerateReqInput(text="describe", rid=rid, image_data=items.get("image"),
                            video_data=items.get("video"), audio_data=items.get("audio"))


def tokenized(obj: Any) -> Any:
    """What SGLang's tokenizer forwards to the scheduler for a dispatched request."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    return TokenizedGenerateReqInput(
        rid=obj.rid, input_text="describe", input_ids=array("q", [1, 2, 3]), input_embeds=None,
        mm_inputs=None, token_type_ids=None, sampling_params=SamplingParams(),
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None,
        stream=False, need_wait_for_mm_inputs=obj.need_wait_for_mm_inputs,
        num_items_assigned=obj.num_items_assigned, encoder_urls=obj.encoder_urls)


def wait_for_stat(url: str, path: str, minimum: int) -> None:
    """Until the encoder's ``/stats`` JSON at ``path`` (dotted) reaches ``minimum``.

    How a test orders SGLang's ``/scheduler_receive_url`` against its ``/encode``.
    """
    deadline = time.monotonic() + 60
    seen: Any = None
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/stats", timeout=5) as answer:
            seen = json.loads(answer.read())
        for key in path.split("."):
            seen = seen.get(key) if isinstance(seen, dict) else None
        if isinstance(seen, int) and seen >= minimum:
            return
        time.sleep(0.01)
    raise TimeoutError(f"{url}/stats {path} stayed {seen!r}, below {minimum}")


def outcome(done: list[Any], aborted: list[Any]) -> dict[str, Any] | None:
    if done:
        (req,) = done
        return {"ok": True, "mm": req.mm_inputs}
    if aborted:
        (_, message, code) = aborted[0]
        return {"ok": False, "error": [message, None if code is None else int(code)]}
    return None


def run_scheduler_request(side: LanguageSide, command: dict[str, Any]) -> dict[str, Any]:
    """One request through SGLang's tokenizer dispatch and every rank's scheduler ticks.

    ``order``: ``encode_first`` (SGLang's usual order: dispatch, then the ranks
    register) or ``register_first`` (the ranks' ``/scheduler_receive_url`` reach
    the encoder before its ``/encode``); ``wait_for`` holds the second step
    until the encoder's ``/stats`` shows the first arrived. ``dispatch``: ``sglang``
    (its ``send_encode_request``) or ``direct`` (``encode_in_thread``: gRPC's
    ``MMReceiverGrpc.encode`` without the argument it does not take).
    """
    backend, urls = command["backend"], command["urls"]
    tokenizer = side.tokenizer(backend)
    tokenizer.encode_urls[:] = urls  # as EncoderBootstrapServer or --encoder-urls fills it
    ranks = side.ranks(backend, command.get("ranks", 1))
    obj = generate_request(command["rid"], command["items"])
    routed: queue.Queue[Any] = queue.Queue()
    dispatch_errors: list[Any] = []
    pending: list[Any] = [None] * len(ranks)

    def on_dispatch_error(error: Any) -> None:  # SGLang's tokenizer forwards it to the ranks
        dispatch_errors.append([error.error_msg, error.error_code])
        if command.get("route_dispatch_errors", True):
            routed.put(error)

    def start_ranks() -> None:
        for i, rank in enumerate(ranks):
            pending[i] = outcome(*rank.process_waiting_requests([copy.deepcopy(tokenized(obj))]))

    def hold() -> None:
        for url, path, minimum in command.get("wait_for", []):
            wait_for_stat(url, path, minimum)

    register_first = command.get("order") == "register_first"
    if register_first or command.get("dispatch") == "direct":
        # What _send_encode_request does, with SGLang's own steps, the thread started here.
        mm_data = tokenizer._extract_url_data(obj)
        obj.need_wait_for_mm_inputs = True
        obj.num_items_assigned = tokenizer._assign_items_by_modality(mm_data, len(urls))
        obj.encoder_urls = list(urls)
        ready = threading.Event()
        args = (obj.rid, mm_data, "encode", obj.num_items_assigned, list(urls))

        def dispatch() -> None:
            if command.get("dispatch") == "direct":
                encode_in_thread(tokenizer, *args, ready, on_dispatch_error)
            else:
                tokenizer._run_encode_in_thread(*args, None, ready, on_dispatch_error)

        if register_first:
            start_ranks()
            hold()
        threading.Thread(target=dispatch, daemon=True).start()
        if not register_first:
            hold()
            start_ranks()
    else:
        ready = tokenizer.send_encode_request(obj, on_dispatch_error=on_dispatch_error)
        assert ready is not None, "SGLang did not dispatch the request"
        hold()
        start_ranks()
    ready.set()  # the ranks hold the request: a dispatch error may now reach them
    per_rank = tick_until_done(ranks, pending, routed)
    if any(not r["ok"] for r in per_rank):
        ready_wait = time.monotonic() + 60  # the dispatch thread reports its error after the ranks
        while not dispatch_errors and time.monotonic() < ready_wait:
            time.sleep(0.01)
    assigned = {m.name: list(v) for m, v in obj.num_items_assigned.items()}
    return {"ranks": per_rank, "dispatch_errors": dispatch_errors, "assigned": assigned}


def encode_in_thread(tokenizer: Any, rid: str, mm_data: Any, endpoint: str, assigned: Any,
                     urls: list[str], ready: threading.Event, on_dispatch_error: Any) -> None:
    """SGLang's ``_run_encode_in_thread`` minus its ``time_stats_json`` argument.

    SGLang 0.5.23's dispatch passes it to ``encode``, which ``MMReceiverGrpc.encode``
    does not take (an upstream bug: its gRPC zmq_to_scheduler dispatch always fails).
    This calls that ``encode`` as the dispatch would without it; the rest is the same.
    """
    from http import HTTPStatus

    from sglang.srt.managers.io_struct import EncoderDispatchErrorReq

    try:
        error = asyncio.run(tokenizer.encode(req_id=rid, mm_data=mm_data, embedding_port=None,
                                             endpoint_encode=endpoint, num_items_assigned=assigned,
                                             encode_urls=urls))
    except Exception as exc:  # noqa: BLE001 - any dispatch failure becomes SGLang's error request
        error = EncoderDispatchErrorReq(rid=rid, error_msg=str(exc),
                                        error_code=int(HTTPStatus.BAD_GATEWAY))
    if error is not None and on_dispatch_error is not None:
        ready.wait()
        on_dispatch_error(error)


def tick_until_done(ranks: list[Any], pending: list[Any], errors: queue.Queue[Any]
                    ) -> list[dict[str, Any]]:
    deadline = time.monotonic() + DEADLINE
    while any(p is None for p in pending):
        if time.monotonic() > deadline:
            raise TimeoutError("the scheduler ranks never finished the request")
        routed = []
        while not errors.empty():
            routed.append(errors.get())  # the tokenizer broadcasts it to every rank
        for i, rank in enumerate(ranks):
            if pending[i] is None:
                pending[i] = outcome(*rank.process_waiting_requests(list(routed)))
        time.sleep(TICK)
    return pending


def run_tokenizer_request(side: LanguageSide, command: dict[str, Any]) -> dict[str, Any]:
    """zmq_to_tokenizer: SGLang's ``recv_mm_data`` owns the PULL socket and the dispatch."""
    tokenizer = side.tokenizer("zmq_to_tokenizer")
    tokenizer.encode_urls[:] = command["urls"]
    obj = generate_request(command["rid"], command["items"])
    got = asyncio.run(tokenizer.recv_mm_data(obj, tokenizer.mm_processor, "describe"))
    if got is None:  # SGLang logs why (see "warnings") and serves the request without it
        return {"ranks": [{"ok": False, "error": None}]}
    return {"ranks": [{"ok": True, "mm": got}]}


def jsonable_meta(meta: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if isinstance(value, torch.Tensor):
            out[key] = {"tensor": value.tolist()}
        elif isinstance(value, list):
            out[key] = [v.tolist() if isinstance(v, torch.Tensor) else v for v in value]
        else:
            out[key] = value
    return out


def handle(side: LanguageSide, command: dict[str, Any]) -> dict[str, Any]:
    """Run one request; tensors go to ``command["out"]``, the rest back as JSON."""
    from safetensors.torch import save_file

    side.tap.lines.clear()
    side.model_type = command.get("model_type")  # SGLang reads it from the LM's hf_config
    if command["backend"] == "zmq_to_tokenizer":
        answer = run_tokenizer_request(side, command)
    else:
        answer = run_scheduler_request(side, command)
    tensors: dict[str, torch.Tensor] = {}
    for i, result in enumerate(answer["ranks"]):
        mm = result.pop("mm", None)
        if mm is not None:
            for modality, tensor in mm.embedding.items():
                tensors[f"{i}/{modality.name}"] = tensor.cpu().clone().contiguous()
            result["meta"] = jsonable_meta(mm.meta)
    answer["warnings"] = list(side.tap.lines)
    save_file(tensors, command["out"])
    return answer


def serve(say: Any, lines: Any) -> None:
    side = LanguageSide()
    say("READY")
    for line in lines:
        command = json.loads(line)
        try:
            answer = handle(side, command)
        except Exception as exc:  # reported to the test, which fails with it
            logging.getLogger(__name__).exception("command failed")
            answer = {"crash": f"{type(exc).__name__}: {exc}"}
        say("RESULT", json.dumps(answer))
