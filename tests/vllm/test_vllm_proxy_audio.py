"""Audio end to end: a real vLLM 0.32 serving a tiny Qwen2-Audio generates from epd_trio's embeddings.

The module's own vLLM server (its CPU build serves Qwen2-Audio), an EC consumer
of a shared directory; per test, ``epd-trio proxy`` and one epd_trio encoder
(``--api vllm``). As in ``test_vllm_proxy.py``, the reference is vLLM alone
(the clip under a ``uuid`` no file answers to), and all-zero embeddings under
another name must change the tokens, so the loaded ones are really used.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import torch
import trio
from safetensors.torch import load_file, save_file

from epd_trio.model.samples import sample_tone
from epd_trio.model.tiny import make_tiny_model, servable_spec
from proxy_harness import encoder, proxy_over, request, through, tokens, vllm_alone
from vllm_harness import VllmServer, storage, vllm, vllm_env  # noqa: F401  (the fixtures)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("servable") / "qwen2_audio",
                               servable_spec("qwen2_audio", seed=3)))


async def test_audio_through_the_proxy_gives_vllms_own_tokens(model: str, storage: Path,
                                                              vllm: VllmServer) -> None:
    clip = {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(sample_tone(1.0, hz=330.0)).decode(), "format": "wav"}}
    reference = await vllm_alone(vllm, [clip], "reference-audio")
    before = set(storage.iterdir())
    async with encoder(model, storage) as server, proxy_over([server.url], vllm) as (_, http):
        answer = await through(http, vllm, [clip])
    assert answer.status_code == 200, answer.text
    assert tokens(answer.json()) == reference
    [written] = set(storage.iterdir()) - before
    assert f"Success load encoder cache for hash {written.name}" in vllm.log_text()
    zeros = {"ec_cache": torch.zeros_like(load_file(written / "encoder_cache.safetensors")["ec_cache"])}
    (storage / "zeros-audio").mkdir()
    save_file(zeros, storage / "zeros-audio" / "encoder_cache.safetensors")
    zeroed = await trio.to_thread.run_sync(vllm.chat, request({**clip, "uuid": "zeros-audio"}))
    assert tokens(zeroed) != reference
