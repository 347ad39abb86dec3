"""torchvision decoding (JPEG) equals PIL's, PNG is PIL's, and the device path equals the CPU path."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import assert_corrupt_jpegs_handled, decode_corrupt_jpegs_in_child, random_image
from epd_trio.errors import OverloadedError, PayloadTooLargeError, RequestError
from epd_trio.model.image_decode import decode_image_tensor, fast_format
from epd_trio.model.loader import load_encoder
from epd_trio.model.media import MediaLimits, decode_image, decoder_message
from epd_trio.model.preprocess import EncoderPreprocessor
from epd_trio.scheduling.failures import is_device_error

LIMITS = MediaLimits()


def encoded(image: Image.Image, fmt: str, **save: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def as_array(decoded: object) -> np.ndarray:
    if isinstance(decoded, torch.Tensor):
        return decoded.permute(1, 2, 0).numpy()
    return np.asarray(decoded)


def gradient(width: int, height: int, mode: str) -> Image.Image:
    """Smooth content: JPEG's chroma upsampling matters there, unlike on noise."""
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    rgb = np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], axis=2).astype(np.uint8)
    return Image.fromarray(rgb).convert(mode)


FAST_CASES = [
    ("JPEG", "RGB", {"quality": 90}),
    ("JPEG", "RGB", {"quality": 75, "subsampling": 0}),
    ("JPEG", "RGB", {"quality": 95, "progressive": True}),
    ("JPEG", "L", {}),
]


@pytest.mark.parametrize(("fmt", "mode", "save"), FAST_CASES)
@pytest.mark.parametrize("size", [(224, 224), (333, 101), (17, 9)])
def test_torchvision_decode_equals_pil(fmt: str, mode: str, save: dict, size: tuple[int, int]) -> None:
    for image in (random_image(*size, seed=3, mode=mode), gradient(*size, mode)):
        data = encoded(image, fmt, **save)
        assert fast_format(data, 0, LIMITS) == fmt
        fast = decode_image_tensor(data, 0, LIMITS)
        assert isinstance(fast, torch.Tensor) and fast.dtype == torch.uint8
        assert np.array_equal(as_array(fast), np.asarray(decode_image(data, 0, LIMITS)))


@pytest.mark.parametrize(("fmt", "mode"), [("JPEG", "CMYK"), ("PNG", "RGB"), ("PNG", "L"),
                                            ("PNG", "RGBA"), ("PNG", "P"), ("PNG", "I;16"),
                                            ("GIF", "P"), ("WEBP", "RGB")])
def test_other_formats_go_through_pil(fmt: str, mode: str) -> None:
    image = random_image(40, 30, seed=1).convert("RGB" if mode == "I;16" else mode)
    if mode == "I;16":
        image = Image.fromarray(np.asarray(image.convert("L"), dtype=np.uint16) * 257)
    data = encoded(image, fmt)
    assert fast_format(data, 0, LIMITS) is None
    out = decode_image_tensor(data, 0, LIMITS)
    assert isinstance(out, Image.Image) and out.mode == "RGB"
    assert np.array_equal(np.asarray(out), np.asarray(decode_image(data, 0, LIMITS)))


# 40x30 RGB PNG whose first IDAT payload has byte 2 flipped (CRC fixed): corrupt deflate data.
# torchvision 0.29's decode_png crashed the whole process on it (libpng error, then SIGSEGV).
CORRUPT_IDAT_PNG = ("iVBORw0KGgoAAAANSUhEUgAAACgAAAAeCAIAAADRv8uKAAAAKklEQVR4nBLNMQEAAAgDIKf9O1vBzwcKkPTU"
                    "h35ZxWKxWCwWi8VisVh8sgy2AEIoK7QCAAAAAElFTkSuQmCC")


def test_a_corrupt_png_is_a_request_error_not_a_crash() -> None:
    """In a child process: a regression would kill it (SIGSEGV), not the test run."""
    script = (
        "import base64\n"
        "from epd_trio.errors import RequestError\n"
        "from epd_trio.model.image_decode import decode_image_tensor\n"
        "from epd_trio.model.media import MediaLimits\n"
        f"data = base64.b64decode({CORRUPT_IDAT_PNG!r})\n"
        "try:\n"
        "    decode_image_tensor(data, 3, MediaLimits())\n"
        "except RequestError as exc:\n"
        "    print(exc.message)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("item 3: image cannot be decoded"), done.stdout


def test_corrupt_jpegs_are_refused_or_decoded_never_a_crash() -> None:
    """libjpeg-turbo on damaged data (in a child process: a crash kills it, not the run)."""
    result = decode_corrupt_jpegs_in_child("cpu")
    assert_corrupt_jpegs_handled(result, "cpu")
    assert result["seen"]["baseline cut in its header"][0] == "refused"


@pytest.mark.parametrize(("raised", "said"), [
    (RuntimeError("decode_jpeg, /__w/vision/csrc/io/image/cpu/decode_jpeg.cpp:171, Bogus marker"),
     "Bogus marker"),
    (RuntimeError("shape '[2, 3]' is invalid for input of size 7\nException raised from x at a.cpp:1"),
     "shape '[2, 3]' is invalid for input of size 7"),
    (ValueError("Unable to infer channel dimension format"), "Unable to infer channel dimension format"),
    (ValueError(""), "ValueError"),
])
def test_a_decoders_message_reaches_the_client_without_its_source_path(raised: Exception, said: str) -> None:
    assert decoder_message(raised) == said


NVJPEG = "Error while decoding JPEG images: Failed to decode jpeg stream: "  # torchvision's words


ANY_DEVICE = [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), OverloadedError),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), RuntimeError),
    (RuntimeError("Error while decoding JPEG images: bad data"), RequestError),
]
NVJPEG_STATUSES = [  # read only on a CUDA decode: on the CPU, libjpeg-turbo's words are the image's
    (RuntimeError(NVJPEG + "5"), OverloadedError, RequestError),  # NVJPEG_STATUS_ALLOCATOR_FAILURE
    (RuntimeError(NVJPEG + "6"), RuntimeError, RequestError),  # EXECUTION_FAILED: the device's
    (RuntimeError(NVJPEG + "8"), RuntimeError, RequestError),  # INTERNAL_ERROR
    (RuntimeError(NVJPEG + "3"), RequestError, RequestError),  # BAD_JPEG: the image's
    (RuntimeError(NVJPEG + "10"), RequestError, RequestError),  # INCOMPLETE_BITSTREAM
]


@pytest.mark.parametrize(("raised", "expected", "device"), [
    *[(r, e, d) for r, e in ANY_DEVICE for d in ("cpu", "cuda:0")],
    *[(r, on_cuda, "cuda:0") for r, on_cuda, _ in NVJPEG_STATUSES],
    *[(r, on_cpu, "cpu") for r, _, on_cpu in NVJPEG_STATUSES],
])
def test_a_device_failure_while_decoding_is_not_the_images_fault(
        monkeypatch: pytest.MonkeyPatch, raised: Exception, expected: type, device: str) -> None:
    """Out of memory is a 503 (retry later), a failed device a 500 — neither a 400 that
    blames the image (nor one that shows the device's memory figures). nvJPEG's own
    failures end in its status number, read for what it says."""
    import epd_trio.model.image_decode as image_decode

    class Ops:
        def decode_jpeg(self, *args: object) -> None:
            raise raised

        def decode_jpegs_cuda(self, *args: object) -> None:  # the operator --preprocess-device cuda uses
            raise raised

    monkeypatch.setattr(image_decode, "_image_ops", Ops)
    with pytest.raises(expected) as caught:
        decode_image_tensor(encoded(random_image(16, 16), "JPEG"), 5, LIMITS, device)
    assert type(caught.value) is expected
    if expected is OverloadedError:
        assert caught.value.message == f"item 5: the preprocessing device ({device}) is out of memory"
    if expected is RuntimeError:
        assert is_device_error(caught.value)


def test_a_processor_out_of_memory_on_the_device_is_a_503_not_the_items_fault(  # type: ignore[no-untyped-def]
        loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    pre = EncoderPreprocessor(loaded.adapter, loaded.processors, LIMITS)

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setitem(pre.processors, "image", out_of_memory)
    with pytest.raises(OverloadedError, match=r"item 0: the preprocessing device .* is out of memory"):
        pre.preprocess([encoded(random_image(56, 56), "PNG")], "image")


def test_caps_and_bad_bytes_are_refused_as_before() -> None:
    data = encoded(random_image(100, 100), "JPEG")
    with pytest.raises(PayloadTooLargeError, match="over the cap"):
        decode_image_tensor(data, 2, MediaLimits(max_image_pixels=99 * 100))
    with pytest.raises(RequestError, match="item 1"):
        decode_image_tensor(data[: len(data) // 2], 1, LIMITS)
    with pytest.raises(RequestError, match="item 0: bytes are not an image"):
        decode_image_tensor(b"not an image", 0, LIMITS)


@pytest.fixture(scope="module")
def loaded(qwen25_path: str):  # type: ignore[no-untyped-def]
    return load_encoder(qwen25_path, dtype="float32")


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_tensor_and_device_paths_equal_the_pil_path(loaded, fmt: str) -> None:  # type: ignore[no-untyped-def]
    """The default (torchvision) and ``device="cpu"`` paths give PIL's pixel_values, bit for bit."""
    items = [encoded(random_image(w, h, seed=i), fmt) for i, (w, h) in enumerate([(224, 224), (120, 360)])]
    items.append(random_image(56, 84, seed=9))  # an in-process PIL image takes the PIL path
    made = {
        name: EncoderPreprocessor(loaded.adapter, loaded.processors, LIMITS, **kw).preprocess(items, "image")
        for name, kw in {"pil": {"decoder": "pil"}, "tensor": {}, "device": {"device": "cpu"}}.items()
    }
    for name in ("tensor", "device"):
        assert made[name].grid_thw == made["pil"].grid_thw
        assert made[name].token_counts == made["pil"].token_counts
        for key, value in made["pil"].inputs.items():
            assert torch.equal(made[name].inputs[key].cpu(), value), (name, key)


class RecordingStreams:
    """Stands in for the per-thread CUDA stream scope; records what ran inside it."""

    decode_device = "cpu"

    def __init__(self) -> None:
        self.inside = False
        self.scopes = 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        self.scopes += 1
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def test_a_requests_items_and_their_join_run_in_one_stream_scope(loaded, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On CUDA the join's cat reads device tensors: it must run on the thread's stream too."""
    pre = EncoderPreprocessor(loaded.adapter, loaded.processors, LIMITS, device="cpu")
    streams = pre._streams = RecordingStreams()  # type: ignore[assignment]
    seen: list[tuple[str, bool]] = []
    real_item, real_collate = pre.adapter.item_result, pre.adapter.collate
    monkeypatch.setattr(pre.adapter, "item_result",
                        lambda *a: seen.append(("item", streams.inside)) or real_item(*a))
    monkeypatch.setattr(pre.adapter, "collate",
                        lambda parts: seen.append(("join", streams.inside)) or real_collate(parts))
    items = [encoded(random_image(56, 56, seed=i), "PNG") for i in range(2)]
    result = pre.preprocess(items, "image")
    assert seen == [("item", True), ("item", True), ("join", True)]
    assert streams.scopes == 1  # one synchronize per request, not one per item
    assert len(result.token_counts) == 2 and len(result.grid_thw) == 2


def test_unknown_decoder_is_refused(loaded) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="decoder"):
        EncoderPreprocessor(loaded.adapter, loaded.processors, LIMITS, decoder="simd")
