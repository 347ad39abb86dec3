"""Wire protocol v1 codecs: round trips, and every way a peer can be wrong."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from epd_trio.errors import EncodeError, ProtocolError, TransferTimeout
from epd_trio.protocol import (
    EmbeddingHeader,
    decode_safetensors,
    decode_zmq_message,
    encode_safetensors,
    encode_zmq_message,
    error_message,
    header_for,
    header_to_map,
)
from epd_trio.protocol.payload import MAX_PAYLOAD_FRAMES, Payload, split_frames

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def random_bits(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every bit pattern (NaN payloads, infs, subnormals), not only nice floats."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (shape[0], shape[1] * itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def image_header(t: torch.Tensor, **over: Any) -> EmbeddingHeader:
    kw: dict[str, Any] = dict(
        req_id="req-1", part_idx=1, num_parts=3, modality="image",
        token_counts=[t.shape[0] - 2, 2], grid_thw=[[1, 4, 6], [1, 2, 4]],
    )
    kw.update(over)
    return header_for(t, **kw)


def valid_map() -> dict[str, Any]:
    return header_to_map(image_header(torch.zeros(8, 4, dtype=torch.float16)))


def frames_of(m: object, payload: bytes | None = None) -> list[bytes]:
    head = msgpack.packb(m, use_bin_type=True)
    return [head] if payload is None else [head, payload]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zmq_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    t = random_bits((37, 24), dtype, seed=3)
    header = image_header(t)
    frames = encode_zmq_message(header, t)
    got_header, got = decode_zmq_message([bytes(f) for f in frames])
    assert got_header == header
    assert got is not None and got.dtype == dtype and got.shape == (37, 24)
    assert torch.equal(bits(got.tensor()), bits(t))


def test_encode_shares_the_tensor_memory() -> None:
    t = torch.zeros(64, 1024, dtype=torch.bfloat16)
    payload = encode_zmq_message(image_header(t), t)[1]
    t[0, 0] = 1.0
    assert bytes(memoryview(payload)[:2]) == bits(t[0, :1]).numpy().tobytes() != b"\0\0"


def test_decode_is_zero_copy_over_a_writable_frame() -> None:
    t = random_bits((4, 8), torch.float32)
    head, payload = encode_zmq_message(image_header(t), t)
    buffer = bytearray(memoryview(payload))
    _, got = decode_zmq_message([head, buffer])
    buffer[0:4] = b"\0\0\0\0"
    assert got is not None and got.tensor()[0, 0].item() == 0.0


def test_decode_copies_a_read_only_frame_without_warning() -> None:
    t = random_bits((4, 8), torch.float32)
    head, payload = encode_zmq_message(image_header(t), t)
    _, got = decode_zmq_message([head, bytes(payload)])  # filterwarnings=error
    assert got is not None and torch.equal(bits(got.tensor()), bits(t))


@pytest.mark.parametrize("frame_bytes", [1, 100, 3552, 4096])
def test_a_tensor_split_into_frames_round_trips(frame_bytes: int) -> None:
    t = random_bits((37, 24), torch.float32, seed=5)  # 3552 bytes
    frames = encode_zmq_message(image_header(t), t, frame_bytes=frame_bytes)
    assert len(frames) == 1 + -(-3552 // frame_bytes)
    assert all(memoryview(f).nbytes <= frame_bytes for f in frames[1:])
    _, got = decode_zmq_message([bytes(f) for f in frames])  # read-only frames: no warning
    assert got is not None and got.nbytes == 3552
    assert torch.equal(bits(got.tensor()), bits(t))
    dest = torch.full((37, 24), 7.0)
    got.copy_into(dest)
    assert torch.equal(bits(dest), bits(t))


def test_the_frames_are_views_of_the_tensor() -> None:
    t = torch.zeros(64, 1024, dtype=torch.bfloat16)  # 128 KiB
    frames = encode_zmq_message(image_header(t), t, frame_bytes=1 << 16)
    t[-1, -1] = 1.0
    assert len(frames) == 3 and bytes(memoryview(frames[2])[-2:]) == bits(t[-1, -1:]).numpy().tobytes()


def test_a_payload_copies_only_into_its_own_shape() -> None:
    payload = Payload.of(torch.ones(4, 8))
    for dest in (torch.empty(4, 8, dtype=torch.float16), torch.empty(8, 4),
                 torch.empty(8, 4).t()):
        with pytest.raises(ValueError, match="contiguous"):
            payload.copy_into(dest)


def test_split_frames_bounds_the_count() -> None:
    assert [f.nbytes for f in split_frames(memoryview(bytes(0)))] == [0]
    with pytest.raises(ValueError, match="exceed"):
        split_frames(memoryview(bytes(MAX_PAYLOAD_FRAMES + 1)), 1)


def test_non_contiguous_tensor_is_sent_in_logical_order() -> None:
    t = random_bits((6, 10), torch.float16).t()  # [10, 6], strides (1, 10)
    _, got = decode_zmq_message(encode_zmq_message(image_header(t), t))
    assert got is not None and torch.equal(bits(got.tensor()), bits(t))


def test_zero_token_embedding_round_trips() -> None:
    t = torch.empty(0, 16, dtype=torch.bfloat16)
    header = header_for(t, req_id="r", part_idx=0, num_parts=1, modality="audio", token_counts=[])
    got_header, got = decode_zmq_message(encode_zmq_message(header, t))
    assert got_header.shape == (0, 16) and got is not None and got.tensor().shape == (0, 16)


def test_audio_has_no_grid() -> None:
    t = torch.ones(5, 2)
    header = header_for(t, req_id="a", part_idx=0, num_parts=1, modality="audio",
                        token_counts=[2, 3])
    assert decode_zmq_message(encode_zmq_message(header, t))[0].grid_thw == []


@pytest.mark.parametrize(
    ("exc", "kind", "status", "message"),
    [
        (TransferTimeout("gave up after 3 s"), "TransferTimeout", 504, "gave up after 3 s"),
        (EncodeError("bad image", status_code=400), "EncodeError", 400, "bad image"),
        (RuntimeError("secret /path/in/trace"), "InternalError", 500,
         "internal error in the encoder"),
    ],
)
def test_error_message_round_trip(exc: Exception, kind: str, status: int, message: str) -> None:
    frames = error_message("req-9", 2, 4, "video", exc)
    header, tensor = decode_zmq_message(frames)
    assert tensor is None and len(frames) == 1
    assert (header.kind, header.req_id, header.part_idx, header.num_parts) == (
        "error", "req-9", 2, 4)
    assert header.error is not None
    assert (header.error.type, header.error.status, header.error.message) == (
        kind, status, message)


def test_error_message_truncates_a_huge_message() -> None:
    header, _ = decode_zmq_message(error_message("r", 0, 1, "image", EncodeError("x" * 10**5)))
    assert header.error is not None and len(header.error.message) == 4096


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (None, "needs its tensor"),
        (torch.zeros(8, 4, dtype=torch.float32), "does not match"),
        (torch.zeros(8, 5, dtype=torch.float16), "does not match"),
    ],
)
def test_encode_refuses_a_tensor_that_disagrees(tensor: torch.Tensor | None, match: str) -> None:
    header = image_header(torch.zeros(8, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match=match):
        encode_zmq_message(header, tensor)


def test_encode_refuses_an_invalid_header() -> None:
    t = torch.zeros(8, 4)
    with pytest.raises(ProtocolError, match="token_counts"):
        encode_zmq_message(image_header(t, token_counts=[1, 2]), t)


def test_header_for_refuses_unsupported_tensors() -> None:
    with pytest.raises(ValueError, match="dtype"):
        image_header(torch.zeros(8, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="tokens, dim"):
        image_header(torch.zeros(2, 4, 4))


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda m: m.__setitem__(key, value)


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda m: m.pop(key)


BAD_HEADERS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("v2", _set("v", 2), "version"),
    ("v-str", _set("v", "1"), r"Expected `int`, got `str` - at `\$\.v`"),
    ("v-bool", _set("v", True), r"Expected `int`, got `bool` - at `\$\.v`"),
    ("no-v", _drop("v"), "missing required field `v`"),
    ("no-req-id", _drop("req_id"), "missing required field `req_id`"),
    ("unknown-key", _set("pickle", "x"), "unknown field `pickle`"),
    ("kind", _set("kind", "tensor"), r"Invalid enum value 'tensor' - at `\$\.kind`"),
    ("dtype", _set("dtype", "int8"), r"Invalid enum value 'int8' - at `\$\.dtype`"),
    ("dtype-case", _set("dtype", "BFLOAT16"), r"'BFLOAT16' - at `\$\.dtype`"),
    ("modality", _set("modality", "text"), r"'text' - at `\$\.modality`"),
    ("req-id-empty", _set("req_id", ""), "req_id"),
    ("req-id-long", _set("req_id", "r" * 257), "req_id"),
    ("req-id-int", _set("req_id", 7), "req_id"),
    ("part-eq-num", _set("part_idx", 3), "part_idx < num_parts"),
    ("part-negative", _set("part_idx", -1), "part_idx < num_parts"),
    ("part-float", _set("part_idx", 1.0), r"got `float` - at `\$\.part_idx`"),
    ("num-parts-bool", _set("num_parts", True), r"got `bool` - at `\$\.num_parts`"),
    ("shape-1d", _set("shape", [8]), r"length 2, got 1 - at `\$\.shape`"),
    ("shape-3d", _set("shape", [8, 4, 1]), r"length 2, got 3 - at `\$\.shape`"),
    ("shape-map", _set("shape", {"a": 1}), r"Expected `array`, got `object` - at `\$\.shape`"),
    ("shape-negative", _set("shape", [-8, 4]), r">= 0 - at `\$\.shape\[0\]`"),
    ("shape-huge", _set("shape", [1 << 40, 1 << 40]), r"<= 16777216 - at `\$\.shape\[0\]`"),
    ("shape-str", _set("shape", ["8", 4]), r"got `str` - at `\$\.shape\[0\]`"),
    ("tokens-sum", _set("token_counts", [6, 1]), "sum to 7"),
    ("tokens-negative", _set("token_counts", [10, -2]), r">= 0 - at `\$\.token_counts\[1\]`"),
    ("tokens-not-list", _set("token_counts", 8), r"got `int` - at `\$\.token_counts`"),
    ("grid-not-list", _set("grid_thw", "1x4x6"), r"got `str` - at `\$\.grid_thw`"),
    ("grid-entry-2", _set("grid_thw", [[1, 4], [1, 2]]), r"length >= 3 - at `\$\.grid_thw\[0\]`"),
    ("grid-entry-int", _set("grid_thw", [1, 2]), r"got `int` - at `\$\.grid_thw\[0\]`"),
    ("grid-count", _set("grid_thw", [[1, 4, 6]]), "1 entries for 2 items"),
    ("embedding-with-error", _set("error", {"type": "X", "message": "", "status": 500}),
     "must not carry an error"),
]


@pytest.mark.parametrize(("mutate", "match"), [c[1:] for c in BAD_HEADERS],
                         ids=[c[0] for c in BAD_HEADERS])
def test_invalid_header_is_a_protocol_error(
    mutate: Callable[[dict[str, Any]], None], match: str
) -> None:
    m = valid_map()
    payload = bytes(8 * 4 * 2)
    decode_zmq_message(frames_of(m, payload))  # the unmutated map is fine
    mutate(m)
    with pytest.raises(ProtocolError, match=match):
        decode_zmq_message(frames_of(m, payload))


def error_map(**error: Any) -> dict[str, Any]:
    m = valid_map()
    m.update(kind="error", shape=[0, 0], token_counts=[], grid_thw=[])
    m["error"] = {"type": "EncodeError", "message": "boom", "status": 500, **error}
    return m


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        (frames_of([1, 2, 3]), "Expected `object`, got `array`"),
        (frames_of(valid_map()), "needs a tensor frame"),
        (frames_of(valid_map(), bytes(63)), "63 bytes, header says 64"),
        (frames_of(valid_map(), bytes(65)), "65 bytes, header says 64"),
        ([*frames_of(valid_map(), bytes(32)), bytes(31)], "63 bytes, header says 64"),
        ([msgpack.packb(valid_map())] + [b""] * (MAX_PAYLOAD_FRAMES + 1), "tensor frames"),
        ([], "empty message"),
        (frames_of(error_map(), b""), "no tensor frame"),
        (frames_of({**error_map(), "shape": [1, 1]}), r"shape \[0, 0\]"),
        (frames_of({**error_map(), "error": None}), "must carry an error"),
        (frames_of(error_map(status=200)), "error.status"),
        (frames_of(error_map(type="")), "error.type"),
        (frames_of(error_map(message="m" * 5000)), "error.message"),
        (frames_of({**error_map(), "error": {"type": "E", "message": "m"}}), r"field `status` - at `\$\.error`"),
        ([b"\x81\x01\x02", b""], "Expected `str`, got `int` - at `key`"),  # {1: 2}
        ([b"\xc1"], "not valid msgpack"),
        ([msgpack.packb(valid_map()) + b"\x00"], "not valid msgpack"),  # trailing data
        ([msgpack.packb({"v": msgpack.ExtType(5, b"x")})], "got `ext`"),
        ([msgpack.packb({"v": b"\x01"}, use_bin_type=True)], "got `bytes`"),
        ([b"\x91" * 5000], "Expected `object`, got `array`"),  # nesting deeper than any header
        ([bytes(2 << 20)], "header frame is"),
    ],
)
def test_malformed_message_is_a_protocol_error(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_zmq_message(frames)


def test_error_map_used_above_is_valid() -> None:
    header, tensor = decode_zmq_message(frames_of(error_map()))
    assert header.kind == "error" and tensor is None


def st_metadata(t: torch.Tensor) -> dict[str, Any]:
    return dict(req_id="inline-1", part_idx=0, num_parts=2, modality="video",
                token_counts=[t.shape[0]], grid_thw=[[2, 4, 4]])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_safetensors_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    t = random_bits((12, 20), dtype, seed=5)
    got, meta = decode_safetensors(encode_safetensors(t, st_metadata(t)))
    assert torch.equal(bits(got), bits(t)) and got.dtype == dtype
    assert meta == st_metadata(t)


def test_safetensors_body_opens_with_any_reader(tmp_path: Any) -> None:
    t = random_bits((3, 4), torch.bfloat16)
    path = tmp_path / "e.safetensors"
    path.write_bytes(encode_safetensors(t, st_metadata(t)))
    with safetensors.safe_open(str(path), "pt") as f:
        assert torch.equal(bits(f.get_tensor("embedding")), bits(t))
        meta = f.metadata()
    assert meta["req_id"] == "inline-1" and json.loads(meta["grid_thw"]) == [[2, 4, 4]]
    assert json.loads(meta["part_idx"]) == 0 and json.loads(meta["token_counts"]) == [3]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(12, 20), (1, 3), (7, 1)])
def test_our_safetensors_writer_equals_the_librarys(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """The body is written without ``safetensors.torch.save``: the library reads it to the same
    tensor and metadata as its own file, and its header is padded to 8 bytes as the format asks."""
    from safetensors.torch import load, save

    t = random_bits(shape, dtype, seed=3)
    ours = encode_safetensors(t, st_metadata(t))
    size = int.from_bytes(ours[:8], "little")
    assert size % 8 == 0 and ours[8:9] == b"{" and len(ours) == 8 + size + t.numel() * t.element_size()
    strings = {k: v if isinstance(v, str) else json.dumps(v) for k, v in st_metadata(t).items()}
    theirs = save({"embedding": t}, metadata=strings)
    assert torch.equal(bits(load(ours)["embedding"]), bits(load(theirs)["embedding"]))
    with _opened(ours) as f:
        assert _values(f.metadata()) == _values(strings)  # the same JSON, spacing aside


def _values(strings: dict[str, str]) -> dict[str, Any]:
    """Metadata strings as values: JSON where they are JSON, else the string itself."""
    def value(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return text
    return {key: value(text) for key, text in strings.items()}


@contextlib.contextmanager
def _opened(body: bytes) -> Iterator[Any]:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as file:
        file.write(body)
        file.flush()
        with safetensors.safe_open(file.name, "pt") as f:
            yield f


def test_encode_safetensors_refuses_bad_metadata() -> None:
    t = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="exactly the keys"):
        encode_safetensors(t, {**st_metadata(t), "extra": 1})
    with pytest.raises(ProtocolError, match="sum to 4"):
        encode_safetensors(t, {**st_metadata(t), "token_counts": [4]})


def st_body(tensors: dict[str, torch.Tensor], **meta: str) -> bytes:
    t = torch.zeros(3, 4)
    base = {k: v if isinstance(v, str) else json.dumps(v) for k, v in st_metadata(t).items()}
    return safetensors.torch.save(tensors, metadata={**base, **meta})


def patched_header(mutate: Callable[[dict[str, Any]], None]) -> bytes:
    body = st_body({"embedding": torch.zeros(3, 4)})
    size = int.from_bytes(body[:8], "little")
    head = json.loads(body[8 : 8 + size])
    mutate(head)
    raw = json.dumps(head).encode()
    return len(raw).to_bytes(8, "little") + raw + body[8 + size :]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "at least 8"),
        (bytes(7), "at least 8"),
        ((1 << 62).to_bytes(8, "little") + b"{}", "out of range"),
        ((2).to_bytes(8, "little") + b"\xff\xfe", "not JSON"),
        ((2).to_bytes(8, "little") + b"[]", "one tensor 'embedding'"),
        (st_body({"embedding": torch.zeros(3, 4), "other": torch.zeros(1)}), "one tensor"),
        (st_body({"hidden": torch.zeros(3, 4)}), "one tensor"),
        (st_body({"embedding": torch.zeros(3, 4, dtype=torch.float64)}), "dtype must be"),
        (st_body({"embedding": torch.zeros(3, 4, 1)}), r"length 2, got 3 - at `\$\.shape`"),
        (st_body({"embedding": torch.zeros(3, 4)}, token_counts="[3"), "not JSON"),
        (st_body({"embedding": torch.zeros(3, 4)}, token_counts="[2]"), "sum to 2"),
        (st_body({"embedding": torch.zeros(3, 4)}, part_idx="5"), "part_idx < num_parts"),
        (st_body({"embedding": torch.zeros(3, 4)}, modality="smell"), "modality"),
        (safetensors.torch.save({"embedding": torch.zeros(3, 4)}), "one tensor"),
        (patched_header(lambda h: h["__metadata__"].pop("grid_thw")), "lacks"),
        (patched_header(lambda h: h["__metadata__"].update(req_id=5)), "must be a string"),
        (patched_header(lambda h: h.update(__metadata__=[])), "must be a map"),
        (patched_header(lambda h: h["embedding"].update(data_offsets=[0, 8])), "unreadable"),
        (st_body({"embedding": torch.zeros(3, 4)})[:-1], "unreadable"),
    ],
)
def test_malformed_safetensors_is_a_protocol_error(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_safetensors(data)


def test_safetensors_ignores_a_writers_extra_metadata() -> None:
    _, meta = decode_safetensors(st_body({"embedding": torch.zeros(3, 4)}, format="pt"))
    assert "format" not in meta and meta["req_id"] == "inline-1"


# --- fuzzing: a peer's bytes may be anything; only ProtocolError may come out ----------

json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
header_keys = st.sampled_from([*sorted(valid_map()), "error", "x"])
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decodes_or_protocol_error(frames: list[bytes]) -> None:
    try:
        _, payload = decode_zmq_message(frames)
    except ProtocolError:
        return
    if payload is not None:  # what decodes must also be usable
        assert payload.tensor().shape == payload.shape


@FUZZ
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=5))
def test_fuzz_random_frames(frames: list[bytes]) -> None:
    decodes_or_protocol_error(frames)


@FUZZ
@given(st.lists(st.integers(0, 64), max_size=6))
def test_fuzz_payload_cut_anywhere_round_trips(cuts: list[int]) -> None:
    t = random_bits((8, 4), torch.float16, seed=len(cuts))  # 64 bytes
    head, payload = (bytes(f) for f in encode_zmq_message(image_header(t), t, frame_bytes=64))
    edges = [0, *sorted(cuts), 64]
    frames = [head, *(payload[a:b] for a, b in itertools.pairwise(edges))]
    _, got = decode_zmq_message(frames)
    assert got is not None and torch.equal(bits(got.tensor()), bits(t))


@FUZZ
@given(st.dictionaries(header_keys, json_like, max_size=12), st.binary(max_size=64))
def test_fuzz_random_header_maps(fields: dict[str, Any], payload: bytes) -> None:
    decodes_or_protocol_error(frames_of({**valid_map(), **fields}, payload))
    decodes_or_protocol_error(frames_of(fields))


@FUZZ
@given(st.data())
def test_fuzz_corrupted_valid_message(data: st.DataObject) -> None:
    head, payload = (bytes(f) for f in encode_zmq_message(
        image_header(torch.zeros(8, 4, dtype=torch.float16)), torch.zeros(8, 4, dtype=torch.float16)))
    pos = data.draw(st.integers(0, len(head) - 1))
    byte = data.draw(st.integers(0, 255))
    corrupted = head[:pos] + bytes([byte]) + head[pos + 1 :]
    decodes_or_protocol_error([corrupted, payload])


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_random_safetensors(data: bytes) -> None:
    try:
        decode_safetensors(data)
    except ProtocolError:
        pass


@FUZZ
@given(st.data())
def test_fuzz_corrupted_safetensors(data: st.DataObject) -> None:
    t = torch.zeros(3, 4)
    body = encode_safetensors(t, st_metadata(t))
    pos = data.draw(st.integers(0, len(body) - 1))
    body = body[:pos] + bytes([data.draw(st.integers(0, 255))]) + body[pos + 1 :]
    try:
        decode_safetensors(body)
    except ProtocolError:
        pass
