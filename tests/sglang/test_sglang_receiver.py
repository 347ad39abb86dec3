"""Our SGLang frames, read by SGLang 0.5.23's own receiver code.

One driver process (``sglang_driver.py decode``) decodes every case below as
SGLang's ``zmq_to_tokenizer`` receiver does — ``safe_pickle_loads`` of frame 0,
its part-id check, ``torch.frombuffer(frame 1, dtype).reshape(shape)`` and the
``MultiModalEmbeddingData`` merge with ``get_mm_extra_meta`` — and reports what
it saw as JSON and safetensors; nothing is unpickled in this process.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from epd_trio.errors import RequestError, TransferTimeout
from epd_trio.protocol import sglang
from sglang_harness import Decoder, sglang_decoder, sglang_env  # noqa: F401 (fixtures)

RECEIVER_CLASS = "sglang.srt.disaggregation.encoder.receiver.EmbeddingData"
MODALITY_CLASS = "sglang.srt.multimodal.modality.Modality"


def embedding(rows: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values plus the bit patterns a lossy path would change: -0.0, ±inf, NaN."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, dim, generator=g).to(dtype)
    t[0, :4] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")], dtype=dtype)
    return t


@dataclass
class Part:
    tensor: torch.Tensor | None
    fields: dict[str, Any]
    frames: list[bytes] = field(default_factory=list)


@dataclass
class Case:
    rid: str
    parts: list[Part]
    model_type: str | None = None


def part(rid: str, idx: int, num: int, modality: str, tensor: torch.Tensor, **extra: Any) -> Part:
    fields = dict(req_id=f"{rid}_local_part_{idx}", part_idx=idx, num_parts=num,
                  modality=modality, **extra)
    frames = [bytes(f) for f in sglang.embedding_message(tensor, **fields)]
    return Part(tensor, fields, frames)


def error_part(rid: str, idx: int, num: int, modality: str, exc: Exception) -> Part:
    frames = [bytes(f) for f in sglang.error_message(f"{rid}_local_part_{idx}", idx, num,
                                                       modality, exc)]
    return Part(None, {"modality": modality}, frames)


def build_cases() -> dict[str, Case]:
    grid2 = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 2]])  # rows 1:2 is a view into grid2
    return {
        "image_bf16": Case("img", [part("img", 0, 1, "image", embedding(10, 16, torch.bfloat16, 1),
                                        grid=[[1, 4, 6], [1, 4, 4]])]),
        "image_two_parts_fp16": Case("img2", [
            part("img2", 0, 2, "image", embedding(6, 16, torch.float16, 2), grid=grid2[:1]),
            part("img2", 1, 2, "image", embedding(4, 16, torch.float16, 3), grid=grid2[1:3]),
        ]),
        "video_qwen2_5_vl_fp32": Case("v25", [
            part("v25", 0, 1, "video", embedding(12, 8, torch.float32, 4), grid=[[2, 4, 4], [1, 4, 4]],
                 second_per_grid_ts=torch.tensor([1.0, 0.5]))], model_type="qwen2_5_vl"),
        "video_qwen3_vl_bf16": Case("v3", [
            part("v3", 0, 2, "video", embedding(2, 8, torch.bfloat16, 5), grid=[[2, 2, 4]],
                 video_timestamps=[[0.25, 1.25]]),
            part("v3", 1, 2, "video", embedding(3, 8, torch.bfloat16, 6), grid=[[3, 2, 2]],
                 video_timestamps=[[0.5, 1.5, 2.5]]),
        ], model_type="qwen3_vl"),
        "audio_fp32": Case("aud", [part("aud", 0, 1, "audio", embedding(5, 8, torch.float32, 7),
                                        grid=[3000, 1200])], model_type="qwen2_audio"),
        "image_then_audio": Case("mix", [  # parts are numbered modality-major
            part("mix", 0, 2, "image", embedding(4, 8, torch.bfloat16, 8), grid=[[1, 4, 4]]),
            part("mix", 1, 2, "audio", embedding(3, 8, torch.bfloat16, 9), grid=[800]),
        ]),
        "error_request": Case("err", [error_part("err", 1, 2, "image", RequestError("bad image"))]),
        "error_timeout": Case("tmo", [error_part("tmo", 0, 1, "video", TransferTimeout("too slow"))]),
        # Control: the standard pickler names our stand-in class, which SGLang must refuse.
        "plain_pickle": Case("pp", [Part(None, {}, [pickle.dumps(
            sglang._EmbeddingData({"req_id": "pp_local_part_0"}))])]),
    }


CASES = build_cases()


@pytest.fixture(scope="module")
def decoded(sglang_decoder: Decoder, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("sglang_frames")
    manifest: dict[str, Any] = {}
    for name, case in CASES.items():
        messages = []
        for i, p in enumerate(case.parts):
            files = []
            for k, frame in enumerate(p.frames):
                path = root / f"{name}.{i}.{k}"
                path.write_bytes(frame)
                files.append(str(path))
            messages.append(files)
        manifest[name] = {"rid": case.rid, "model_type": case.model_type, "messages": messages}
    (root / "manifest.json").write_text(json.dumps(manifest))
    sglang_decoder.decode(root)
    return json.loads((root / "result.json").read_text()), load_file(root / "result.safetensors")


def tensor_json(t: torch.Tensor) -> dict[str, Any]:
    return {"tensor": {"dtype": str(t.dtype), "shape": list(t.shape), "values": t.tolist()}}


def modality_json(name: str) -> dict[str, Any]:
    return {"enum": MODALITY_CLASS, "name": name.upper(),
            "value": sglang.MODALITY_VALUES[name]}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def expected_state(p: Part) -> dict[str, Any]:
    f, t = p.fields, p.tensor
    assert t is not None
    grid = torch.as_tensor(f["grid"], dtype=torch.int64)
    seconds = f.get("second_per_grid_ts")
    return {
        "req_id": f["req_id"], "num_parts": f["num_parts"], "part_idx": f["part_idx"],
        "grid_dim": tensor_json(grid), "modality": modality_json(f["modality"]),
        "embedding": None, "send_time": None, "dtype": {"dtype": str(t.dtype)},
        "shape": list(t.shape), "_mr_ptr": None, "error_msg": None, "error_code": None,
        "video_timestamps": f.get("video_timestamps"),
        "second_per_grid_ts": None if seconds is None else tensor_json(seconds.float()),
    }


EMBEDDING_CASES = [n for n, c in CASES.items() if all(p.tensor is not None for p in c.parts)]


@pytest.mark.parametrize("name", EMBEDDING_CASES)
def test_sglang_reads_every_field_as_its_own_encoder_writes_it(
        decoded: tuple[dict[str, Any], dict[str, torch.Tensor]], name: str) -> None:
    results, _ = decoded
    case, got = CASES[name], results[name]
    assert len(got["parts"]) == len(case.parts)
    for p, seen in zip(case.parts, got["parts"]):
        assert seen["class"] == RECEIVER_CLASS and seen["receivers_modality"] is True
        assert seen["state"] == expected_state(p)  # every key, in SGLang's order too
        assert list(seen["state"]) == list(expected_state(p))
        assert seen["matches"] is True and seen["req_id_after_match"] == case.rid
    assert got["ready"] is True


@pytest.mark.parametrize("name", EMBEDDING_CASES)
def test_sglang_rebuilds_our_tensors_bit_for_bit(
        decoded: tuple[dict[str, Any], dict[str, torch.Tensor]], name: str) -> None:
    _, tensors = decoded
    case = CASES[name]
    by_modality: dict[str, list[torch.Tensor]] = {}
    for i, p in enumerate(case.parts):
        assert p.tensor is not None
        assert bits_equal(tensors[f"{name}/part{i}"], p.tensor)
        by_modality.setdefault(p.fields["modality"].upper(), []).append(p.tensor)
    merged = {k.rsplit("/", 1)[1]: v for k, v in tensors.items() if k.startswith(f"{name}/merged/")}
    assert merged.keys() == by_modality.keys()
    for modality, parts in by_modality.items():
        assert bits_equal(merged[modality], torch.cat(parts))


def test_merged_metadata_is_what_the_language_model_needs(
        decoded: tuple[dict[str, Any], dict[str, torch.Tensor]]) -> None:
    results, _ = decoded
    meta = {name: results[name]["extra_meta"] for name in EMBEDDING_CASES}
    assert meta["image_two_parts_fp16"]["img_grid_thw"] == tensor_json(
        torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 2]]))
    assert meta["video_qwen2_5_vl_fp32"]["video_grid_thw"] == tensor_json(
        torch.tensor([[2, 4, 4], [1, 4, 4]]))
    # SGLang chains per-part second_per_grid_ts like a list: 0-d float32 tensors, one per video,
    # exactly as it does with its own encoder's tensor.
    assert meta["video_qwen2_5_vl_fp32"]["second_per_grid_ts"] == [
        tensor_json(torch.tensor(1.0)), tensor_json(torch.tensor(0.5))]
    assert meta["video_qwen3_vl_bf16"]["video_timestamps"] == [[0.25, 1.25], [0.5, 1.5, 2.5]]
    assert meta["audio_fp32"]["audio_feature_lens"] == tensor_json(torch.tensor([3000, 1200]))
    assert meta["image_then_audio"]["img_grid_thw"] == tensor_json(torch.tensor([[1, 4, 4]]))
    assert meta["image_then_audio"]["audio_feature_lens"] == tensor_json(torch.tensor([800]))


@pytest.mark.parametrize(("name", "modality", "status", "message"), [
    ("error_request", "image", 400, "bad image"),
    ("error_timeout", "video", 504, "too slow"),
])
def test_sglang_reads_our_error_frames(decoded: tuple[dict[str, Any], dict[str, torch.Tensor]],
                                       name: str, modality: str, status: int, message: str) -> None:
    results, _ = decoded
    (seen,) = results[name]["parts"]
    assert seen["class"] == RECEIVER_CLASS and seen["matches"] is True
    part_idx, num_parts = (1, 2) if name == "error_request" else (0, 1)
    assert seen["state"] == {
        "req_id": f"{CASES[name].rid}_local_part_{part_idx}", "num_parts": num_parts,
        "part_idx": part_idx, "grid_dim": None, "modality": modality_json(modality),
        "embedding": None, "send_time": None, "dtype": None, "shape": None, "_mr_ptr": None,
        "error_msg": message, "error_code": status,
    }
    assert results[name]["ready"] is False


def test_sglangs_unpickler_is_really_checking(
        decoded: tuple[dict[str, Any], dict[str, torch.Tensor]]) -> None:
    results, _ = decoded
    (seen,) = results["plain_pickle"]["parts"]
    assert seen == {"refused": "RuntimeError: Blocked unsafe global "
                               "(epd_trio.protocol.sglang._EmbeddingData) during pickle deserialization"}
