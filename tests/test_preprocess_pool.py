"""Preprocessing in processes: the same inputs as threads, and nothing left behind."""

from __future__ import annotations

import io
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from conftest import png_bytes, random_image
from epd_trio import EngineConfig, open_engine
from epd_trio.engine.preprocess_pool import PoolSpec, open_preprocess_pool
from epd_trio.errors import EncodeError, ModelLoadError, PayloadTooLargeError, RequestError
from epd_trio.model.loader import load_encoder
from epd_trio.model.media import MediaLimits
from epd_trio.model.preprocess import EncoderPreprocessor
from epd_trio.model.samples import generated_frames, sample_tone, sample_video

SHM = Path("/dev/shm")


def segments() -> set[str]:
    """The POSIX shared-memory segments made by multiprocessing (``psm_*``) that are this
    process tree's: mapped by it, or by no live process at all (an orphan: what a leak leaves).
    A segment another program on the machine holds (a vLLM server, another test run) is not."""
    found = {p.name for p in SHM.glob("psm_*")} if SHM.is_dir() else set()
    ours = {os.getpid()} | children()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        if not found or int(maps.parent.name) in ours:
            continue
        try:
            text = maps.read_text()
        except OSError:
            continue  # ended while we looked, or not ours to read
        found = {name for name in found if f"/dev/shm/{name}" not in text}
    return found


def children() -> set[int]:
    """Live child processes of this one (from /proc), less multiprocessing's resource tracker."""
    from multiprocessing import resource_tracker

    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while we looked
        if fields[1] == str(os.getpid()) and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found - {getattr(resource_tracker._resource_tracker, "_pid", None)}


def jpeg_bytes(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    random_image(width, height, seed).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


async def test_processes_equal_threads_and_clean_up(qwen25_path: str) -> None:
    limits = MediaLimits(max_image_pixels=500 * 500)
    encoder = await trio.to_thread.run_sync(lambda: load_encoder(qwen25_path, dtype="float32"))
    local = EncoderPreprocessor(encoder.adapter, encoder.processors, limits)
    requests = [[png_bytes(224, 224, seed=1)], [jpeg_bytes(120, 360, 2), png_bytes(56, 84, 3)],
                [random_image(28, 56, seed=4)]]
    before_segments, before_children = segments(), children()
    async with open_preprocess_pool(PoolSpec(qwen25_path, limits), workers=2) as pool:
        assert len(children() - before_children) >= 2
        for items in requests:
            got = await pool.preprocess(items, "image")
            want = local.preprocess(items, "image")
            assert (got.grid_thw, got.token_counts, got.modality) == (
                want.grid_thw, want.token_counts, want.modality)
            assert got.inputs.keys() == want.inputs.keys()
            for key, value in want.inputs.items():
                assert got.inputs[key].dtype == value.dtype and torch.equal(got.inputs[key], value)
        # errors come back typed, by name, with the item named
        with pytest.raises(PayloadTooLargeError, match="item 1"):
            await pool.preprocess([png_bytes(28, 28), png_bytes(600, 600)], "image")
        with pytest.raises(RequestError, match="item 0: bytes are not an image"):
            await pool.preprocess([b"garbage"], "image")
        # cancelled while the children work (and while waiting for one): nothing leaks
        big = [png_bytes(480, 480, seed=s) for s in range(3)]
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(pool.preprocess, big, "image")
            await trio.testing.wait_all_tasks_blocked()
            # two calls per child in the pool (one running, the next queued behind it), two
            # waiting their turn in trio
            assert pool.statistics().running == 4
            nursery.cancel_scope.cancel()
        assert pool.statistics().running == 0
        ok = await pool.preprocess([png_bytes(56, 56)], "image")
        assert ok.token_counts == (4,)
        stats = pool.statistics()
        assert stats.failed == 2 and stats.restarts == 0 and stats.slot_bytes > 0
    # every slot came back, the cancelled calls' once their children were done (closing
    # waits for them), and closing unlinked them
    stats = pool.statistics()
    assert stats.slots_free == 3 * stats.workers and stats.slot_bytes == 0
    assert segments() <= before_segments
    assert children() <= before_children


async def test_results_land_in_standing_slots(qwen25_path: str) -> None:
    """A slot is made on its first miss and reused after; one too big for any slot takes a
    fresh segment and leaves the slots as they were; the same tensors either way."""
    from epd_trio.engine import preprocess_pool

    limits = MediaLimits(max_image_pixels=1024 * 1024)
    encoder = await trio.to_thread.run_sync(lambda: load_encoder(qwen25_path, dtype="float32"))
    local = EncoderPreprocessor(encoder.adapter, encoder.processors, limits)
    small, large = [png_bytes(224, 224, seed=1)], [png_bytes(448, 448, seed=2)]
    before = segments()
    async with open_preprocess_pool(PoolSpec(qwen25_path, limits), workers=1) as pool:
        # 224^2: 256 patches x 1176 float32 = 1.2 MB, a 2 MiB slot; 448^2's 4.8 MB fits none
        pool._arena.max_bytes = 2 << 20
        for _i in range(4):  # one at a time: each call takes the slot the last one gave back
            got = await pool.preprocess(small, "image")
            assert torch.equal(got.inputs["pixel_values"], local.preprocess(small, "image").inputs["pixel_values"])
        s = pool.statistics()
        assert (s.slot_misses, s.slot_hits, s.slot_bytes) == (1, 3, 2 << 20)
        got = await pool.preprocess(large, "image")
        assert torch.equal(got.inputs["pixel_values"], local.preprocess(large, "image").inputs["pixel_values"])
        s = pool.statistics()
        assert (s.slot_misses, s.slot_hits, s.slot_bytes) == (2, 3, 2 << 20)
        assert len(segments() - before) == 1  # the one slot; the large result's segment is gone
    assert segments() <= before
    assert preprocess_pool.SLOTS_PER_WORKER == 3


async def test_a_request_cancelled_as_its_answer_arrives_leaves_no_segment(
        qwen25_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child has written a fresh segment and answered; the caller is cancelled before the
    copy out of it starts: the segment must still go."""
    from epd_trio.engine import preprocess_pool

    before = segments()
    async with open_preprocess_pool(PoolSpec(qwen25_path, MediaLimits()), workers=1) as pool:
        pool._arena.acquire = lambda: None  # no standing slot: the answer comes in a segment
        real, calls = trio.to_thread.run_sync, []
        with trio.CancelScope() as scope:
            async def cancelled_before_the_copy(fn, *args, **kw):  # type: ignore[no-untyped-def]
                calls.append(fn)
                scope.cancel()  # the child's answer came without a thread; this one copies
                return await real(fn, *args, **kw)

            monkeypatch.setattr(preprocess_pool.trio.to_thread, "run_sync", cancelled_before_the_copy)
            await pool.preprocess([png_bytes(56, 56, seed=3)], "image")
        monkeypatch.undo()
        assert scope.cancelled_caught and len(calls) == 1
        assert segments() <= before, segments() - before
        got = await pool.preprocess([png_bytes(56, 56, seed=3)], "image")  # the pool still serves
        assert got.inputs["pixel_values"].shape[0] > 0
    assert segments() <= before


async def test_engine_in_process_mode_equals_thread_mode(qwen25_path: str) -> None:
    items = [png_bytes(112, 84, seed=5), jpeg_bytes(224, 224, 6)]
    before_segments = segments()
    async with open_engine(model_path=qwen25_path, dtype="float32") as engine:
        want = await engine.encode(items, "image")
    async with open_engine(model_path=qwen25_path, dtype="float32", preprocess_mode="process",
                           preprocess_workers=2, preprocess_threads=2) as engine:
        assert engine.preprocess_pool is not None
        # the children preprocess; the engine's own lane only hashes: one thread, not two
        assert [t.name for t in threading.enumerate() if t.name.startswith("epd-preprocess-")] \
            == ["epd-preprocess-0"]
        assert engine.preprocess_pool.spec.torch_threads == 2  # --preprocess-threads reaches the children
        got = await engine.encode(items, "image")
        assert engine.preprocess_pool.statistics().done == 1
    assert got.token_counts == want.token_counts and got.grid_thw == want.grid_thw
    assert torch.equal(got.embedding, want.embedding)
    assert segments() <= before_segments


async def test_engine_preprocess_device_cpu_equals_default(qwen25_path: str) -> None:
    items = [jpeg_bytes(224, 224, 7), png_bytes(120, 360, 8)]
    async with open_engine(model_path=qwen25_path, dtype="float32") as engine:
        want = await engine.encode(items, "image")
    async with open_engine(model_path=qwen25_path, dtype="float32", preprocess_device="cpu") as engine:
        got = await engine.encode(items, "image")
    assert torch.allclose(got.embedding, want.embedding, rtol=0, atol=0)


async def test_a_dead_child_fails_its_request_and_the_pool_restarts(qwen25_path: str) -> None:
    before_segments, before_children = segments(), children()
    async with open_preprocess_pool(PoolSpec(qwen25_path, MediaLimits()), workers=1) as pool:
        (child,) = children() - before_children
        os.kill(child, signal.SIGKILL)
        with pytest.raises(EncodeError, match="preprocessing process died"):
            await pool.preprocess([png_bytes(56, 56)], "image")
        ok = await pool.preprocess([png_bytes(56, 56)], "image")
        assert ok.token_counts == (4,)
        assert pool.statistics().restarts == 1
    assert segments() <= before_segments
    assert children() <= before_children


async def test_both_calls_of_a_dead_child_fail_and_the_pool_restarts_once(qwen25_path: str) -> None:
    """A child has two calls in the pool: when it dies, both fail (500), one restart serves
    the next, and every slot comes back."""
    before_children = children()
    async with open_preprocess_pool(PoolSpec(qwen25_path, MediaLimits()), workers=1) as pool:
        (child,) = children() - before_children
        os.kill(child, signal.SIGKILL)
        failures: list[BaseException] = []

        async def call() -> None:
            try:
                await pool.preprocess([png_bytes(56, 56)], "image")
            except EncodeError as exc:
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            nursery.start_soon(call)
        assert len(failures) == 2 and all("preprocessing process died" in str(e) for e in failures)
        ok = await pool.preprocess([png_bytes(56, 56)], "image")
        assert ok.token_counts == (4,)
        stats = pool.statistics()
        assert stats.restarts == 1 and stats.failed == 2 and stats.slots_free == 3
    assert children() <= before_children


async def test_a_child_that_never_finishes_is_ended_after_the_grace(
        qwen25_path: str, caplog: pytest.LogCaptureFixture) -> None:
    """A stopped child (as stuck as a child can be: it does not even see SIGTERM) holds
    the pool's exit only for its grace period, twice: terminated, then killed."""
    grace = 0.5
    before_segments, before_children = segments(), children()
    started = trio.current_time()
    with trio.fail_after(60):
        async with open_preprocess_pool(PoolSpec(qwen25_path, MediaLimits()), workers=1,
                                        shutdown_grace=grace) as pool:
            assert (await pool.preprocess([png_bytes(56, 56)], "image")).token_counts == (4,)
            (child,) = children() - before_children
            os.kill(child, signal.SIGSTOP)
            leaving = trio.current_time()
    took = trio.current_time() - leaving
    assert 2 * grace <= took < 2 * grace + 10, took  # the terminate did nothing; the kill did
    assert "still running 0.5 s after the pool began to close: terminate" in caplog.text
    assert "still running 0.5 s after the pool began to close: kill" in caplog.text
    assert children() <= before_children and segments() <= before_segments
    assert trio.current_time() - started < 60


def test_config_refuses_unknown_modes_and_device_processes() -> None:
    with pytest.raises(ValueError, match="preprocess_mode"):
        EngineConfig(preprocess_mode="fork")
    with pytest.raises(ValueError, match="cannot take preprocess_device"):
        EngineConfig(preprocess_mode="process", preprocess_device="cuda")
    assert EngineConfig(preprocess_mode="process", preprocess_device="cpu").preprocess_device == "cpu"


@pytest.mark.parametrize(("arch", "modality"), [("qwen3_vl", "video"), ("qwen2_audio", "audio")])
async def test_video_and_audio_through_processes_equal_threads(
        checkpoints: dict[str, str], arch: str, modality: str) -> None:
    """Other tensors and per-item extras (Qwen3-VL's timestamps) cross the boundary intact."""
    path = checkpoints[arch]
    if modality == "video":
        items = [sample_video(frames=6, fps=4.0, width=56, height=42), generated_frames(4, 40, 60, seed=4)]
    else:
        items = [sample_tone(0.5), sample_tone(1.2, hz=220.0)]
    encoder = await trio.to_thread.run_sync(lambda: load_encoder(path, dtype="float32"))
    want = EncoderPreprocessor(encoder.adapter, encoder.processors, MediaLimits()).preprocess(items, modality)
    async with open_preprocess_pool(PoolSpec(path, MediaLimits()), workers=1) as pool:
        got = await pool.preprocess(items, modality)
    assert (got.grid_thw, got.token_counts, got.extras) == (want.grid_thw, want.token_counts, want.extras)
    assert got.inputs.keys() == want.inputs.keys()
    for key, value in want.inputs.items():
        assert got.inputs[key].dtype == value.dtype and torch.equal(got.inputs[key], value), key


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
async def test_a_cuda_preprocess_device_without_cuda_is_refused_at_start(qwen25_path: str) -> None:
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        async with open_engine(model_path=qwen25_path, preprocess_device="cuda"):
            pass  # pragma: no cover
