"""SGLang 0.5.23's own language-server code against real ``epd-trio encoder --api sglang`` processes.

The language side is SGLang's receiver code in a driver process
(``sglang_language_side.py``): its tokenizer dispatch builds and posts the
``/encode`` bodies, each scheduler rank calls ``/scheduler_receive_url`` and
reads its PULL socket with ``safe_pickle_loads``, and ``MultiModalEmbeddingData``
merges the parts into what the language model's processor receives. The
encoders are real subprocesses; the embeddings SGLang assembles must equal
transformers' own (relative error < 1e-4, float32 on both sides).

The driver is shared by the whole module and the encoders by the session, with
``test_sglang_grpc`` (starting them is most of the cost); each request uses its
own request id, so tests stay independent.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch

import sglang_expected as ref
from conftest import image_uri, random_image
from epd_trio.model.samples import sample_video
from sglang_encoders import EncoderPool, sglang_encoders  # noqa: F401 (a fixture)
from sglang_harness import LanguageServer, language_server, sglang_env  # noqa: F401 (fixtures)

TOL = 1e-4
IMAGE_SIZES = [(56, 56), (84, 56), (28, 112)]
# The session's shared encoders this module uses (sglang_encoders.ENCODERS has their flags).
NAMES = ("vl_a", "vl_b", "vl_tokenizer", "vl3", "audio", "vl_mooncake")


class Encoders(dict[str, str]):
    """name → URL of each ``epd-trio encoder --api sglang`` subprocess; their logs for failures."""

    def __init__(self, pool: EncoderPool) -> None:
        super().__init__({name: pool[name].http for name in NAMES})
        self._pool = pool

    def log_tail(self, name: str, chars: int = 4000) -> str:
        return self._pool.log_tail(name, chars)


@pytest.fixture
def encoders(sglang_encoders: EncoderPool) -> Iterator[Encoders]:
    """The shared encoders; after each test, every one of them has released everything."""
    shared = Encoders(sglang_encoders)
    yield shared
    assert_nothing_left_behind(shared, shared.log_tail)


def stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/stats", timeout=10) as answer:
        return dict(json.loads(answer.read()))


def assert_nothing_left_behind(urls: Mapping[str, str],
                               log_tail: Callable[[str], str] = lambda name: "") -> None:
    """Every encoder (name → HTTP URL) released every request and registration it served.

    SGLang closes a connection as soon as it has what it needs (zmq_to_tokenizer
    cancels its ``/encode``), so a scope may still be finishing: wait, bounded.
    """
    for name, url in urls.items():
        deadline = time.monotonic() + 30
        while True:
            seen = stats(url)
            rendezvous = seen["sglang_rendezvous"]
            if not (seen["live_requests"] or rendezvous["entries"] or rendezvous["claimed"]) \
                    or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        assert seen["live_requests"] == 0, (name, seen, log_tail(name))
        assert (rendezvous["entries"], rendezvous["claimed"]) == (0, 0), (name, rendezvous, log_tail(name))


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sglang_media")
    video = root / "clip.mp4"
    video.write_bytes(sample_video(10, 4.0, 56, 42, seed=5))
    rng = np.random.default_rng(3)
    waves = [(rng.standard_normal(int(s * ref.AUDIO_RATE)) * 0.1).astype(np.float32)
             for s in (0.7, 2.3)]
    return {
        "images": [image_uri(w, h, seed=i) for i, (w, h) in enumerate(IMAGE_SIZES)],
        "pil": [random_image(w, h, seed=i) for i, (w, h) in enumerate(IMAGE_SIZES)],
        "video_file": video, "video": ref.uri("video/mp4", video.read_bytes()),
        "waves": waves, "audio": [ref.uri("audio/wav", ref.wav_bytes(w)) for w in waves],
    }


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, str], media: dict[str, Any]) -> dict[str, ref.Expected]:
    return {
        "vl_images": ref.images(checkpoints["qwen2_5_vl"], media["pil"]),
        "vl_video": ref.videos(checkpoints["qwen2_5_vl"], [media["video_file"]]),
        "vl3_image": ref.images(checkpoints["qwen3_vl"], media["pil"][:1]),
        "vl3_video": ref.videos(checkpoints["qwen3_vl"], [media["video_file"]]),
        "audio": ref.audio(checkpoints["qwen2_audio"], media["waves"]),
    }


def rid() -> str:
    return uuid.uuid4().hex


def live(url: str) -> list[Any]:
    """Dispatch once the encoder holds the request: SGLang's ranks register after its /encode."""
    return [[url, "live_requests", 1]]


def ok_ranks(answer: dict[str, Any], ranks: int = 1) -> list[dict[str, Any]]:
    assert [r["ok"] for r in answer["ranks"]] == [True] * ranks, answer
    return answer["ranks"]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape, (got.shape, want.shape)
    assert ref.rel_err(got, want) < TOL


@pytest.mark.parametrize("order", ["encode_first", "register_first"])
def test_one_encoder_one_rank(language_server: LanguageServer, encoders: Encoders,
                              media: dict[str, Any], expected: dict[str, ref.Expected],
                              order: str) -> None:
    url = encoders["vl_a"]
    wait = live(url) if order == "encode_first" else [[url, "sglang_rendezvous.waiters", 1]]
    answer, tensors = language_server.request(
        backend="zmq_to_scheduler", rid=rid(), urls=[url], order=order, wait_for=wait,
        items={"image": media["images"][:2]}, model_type="qwen2_5_vl")
    (rank,) = ok_ranks(answer)
    want = expected["vl_images"]
    assert_close(tensors["0/IMAGE"], torch.cat(want.embeddings[:2]))
    assert rank["meta"]["img_grid_thw"] == {"tensor": want.grids[:2]}
    assert answer["dispatch_errors"] == []


def test_a_request_split_over_two_encoders(language_server: LanguageServer,
                                           encoders: Encoders, media: dict[str, Any],
                                           expected: dict[str, ref.Expected]) -> None:
    urls = [encoders["vl_a"], encoders["vl_b"]]
    answer, tensors = language_server.request(
        backend="zmq_to_scheduler", rid=rid(), urls=urls, items={"image": media["images"]},
        model_type="qwen2_5_vl")
    (rank,) = ok_ranks(answer)
    assert sorted(answer["assigned"]["IMAGE"]) == [1, 2]  # SGLang's own split: two parts
    want = expected["vl_images"]
    assert_close(tensors["0/IMAGE"], want.cat())
    assert rank["meta"]["img_grid_thw"] == {"tensor": want.grids}


def test_two_tp_ranks_each_get_the_whole_part(language_server: LanguageServer,
                                              encoders: Encoders, media: dict[str, Any],
                                              expected: dict[str, ref.Expected]) -> None:
    urls = [encoders["vl_a"], encoders["vl_b"]]
    answer, tensors = language_server.request(
        backend="zmq_to_scheduler", rid=rid(), urls=urls, ranks=2,
        items={"image": media["images"]}, model_type="qwen2_5_vl")
    ranks = ok_ranks(answer, 2)
    want = expected["vl_images"]
    for i, rank in enumerate(ranks):
        assert_close(tensors[f"{i}/IMAGE"], want.cat())
        assert rank["meta"]["img_grid_thw"] == {"tensor": want.grids}


# Bare base64 (SGLang's last-resort item form), long enough to be taken as data: not an image.
BAD_IMAGE = base64.b64encode(b"this is not an image at all, only a line of text").decode()


@pytest.mark.parametrize("route_dispatch_error", [True, False])
def test_an_encoder_error_fails_the_request_on_every_rank(
        language_server: LanguageServer, encoders: Encoders, media: dict[str, Any],
        route_dispatch_error: bool) -> None:
    # With the dispatch error withheld from the ranks, only the error frame can fail them.
    answer, tensors = language_server.request(
        backend="zmq_to_scheduler", rid=rid(), urls=[encoders["vl_a"]], ranks=2,
        items={"image": [media["images"][0], BAD_IMAGE]},
        route_dispatch_errors=route_dispatch_error, model_type="qwen2_5_vl")
    assert tensors == {}
    ((message, status),) = answer["dispatch_errors"]  # /encode's HTTP status, via SGLang
    assert status == 400 and message
    for rank in answer["ranks"]:
        assert rank["ok"] is False and rank["error"][1] == 400, answer
    if not route_dispatch_error:
        assert any("Received error signal from encoder" in w for w in answer["warnings"])


def test_zmq_to_tokenizer(language_server: LanguageServer, encoders: Encoders,
                          media: dict[str, Any], expected: dict[str, ref.Expected]) -> None:
    answer, tensors = language_server.request(
        backend="zmq_to_tokenizer", rid=rid(), urls=[encoders["vl_tokenizer"]],
        items={"image": media["images"]}, model_type="qwen2_5_vl")
    (rank,) = ok_ranks(answer)
    want = expected["vl_images"]
    assert_close(tensors["0/IMAGE"], want.cat())
    assert rank["meta"]["img_grid_thw"] == {"tensor": want.grids}


def test_zmq_to_tokenizer_error(language_server: LanguageServer, encoders: Encoders) -> None:
    answer, tensors = language_server.request(
        backend="zmq_to_tokenizer", rid=rid(), urls=[encoders["vl_tokenizer"]],
        items={"image": [BAD_IMAGE]}, model_type="qwen2_5_vl")
    assert answer["ranks"] == [{"ok": False, "error": None}] and tensors == {}
    assert any(("Encoder error for req_id=" in w and "error_code=400" in w)
               or "Encoder dispatch failed" in w for w in answer["warnings"]), answer


def test_qwen2_5_vl_video_second_per_grid_ts(language_server: LanguageServer,
                                             encoders: Encoders, media: dict[str, Any],
                                             expected: dict[str, ref.Expected]) -> None:
    answer, tensors = language_server.request(
        backend="zmq_to_scheduler", rid=rid(), urls=[encoders["vl_a"]],
        items={"video": [media["video"]]}, model_type="qwen2_5_vl")
    (rank,) = ok_ranks(answer)
    want = expected["vl_video"]
    assert_close(tensors["0/VIDEO"], want.cat())
    assert rank["meta"]["video_grid_thw"] == {"tensor": want.grids}
    assert rank["meta"]["second_per_grid_ts"] == pytest.approx(want.second_per_grid_ts)


def test_qwen3_vl_deepstack_image_and_video_timestamps(
        language_server: LanguageServer, encoders: Encoders, media: dict[str, Any],
        expected: dict[str, ref.Expected]) -> None:
    answer, tensors = language_server.request(
        backend="zmq_to_scheduler", rid=rid(), urls=[encoders["vl3"]],
        items={"image": media["images"][:1], "video": [media["video"]]}, model_type="qwen3_vl")
    (rank,) = ok_ranks(answer)
    image, video = expected["vl3_image"], expected["vl3_video"]
    assert image.embeddings[0].shape[1] == 3 * 40  # the embedding and two deepstack levels
    assert_close(tensors["0/IMAGE"], image.cat())
    assert_close(tensors["0/VIDEO"], video.cat())
    assert rank["meta"]["img_grid_thw"] == {"tensor": image.grids}
    assert rank["meta"]["video_grid_thw"] == {"tensor": video.grids}
    (stamps,) = rank["meta"]["video_timestamps"]  # SGLang chains the parts' per-video lists
    assert stamps == pytest.approx(video.timestamps[0])


def test_qwen2_audio_grids_are_mel_lengths(language_server: LanguageServer,
                                           encoders: Encoders, media: dict[str, Any],
                                           expected: dict[str, ref.Expected]) -> None:
    answer, tensors = language_server.request(
        backend="zmq_to_scheduler", rid=rid(), urls=[encoders["audio"]],
        items={"audio": media["audio"]}, model_type="qwen2_audio")
    (rank,) = ok_ranks(answer)
    want = expected["audio"]
    assert_close(tensors["0/AUDIO"], want.cat())
    assert rank["meta"]["audio_feature_lens"] == {"tensor": want.grids}
    tokens = [e.shape[0] for e in want.embeddings]
    assert all(mel > n for mel, n in zip(want.grids, tokens))  # mel frames, not tokens


@pytest.mark.parametrize("ranks", [1, 2])
def test_mooncake_with_sglangs_own_rdma_receiver(
        language_server: LanguageServer, encoders: Encoders, media: dict[str, Any],
        expected: dict[str, ref.Expected], ranks: int) -> None:
    # SGLang's WaitingRDMARequest: /scheduler_receive_meta_data, its landing pool, /send with
    # its MooncakeTransferEngine's session over TCP, the completion frame on its PULL socket.
    answer, tensors = language_server.request(
        backend="mooncake", rid=rid(), urls=[encoders["vl_mooncake"]], ranks=ranks,
        items={"image": media["images"]}, model_type="qwen2_5_vl")
    want = expected["vl_images"]
    for i, rank in enumerate(ok_ranks(answer, ranks)):
        assert_close(tensors[f"{i}/IMAGE"], want.cat())
        assert rank["meta"]["img_grid_thw"] == {"tensor": want.grids}
    assert answer["dispatch_errors"] == []
