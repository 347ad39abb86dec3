"""vLLM 0.32's own ECMooncakeConnector, consumer side, stepped outside an engine (run in vLLM's venv).

Both halves of vLLM's connector are built as its engine builds them, the
scheduler's (``ECConnectorRole.SCHEDULER``) and a worker's (``WORKER``), from
a real ``ECTransferConfig`` (``ec_role: ec_consumer``, a CPU receive buffer,
Mooncake over TCP); the worker starts its services (its control channel, its
transfer engine, the registered buffer). Only the engine around them is
stood in for: the config object's parallel sizes, requests and scheduler
outputs, with the attributes the connector reads.

argv[1] is JSON: ``port``, ``buffer_bytes``, ``push_wait_timeout_s``. One
line on stdout says it is ready (``{"control": "tcp://..."}``); then each JSON
command on stdin gets one JSON line back:

- ``load`` {request_id, items: [{mm_hash, transfer_id, modality, tokens}],
  wait, out}: one request stepped as vLLM's scheduler and model runner step
  it: ``has_cache_item`` for each item until the pushes have arrived (or
  ``wait`` seconds have passed), ``ensure_cache_available``, ``build_connector_meta``, the worker's
  ``start_load_caches`` and its metadata back to the scheduler; each loaded
  tensor is saved as ``{out}/{mm_hash}.safetensors`` (tensor ``embedding``);
  then the encoder cache is freed and ``request_finished`` runs;
- ``finish`` {request_id, items}: ``request_finished`` alone (a request that
  ended on the consumer), once its cancels have been sent;
- ``stats``: the worker's live reservations and its receive buffer.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from safetensors.torch import save_file
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector import ECMooncakeConnector


def connectors(settings: dict[str, Any]) -> tuple[ECMooncakeConnector, ECMooncakeConnector]:
    ec = ECTransferConfig(ec_connector="ECMooncakeConnector", ec_role="ec_consumer", ec_ip="127.0.0.1",
                          ec_port=settings["port"], ec_buffer_device="cpu",
                          ec_buffer_size=settings["buffer_bytes"],
                          ec_connector_extra_config={"mooncake_protocol": "tcp", "control_timeout_s": 5,
                                                     "push_wait_timeout_s": settings["push_wait_timeout_s"]})
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
                               data_parallel_index=0)
    config = SimpleNamespace(ec_transfer_config=ec, parallel_config=parallel, model_config=None)
    scheduler = ECMooncakeConnector(config, ECConnectorRole.SCHEDULER)  # type: ignore[arg-type]
    worker = ECMooncakeConnector(config, ECConnectorRole.WORKER)  # type: ignore[arg-type]
    worker.start_worker_services()
    return scheduler, worker


def request(command: dict[str, Any]) -> SimpleNamespace:
    """A request as the connector reads one: its features, in prompt order, and ec_transfer_params."""
    features, offset = [], 0
    for item in command["items"]:
        tokens = item["tokens"]
        position = SimpleNamespace(offset=offset, length=tokens, get_num_embeds=lambda n=tokens: n)
        features.append(SimpleNamespace(identifier=item["mm_hash"], modality=item["modality"],
                                        mm_position=position, data=None))
        offset += tokens
    items = [{"mm_hash": i["mm_hash"], "transfer_id": i["transfer_id"]} for i in command["items"]]
    return SimpleNamespace(request_id=command["request_id"], mm_features=features,
                           ec_transfer_params={"ec_items": items})


def step(scheduler: ECMooncakeConnector, worker: ECMooncakeConnector, freed: list[str],
         cache: dict[str, Any]) -> None:
    """One engine step: the scheduler's metadata to the worker, the worker's back."""
    output = SimpleNamespace(free_encoder_mm_hashes=freed, preempted_req_ids=set())
    worker.bind_connector_metadata(scheduler.build_connector_meta(output))  # type: ignore[arg-type]
    worker.start_load_caches(cache)
    meta = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    scheduler.update_connector_output(SimpleNamespace(ec_connector_worker_meta=meta))  # type: ignore[arg-type]


def load(scheduler: ECMooncakeConnector, worker: ECMooncakeConnector, command: dict[str, Any]) -> dict[str, Any]:
    req = request(command)
    hashes = [f.identifier for f in req.mm_features]
    deadline = time.monotonic() + command["wait"]
    while not all(scheduler.has_cache_item(h) for h in hashes):
        if time.monotonic() > deadline:
            scheduler.request_finished(req)  # type: ignore[arg-type]
            return {"arrived": False}
        time.sleep(0.02)
    cache: dict[str, Any] = {}
    waiting = not scheduler.ensure_cache_available(req, 0)  # type: ignore[arg-type]
    step(scheduler, worker, [], cache)
    ready = scheduler.ensure_cache_available(req, 0)  # type: ignore[arg-type]
    out = Path(command["out"])
    for mm_hash, tensor in cache.items():
        save_file({"embedding": tensor.clone()}, str(out / f"{mm_hash}.safetensors"))
    loaded = sorted(cache)
    cache.clear()
    step(scheduler, worker, hashes, cache)  # the encoder cache lets go of them
    scheduler.request_finished(req)  # type: ignore[arg-type]
    settle(scheduler)
    return {"arrived": True, "waited": waiting, "ready": ready, "loaded": loaded,
            "unavailable": sorted(scheduler.take_unavailable_requests())}


def settle(scheduler: ECMooncakeConnector) -> None:
    """Wait for the cancels the scheduler sent in the background."""
    for future in list(scheduler._scheduler._pending_cancels.values()):  # type: ignore[union-attr]
        future.result(timeout=30)


def stats(worker: ECMooncakeConnector) -> dict[str, Any]:
    inner = worker._worker
    assert inner is not None
    reservations, memory = inner._reservations, inner._consumer_memory
    allocator = memory._allocator
    return {"active": len(reservations._active_ids), "writers": len(reservations._writers),
            "free_bytes": sum(size for _, size in allocator._free), "capacity": allocator._capacity,
            "resident": len(memory._residents._entries),
            "states": {tid: r.state.name for tid, r in reservations._records.items()}}


def main() -> None:
    settings = json.loads(sys.argv[1])
    scheduler, worker = connectors(settings)
    print(json.dumps({"control": f"tcp://127.0.0.1:{settings['port']}"}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "load":
            answer = load(scheduler, worker, command)
        elif command["op"] == "finish":
            scheduler.request_finished(request(command))  # type: ignore[arg-type]
            settle(scheduler)
            answer = {"finished": True}
        else:
            answer = stats(worker)
        print(json.dumps(answer), flush=True)
    worker.shutdown()
    scheduler.shutdown()


if __name__ == "__main__":
    main()
