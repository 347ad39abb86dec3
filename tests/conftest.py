"""Shared fixtures: generated checkpoints (never downloaded) and media helpers."""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import io
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # the Mooncake engine reads it when first imported

import httpx
import numpy as np
import pytest
import trio
from PIL import Image

from epd_trio.config import EncoderConfig, EngineConfig
from epd_trio.encoder.server import EncoderServer, serve_encoder
from epd_trio.model.tiny import TinySpec, make_tiny_model

# Dimensions deliberately unlike the embedded default (TinySpec()).
TEST_SPECS = {
    "qwen2_5_vl": TinySpec(arch="qwen2_5_vl", vision_hidden=48, vision_depth=3, vision_heads=4,
                           out_hidden=40, seed=7),
    "qwen2_vl": TinySpec(arch="qwen2_vl", vision_hidden=48, vision_depth=3, vision_heads=4,
                         out_hidden=40, seed=11),
    "qwen3_vl": TinySpec(arch="qwen3_vl", vision_hidden=48, vision_depth=3, vision_heads=4,
                         out_hidden=40, seed=13, patch_size=14, position_embeddings=36,
                         deepstack_indexes=(0, 1)),
    "qwen2_audio": TinySpec(arch="qwen2_audio", vision_hidden=40, vision_depth=2, vision_heads=4,
                            out_hidden=40, seed=17, mel_bins=80, window_seconds=5),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One generated full-model checkpoint per family."""
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: str(make_tiny_model(root / arch, spec)) for arch, spec in TEST_SPECS.items()}


@pytest.fixture(scope="session")
def qwen25_path(checkpoints: dict[str, str]) -> str:
    return checkpoints["qwen2_5_vl"]


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a module (registered in ``sys.modules``, as dataclasses need)."""
    path = Path(__file__).resolve().parent.parent / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    random_image(width, height, seed).save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(width: int, height: int, seed: int = 0, **save: Any) -> bytes:
    buf = io.BytesIO()
    random_image(width, height, seed).save(buf, format="JPEG", quality=90, **save)
    return buf.getvalue()


def corrupt_jpegs() -> dict[str, bytes]:
    """JPEGs whose headers PIL reads (so they take the torchvision / nvJPEG path) but whose
    data is damaged: what a peer could send to crash a decoder."""
    out: dict[str, bytes] = {}
    for kind, good in (("baseline", jpeg_bytes(64, 48, seed=1)),
                       ("progressive", jpeg_bytes(64, 48, seed=2, progressive=True))):
        sos = good.index(b"\xff\xda")
        scan = sos + 2 + int.from_bytes(good[sos + 2:sos + 4], "big")
        middle = (scan + len(good)) // 2
        flipped = bytearray(good)
        flipped[middle:middle + 16] = bytes(b ^ 0xFF for b in good[middle:middle + 16])
        dht = good.index(b"\xff\xc4")
        bad_table = bytearray(good)
        bad_table[dht + 5:dht + 21] = b"\xff" * 16  # code counts: far more codes than the table has
        out |= {
            f"{kind} cut in its header": good[:scan + 4],
            f"{kind} cut mid-scan": good[:middle],
            f"{kind} without EOI": good[:-2],
            f"{kind} scan bytes flipped": bytes(flipped),
            f"{kind} Huffman counts overflow": bytes(bad_table),
            f"{kind} restart marker in the scan": good[:middle] + b"\xff\xd3" + good[middle:],
            f"{kind} scan replaced by zeros": good[:scan] + bytes(len(good) - scan - 2) + b"\xff\xd9",
        }
    return out


CORRUPT_JPEG_SCRIPT = """
import json, sys
import torch
from epd_trio.errors import RequestError
from epd_trio.model.image_decode import decode_image_tensor, fast_format
from epd_trio.model.media import MediaLimits
from conftest import corrupt_jpegs, jpeg_bytes

device = sys.argv[1]
good = jpeg_bytes(64, 48, seed=3)
before = decode_image_tensor(good, 0, MediaLimits(), device).cpu()
seen = {}
for index, (name, data) in enumerate(corrupt_jpegs().items()):
    assert fast_format(data, index, MediaLimits()) == "JPEG", name  # the decoder under test sees it
    try:
        out = decode_image_tensor(data, index, MediaLimits(), device)
        seen[name] = ["tensor", list(out.shape), str(out.device)] if isinstance(out, torch.Tensor) \
            else ["pil", list(out.size)]
    except RequestError as exc:
        seen[name] = ["refused", exc.message]
if device.startswith("cuda"):
    torch.cuda.synchronize()
after = decode_image_tensor(good, 0, MediaLimits(), device).cpu()
print(json.dumps({"seen": seen, "still_decodes": bool(torch.equal(before, after))}))
"""


def decode_corrupt_jpegs_in_child(device: str) -> dict[str, Any]:
    """``CORRUPT_JPEG_SCRIPT`` in a child process: a decoder that crashes kills it, not the
    test run; a device left broken fails the good image decoded after the corpus."""
    import json

    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", CORRUPT_JPEG_SCRIPT, device], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_corrupt_jpegs_handled(result: dict[str, Any], device: str) -> None:
    """Each damaged JPEG is refused as its item, or decoded at its header's size on ``device``."""
    assert result["still_decodes"], "the good image decoded differently after the corpus"
    names = list(corrupt_jpegs())
    assert list(result["seen"]) == names
    for index, name in enumerate(names):
        outcome = result["seen"][name]
        if outcome[0] == "refused":
            assert outcome[1].startswith(f"item {index}: "), (name, outcome)
            assert ".cpp" not in outcome[1] and "/" not in outcome[1], (name, outcome)  # no build path
        else:
            assert outcome == ["tensor", [3, 48, 64], device], (name, outcome)
    assert any(o[0] == "refused" for o in result["seen"].values())  # the corpus is not all harmless


def docstring_ids(tree: Any) -> set[int]:
    """The ids of an ``ast`` tree's module, class and function docstring nodes (prose, not
    code): the guards that look for backend names in code skip them."""
    import ast

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant):
            found.add(id(node.body[0].value))
    return found


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_uri(width: int = 56, height: int = 56, seed: int = 0) -> str:
    return data_uri(png_bytes(width, height, seed))


@asynccontextmanager
async def running(model_path: str, **overrides: Any) -> AsyncIterator[tuple[EncoderServer, httpx.AsyncClient]]:
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    engine = EngineConfig(model_path=model_path,
                          **{k: v for k, v in overrides.items() if k in engine_fields})
    config = EncoderConfig(port=0, engine=engine,
                           **{k: v for k, v in overrides.items() if k not in engine_fields})
    async with serve_encoder(config) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        yield server, http


@pytest.fixture
def encoder(qwen25_path: str) -> Callable[..., Any]:
    """``async with encoder(**overrides) as (server, http)``."""
    return lambda **kw: running(qwen25_path, **kw)


@pytest.fixture
def encoder_for(checkpoints: dict[str, str]) -> Callable[..., Any]:
    """``async with encoder_for("qwen2_audio", **overrides) as (server, http)``: any TEST_SPECS family."""
    return lambda arch, **kw: running(checkpoints[arch], **kw)


# ---- `epd-trio` subprocesses, as an operator runs them ----------------------------
@contextmanager
def spawn(*args: str, log: Path | None = None) -> Iterator[subprocess.Popen[str]]:
    """``epd-trio ARGS``; stderr in a pipe, or in the file ``log`` (a long run must not fill a pipe)."""
    env = {**os.environ, "EPD_LOG_LEVEL": "WARNING"}
    with ExitStack() as files:
        stderr = files.enter_context(log.open("wb")) if log is not None else subprocess.PIPE
        proc = subprocess.Popen([sys.executable, "-m", "epd_trio.cli", *args],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


async def listening_url(proc: subprocess.Popen[str]) -> str:
    with trio.fail_after(120):
        line = await trio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
    assert "listening on http://" in line, line + proc.stderr.read()  # type: ignore[union-attr]
    return line.rsplit(" ", 1)[1].strip()


async def first_event_then_leave(url: str, path: str, body: dict[str, Any], *,
                                 wait: bool = True) -> bytes:
    """A caller on a bare socket: POST ``body`` as JSON, read the answer up to its first
    server-sent event (``wait=False``: nothing), then close the connection (what a user
    closing a chat tab does)."""
    import json

    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n").encode()
    received = b""
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(head + payload)
        while wait and b"data: " not in received:
            chunk = await stream.receive_some(65536)
            assert chunk, f"the connection closed before an event: {received[:500]!r}"
            received += chunk
    return received


# ---- transformers' own vision features, the reference embeddings are checked against ----
def deepstack_levels(out: Any) -> list[Any]:
    """The deepstack levels of one item from ``get_image_features`` / ``get_video_features``
    (none for a model without them). transformers 5.24 gives each level per item; 5.17, the
    GPU image's version, gives one ``[tokens, dim]`` tensor per level."""
    import torch

    return [level if isinstance(level, torch.Tensor) and level.dim() == 2 else level[0]
            for level in getattr(out, "deepstack_features", None) or []]


def with_deepstack(out: Any) -> Any:
    """``[embedding | deepstack_0 | ...]`` of one item along dim 1, as epd_trio (and SGLang's
    encoder) send it."""
    import torch

    (emb,) = out.pooler_output
    return torch.cat([emb, *deepstack_levels(out)], dim=-1)


# ---- transformers' own audio path, the reference audio embeddings are checked against ----
def audio_reference(path: str, waves: list[Any], rate: int) -> tuple[Any, list[int], list[int]]:
    """Qwen2-Audio rows of the LM's input embeddings, the processor's token counts and the
    mel-frame length of each wave (what SGLang calls the audio grid)."""
    import torch
    import transformers

    model = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(path).eval()
    extractor = transformers.AutoFeatureExtractor.from_pretrained(path)
    # As Qwen2AudioProcessor._process_audio: padded to the window, with the mask.
    feats = extractor(waves, sampling_rate=rate, return_attention_mask=True, padding="max_length",
                      return_tensors="pt")
    lengths = feats["attention_mask"].sum(-1).tolist()
    counts = [(((n - 1) // 2 + 1) - 2) // 2 + 1 for n in lengths]  # the processor's own line
    ids = torch.full((1, sum(counts)), model.config.audio_token_id)
    captured: dict[str, Any] = {}

    def grab(module: Any, args: Any, kwargs: Any) -> None:
        captured["embeds"] = kwargs["inputs_embeds"]

    hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            model(input_ids=ids, input_features=feats["input_features"],
                  feature_attention_mask=feats["attention_mask"])
    finally:
        hook.remove()
    return captured["embeds"][0], counts, lengths
