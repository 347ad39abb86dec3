"""Encoder-only loading: the right weights, never the language model."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
import trio
import trio.testing

from epd_trio import ModelLoadError, TinySpec, make_tiny_model
from epd_trio.model.loader import INDEX_FILE, load_encoder, load_encoders, replicate_encoders, resolve_dtype


def _full_model(path: str):
    return transformers.AutoModelForImageTextToText.from_pretrained(path)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_loads_exactly_the_vision_tower(checkpoints: dict[str, str], arch: str) -> None:
    enc = load_encoder(checkpoints[arch])
    full = _full_model(checkpoints[arch])
    vision = full.model.visual
    assert sum(p.numel() for p in enc.module.parameters()) == sum(p.numel() for p in vision.parameters())
    ours, theirs = enc.module.state_dict(), vision.state_dict()
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    assert enc.family == arch and not enc.module.training


def test_sharded_checkpoint(tmp_path: Path, qwen25_path: str) -> None:
    full = _full_model(qwen25_path)
    full.save_pretrained(tmp_path, max_shard_size="100KB")
    transformers.AutoImageProcessor.from_pretrained(qwen25_path).save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "checkpoint was not sharded"
    enc = load_encoder(tmp_path)
    for key, value in full.model.visual.state_dict().items():
        assert torch.equal(enc.module.state_dict()[key], value)


def test_dtypes(qwen25_path: str) -> None:
    assert load_encoder(qwen25_path, dtype="bfloat16").module.dtype == torch.bfloat16
    assert load_encoder(qwen25_path, dtype="auto").module.dtype == torch.float32
    with pytest.raises(ModelLoadError, match="bfloat16"):
        resolve_dtype("int8", None)


def test_auto_dtype_is_the_checkpoints(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, TinySpec(dtype="bfloat16"))
    assert load_encoder(path).module.dtype == torch.bfloat16


def test_unknown_family_names_the_supported(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=32)
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"'llama'.*qwen2_5_vl.*qwen2_vl"):
        load_encoder(tmp_path)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config.json"):
        load_encoder(tmp_path)


def test_missing_weights(tmp_path: Path, qwen25_path: str) -> None:
    (tmp_path / "config.json").write_text(Path(qwen25_path, "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"model.safetensors"):
        load_encoder(tmp_path)


PEAK_SCRIPT = textwrap.dedent("""
    import sys, json
    import torch, transformers
    from epd_trio.model.loader import load_encoder

    def full(path):
        return transformers.AutoModelForImageTextToText.from_pretrained(path)

    def peak_kib():
        # VmHWM belongs to this process image (ru_maxrss would inherit the parent's peak).
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    load = load_encoder if sys.argv[1] == "encoder" else full
    load(sys.argv[2])  # warm-up on a small checkpoint: imports are not the loader's cost
    before = peak_kib()
    module = load(sys.argv[3])
    module = getattr(module, "module", module)
    # Touch every parameter, so lazily mapped weights count as they would in a forward.
    with torch.no_grad():
        total = sum(float(p.float().sum()) for p in module.parameters())
    after = peak_kib()
    print(json.dumps({"peak_kib": after - before}))
""")


def _peak_bytes(kinds: list[str], warm: str, path: Path) -> list[int]:
    """Each kind's peak in its own process, run side by side (each measures only itself)."""
    procs = [subprocess.Popen([sys.executable, "-c", PEAK_SCRIPT, kind, warm, str(path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for kind in kinds]
    peaks = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-4000:]
            peaks.append(json.loads(out.strip().splitlines()[-1])["peak_kib"] * 1024)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return peaks


@pytest.mark.slow
def test_peak_memory_far_under_the_full_model(tmp_path: Path, qwen25_path: str) -> None:
    # A language model of ~130 MB beside a vision tower of well under 1 MB (the encoder's
    # load grows the peak by ~1 MB, the bound below is ~6 MB).
    spec = TinySpec(out_hidden=1024, text_layers=1, text_intermediate=4096, vocab_size=8192)
    path = make_tiny_model(tmp_path / "big-lm", spec)
    lm_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert lm_bytes > 100e6
    full, ours = _peak_bytes(["full", "encoder"], qwen25_path, path)
    assert full > lm_bytes / 2, f"the measurement does not see a full model's weights ({full}, {ours})"
    assert ours < lm_bytes / 20, f"loading the encoder grew the peak RSS by {ours / 1e6:.0f} MB"


def fifo_checkpoint(directory: Path, template: str) -> Path:
    """A checkpoint whose weight index is a named pipe: reading it blocks until a writer comes.

    Python's ``open`` and ``read`` release the GIL while they block, as a load
    from a slow disk does, so only the loading thread waits.
    """
    directory.mkdir()
    for file in Path(template).iterdir():
        if file.name != INDEX_FILE:
            (directory / file.name).symlink_to(file)
    os.mkfifo(directory / INDEX_FILE)
    return directory


@contextmanager
def released_in_the_end(fifo: Path) -> Iterator[None]:
    """Let a thread blocked on ``fifo`` go (end of file) when the test ends, or after 30 s.

    The 30 s fallback only turns a load that cannot be abandoned into a failure
    instead of a hang.
    """
    def release() -> None:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader any more
            pass

    timer = threading.Timer(30, release)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        release()


async def test_a_cancelled_load_is_abandoned(tmp_path: Path, qwen25_path: str,
                                             autojump_clock: trio.testing.MockClock) -> None:
    path = fifo_checkpoint(tmp_path / "slow", qwen25_path)
    with released_in_the_end(path / INDEX_FILE):
        start = trio.current_time()
        with trio.move_on_after(5) as scope:
            await load_encoders(path, ["cpu"])
        assert scope.cancelled_caught and trio.current_time() - start == 5


class StuckModule:
    """A module whose copy blocks until released (a big replica on a busy device)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __deepcopy__(self, memo: dict[int, object]) -> StuckModule:
        self.release.wait(30)  # the fallback only turns a missing abandon into a failure
        return self

    def to(self, device: str) -> StuckModule:
        return self

    def eval(self) -> StuckModule:
        return self

    def requires_grad_(self, flag: bool) -> StuckModule:
        return self


async def test_a_cancelled_replica_copy_is_abandoned(qwen25_path: str,
                                                     autojump_clock: trio.testing.MockClock) -> None:
    encoder = dataclasses.replace(load_encoder(qwen25_path), module=StuckModule())
    try:
        start = trio.current_time()
        with trio.move_on_after(3) as scope:
            await replicate_encoders(encoder, ["cpu"])
        assert scope.cancelled_caught and trio.current_time() - start == 3
    finally:
        encoder.module.release.set()


async def test_load_encoders_copies_to_every_further_device(qwen25_path: str) -> None:
    first, second = await load_encoders(qwen25_path, ["cpu", "cpu"])
    assert first.module is not second.module and first.processors is second.processors
    for key, value in first.module.state_dict().items():
        assert torch.equal(second.module.state_dict()[key], value), key


def test_a_cuda_device_torch_cannot_use_is_named_before_the_load() -> None:
    from epd_trio.model.loader import check_device

    check_device("cpu")
    with pytest.raises(ModelLoadError, match=r"device 'cuda:99' \(--device\): torch sees"):
        check_device("cuda:99")


async def test_load_encoders_names_an_unusable_device_before_loading_any(
        qwen25_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from epd_trio.model import loader

    loaded: list[str] = []
    monkeypatch.setattr(loader, "load_encoder", lambda *a, **kw: loaded.append("loaded"))
    with pytest.raises(ModelLoadError, match="'cuda:99'"):
        await loader.load_encoders(qwen25_path, ["cpu", "cuda:99"])
    assert loaded == []
