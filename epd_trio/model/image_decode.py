"""Image decoding straight to a tensor: torchvision's libjpeg-turbo for JPEG, PIL for the rest.

The image processor wants a ``[3, H, W]`` uint8 tensor in the end; decoding a
JPEG with torchvision's operator gives one directly (no PIL image, no
PIL→numpy copy) and is faster than ``PIL.Image.open(...).convert("RGB")``
(448×448: ~1.6 against ~2.2 ms on this machine), with the **same pixels**:
both decode with libjpeg's default (accurate DCT, fancy upsampling) and
neither applies EXIF orientation (``tests/model/test_image_decode.py`` checks
equality byte for byte). It also decodes a JPEG on a CUDA device (nvJPEG) for
``--preprocess-device cuda``.

Only 8-bit JPEG in RGB or grayscale (baseline or progressive: nvJPEG decodes
a progressive one in software) takes this path; anything else goes through
PIL's ``decode_image``. PNG does too, although torchvision
decodes it to the same pixels: torchvision's libpng error handling crashes
the process (SIGSEGV) on corrupt deflate data in an IDAT chunk, and a network
peer must never be able to kill the encoder; PIL refuses such a file with an
error, at about the same speed. The pixel caps are checked on PIL's header
read first, before any decoding, in both paths.
"""

from __future__ import annotations

import re
from typing import Any

from epd_trio.model.media import MediaLimits, decode_image, decoder_message, item_error, open_image
from epd_trio.scheduling.failures import raise_if_device_failure

__all__ = ["decode_image_tensor", "fast_format"]

# (PIL format, PIL mode) pairs whose torchvision decode equals PIL's convert("RGB") and that
# are safe to give it (not PNG: see the module docstring).
_FAST = frozenset({("JPEG", "RGB"), ("JPEG", "L")})
_RGB = 3  # torchvision.io.ImageReadMode.RGB
# nvjpegStatus_t (nvjpeg.h): 5 ALLOCATOR_FAILURE; 1 NOT_INITIALIZED, 6 EXECUTION_FAILED,
# 7 ARCH_MISMATCH, 8 INTERNAL_ERROR are the device's; 2-4, 9, 10 are the data's.
_NVJPEG_STATUS = re.compile(r"(?i)(?:jpeg|nvjpeg)[\w ]*: (\d{1,2})$")
_NVJPEG_ALLOCATOR_FAILURE = 5
_NVJPEG_DEVICE_FAILURES = frozenset({1, 6, 7, 8})


def _image_ops() -> Any:
    """torchvision's image operators (libjpeg-turbo, libpng, nvJPEG), or None without them.

    Called directly: since torchvision 0.29 its Python wrappers
    (``torchvision.io.decode_jpeg``...) warn that they move to TorchCodec,
    and every call would warn; the operators they call are these.
    """
    try:
        import torch
        from torchvision.io import image  # registers torch.ops.image

        return torch.ops.image if image._has_image_ops() else None
    except (ImportError, AttributeError, OSError):
        return None


def fast_format(data: bytes, index: int, limits: MediaLimits) -> str | None:
    """``"JPEG"`` when torchvision decodes ``data`` exactly as PIL does (and safely), else None.

    Reads the header only; a header over the pixel caps is refused here.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with open_image(data) as image:
            width, height = image.size
            kind = (image.format, image.mode)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError,
            Image.DecompressionBombError, Image.DecompressionBombWarning):
        return None  # decode_image names the problem
    if width * height > limits.max_image_pixels or width <= 0 or height <= 0:
        return None  # decode_image refuses it with the usual message
    return kind[0] if kind in _FAST else None


def decode_image_tensor(data: Any, index: int, limits: MediaLimits, device: str = "cpu") -> Any:
    """A ``[3, H, W]`` uint8 tensor (on ``device`` for a JPEG), or an RGB PIL image.

    The PIL image comes back for the formats this path does not prove equal;
    the image processor takes either.
    """
    fmt = fast_format(data, index, limits) if isinstance(data, bytes) else None
    if fmt is None:
        return decode_image(data, index, limits)
    ops = _image_ops()
    if ops is None:
        return decode_image(data, index, limits)
    import torch

    # bytearray: torch.frombuffer warns on read-only buffers; the copy is the
    # compressed size only.
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    on_cuda = torch.device(device).type == "cuda"
    try:
        if on_cuda:
            return ops.decode_jpegs_cuda([raw], _RGB, torch.device(device))[0]
        return ops.decode_jpeg(raw, _RGB, False)
    except RuntimeError as exc:
        raise_if_device_failure(_nvjpeg_failure(exc) if on_cuda else exc, f"item {index}", device)
        raise item_error(index, f"image cannot be decoded ({decoder_message(exc)})") from None


def _nvjpeg_failure(exc: RuntimeError) -> BaseException:
    """``exc``, or what its nvJPEG status says when that is the device's fault: torchvision
    reports nvJPEG's failures as "...: <status>", which no CUDA error marker matches."""
    status = _NVJPEG_STATUS.search(str(exc).strip())
    if status is None:
        return exc
    code = int(status.group(1))
    if code == _NVJPEG_ALLOCATOR_FAILURE:
        return RuntimeError(f"CUDA out of memory in nvJPEG's allocator: {exc}")  # as torch says it
    if code in _NVJPEG_DEVICE_FAILURES:
        failed = RuntimeError(f"CUDA error: nvJPEG failed on the device (status {code}): {exc}")
        failed.__cause__ = exc
        return failed
    return exc  # bad or unsupported data: the image's
