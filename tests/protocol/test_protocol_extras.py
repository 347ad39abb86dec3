"""The optional ``extras`` header key: per-item values for the language side.

Absent when empty (a v1 peer without extras reads and writes exactly what it
did), strictly checked when present: every way a peer can get it wrong is a
``ProtocolError``, never a crash or an over-allocation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import httpx
import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from epd_trio.client.answers import check_message, parse_meta
from epd_trio.errors import ProtocolError
from epd_trio.protocol import (
    decode_safetensors,
    decode_zmq_message,
    encode_safetensors,
    encode_zmq_message,
    header_for,
    header_from_map,
    header_to_map,
)
from epd_trio.protocol.messages import (
    MAX_EXTRA_NAME,
    MAX_EXTRA_NUMBERS,
    MAX_EXTRA_VALUES,
    MAX_EXTRAS,
    validate_extras,
)
from epd_trio.protocol.requests import EncodeMeta

T = torch.arange(24, dtype=torch.float32).reshape(6, 4)
EXTRAS = {"second_per_grid_ts": [1.0, 0.5], "timestamps": [[0.25, 1.25], [0.5]]}


def video_header(**over: Any) -> Any:
    kw: dict[str, Any] = dict(req_id="v", part_idx=0, num_parts=1, modality="video",
                              token_counts=[4, 2], grid_thw=[[2, 4, 2], [1, 4, 2]], extras=EXTRAS)
    kw.update(over)
    return header_for(T, **kw)


def frames_of(m: object) -> list[bytes]:
    return [msgpack.packb(m, use_bin_type=True), T.numpy().tobytes()]


def test_zmq_round_trip_keeps_extras() -> None:
    header = video_header()
    got, tensor = decode_zmq_message([bytes(f) for f in encode_zmq_message(header, T)])
    assert got == header and got.extras == EXTRAS
    assert tensor is not None and torch.equal(tensor.tensor(), T)


def test_no_extras_means_no_key_so_v1_peers_are_unaffected() -> None:
    m = header_to_map(video_header(extras=None))
    assert "extras" not in m
    assert "extras" not in header_to_map(video_header(extras={}))
    assert header_from_map(m).extras == {}  # a v1 map without the key is read as before


def test_numbers_are_read_as_floats() -> None:
    m = {**header_to_map(video_header(extras=None)), "extras": {"t": [2, 3]}}
    assert header_from_map(m).extras == {"t": [2.0, 3.0]}
    assert all(type(v) is float for v in header_from_map(m).extras["t"])
    assert validate_extras({"t": [[1, 2], []]}, 2) == {"t": [[1.0, 2.0], []]}


def test_bounds_are_inclusive() -> None:
    names = {f"{i}" * MAX_EXTRA_NAME: [0.0] for i in range(MAX_EXTRAS)}
    assert len(validate_extras(names, 1)) == MAX_EXTRAS
    full = {"a": [[0.0] * MAX_EXTRA_VALUES] * (MAX_EXTRA_NUMBERS // MAX_EXTRA_VALUES)}
    assert len(validate_extras(full, MAX_EXTRA_NUMBERS // MAX_EXTRA_VALUES)["a"]) == 16
    with pytest.raises(ProtocolError, match=f"over {MAX_EXTRA_NUMBERS} numbers"):
        validate_extras({**full, "b": [0.0] * 16}, 16)


BAD: list[tuple[str, object, str]] = [
    ("not a map", [1.0, 2.0], "extras must be a map"),
    ("null", None, "extras must be a map"),
    ("too many names", {f"k{i}": [0.0, 0.0] for i in range(MAX_EXTRAS + 1)}, "9 names"),
    ("empty name", {"": [0.0, 0.0]}, "names must be str"),
    ("long name", {"n" * (MAX_EXTRA_NAME + 1): [0.0, 0.0]}, "names must be str"),
    ("not a list", {"t": 1.0}, "one entry per item"),
    ("too few entries", {"t": [1.0]}, r"one entry per item \(2\)"),
    ("too many entries", {"t": [1.0, 2.0, 3.0]}, "one entry per item"),
    ("nan", {"t": [math.nan, 1.0]}, "finite numbers"),
    ("inf", {"t": [1.0, -math.inf]}, "finite numbers"),
    ("nan in a list", {"t": [[1.0], [math.nan]]}, "finite numbers"),
    ("bool", {"t": [True, 1.0]}, "finite numbers"),
    ("string", {"t": ["1.0", 1.0]}, "finite numbers"),
    ("map entry", {"t": [{"a": 1}, 1.0]}, "finite numbers"),
    ("scalar then list", {"t": [1.0, [1.0]]}, "finite numbers"),
    ("list then scalar", {"t": [[1.0], 1.0]}, "all lists"),
    ("nested lists", {"t": [[[1.0]], [[1.0]]]}, "finite numbers"),
    ("long list", {"t": [[0.0] * (MAX_EXTRA_VALUES + 1), []]}, f"at most {MAX_EXTRA_VALUES}"),
    ("int past float range", {"t": [10**400, 1.0]}, "finite numbers"),
]


@pytest.mark.parametrize(("extras", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_extras_are_protocol_errors(extras: object, match: str) -> None:
    """The JSON answer's check (``validate_extras``) says what is wrong; a header's schema
    refuses the same extras (its message names the field it stopped at)."""
    with pytest.raises(ProtocolError, match=match):
        validate_extras(extras, 2)
    m = {**header_to_map(video_header(extras=None)), "extras": extras}
    with pytest.raises(ProtocolError, match="extras"):
        header_from_map(m)


def test_bad_extras_in_a_zmq_message() -> None:
    m = {**header_to_map(video_header(extras=None)), "extras": {"t": [1.0, math.inf]}}
    with pytest.raises(ProtocolError, match="finite numbers"):
        decode_zmq_message(frames_of(m))
    with pytest.raises(ProtocolError, match=r"got `int` - at `key` in `\$.extras`"):
        header_from_map({**m, "extras": {7: [1.0, 2.0]}})  # msgpack would refuse it earlier


def test_an_error_message_carries_no_extras() -> None:
    m = {**header_to_map(video_header(extras=None)), "kind": "error", "shape": [0, 0],
         "token_counts": [], "grid_thw": [], "extras": {"t": []},
         "error": {"type": "EncodeError", "message": "x", "status": 500}}
    with pytest.raises(ProtocolError, match="must not carry extras"):
        header_from_map(m)


def test_we_never_send_bad_extras() -> None:
    with pytest.raises(ProtocolError, match="one entry per item"):
        encode_zmq_message(video_header(extras={"t": [1.0]}), T)
    with pytest.raises(ProtocolError, match="finite numbers"):
        encode_safetensors(T, {**st_metadata(), "extras": {"t": [1.0, math.nan]}})


# --- inline safetensors -------------------------------------------------------------

def st_metadata(**over: Any) -> dict[str, Any]:
    return {"req_id": "v", "part_idx": 0, "num_parts": 1, "modality": "video",
            "token_counts": [4, 2], "grid_thw": [[2, 4, 2], [1, 4, 2]], **over}


def test_safetensors_round_trip_keeps_extras_as_a_json_string() -> None:
    body = encode_safetensors(T, st_metadata(extras=EXTRAS))
    got, meta = decode_safetensors(body)
    assert torch.equal(got, T) and meta == st_metadata(extras=EXTRAS)
    size = int.from_bytes(body[:8], "little")
    stored = json.loads(body[8:8 + size])["__metadata__"]
    assert json.loads(stored["extras"]) == EXTRAS


def test_safetensors_without_extras_has_no_key() -> None:
    for metadata in (st_metadata(), st_metadata(extras={})):
        body = encode_safetensors(T, metadata)
        size = int.from_bytes(body[:8], "little")
        assert "extras" not in json.loads(body[8:8 + size])["__metadata__"]
        assert decode_safetensors(body)[1] == st_metadata()


def st_body_with(extras: str) -> bytes:
    import safetensors.torch

    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in st_metadata().items()}
    return safetensors.torch.save({"embedding": T}, metadata={**meta, "extras": extras})


@pytest.mark.parametrize(("raw", "match"), [
    ('{"t": [NaN, 1.0]}', "finite numbers"),
    ('{"t": [1e999, 1.0]}', "finite numbers"),
    ('{"t": [1.0]}', "one entry per item"),
    ('[1.0, 2.0]', r"got `array` - at `\$\.extras`"),
    ('{"t": [1.0, 2.0]', "extras is not JSON"),
    ("[" * 100_000, "extras is not JSON"),  # deeper than the JSON parser's recursion limit
], ids=["nan", "overflow", "count", "list", "truncated", "deep"])
def test_bad_safetensors_extras_are_protocol_errors(raw: str, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_safetensors(st_body_with(raw))


# --- the JSON answer of a zmq /encode, on the receiver's side -----------------------

def meta_body(**over: Any) -> dict[str, Any]:
    return {"req_id": "v", "part_idx": 0, "num_parts": 1, "modality": "video", "tokens": 6,
            "dim": 4, "dtype": "float32", "token_counts": [4, 2],
            "grid_thw": [[2, 4, 2], [1, 4, 2]], **over}


def test_meta_extras_are_optional_and_checked() -> None:
    meta = parse_meta(httpx.Response(200, json=meta_body()), "v", 0, 1)
    assert meta.extras == {} and "extras" not in meta.to_json()
    meta = parse_meta(httpx.Response(200, json=meta_body(extras=EXTRAS)), "v", 0, 1)
    assert meta.extras == EXTRAS and meta.to_json()["extras"] == EXTRAS
    assert meta.to_json() == dataclasses.asdict(meta)  # every field, built by hand
    with pytest.raises(ProtocolError, match=r"bad /encode answer.*one entry per item"):
        parse_meta(httpx.Response(200, json=meta_body(extras={"t": [1.0]})), "v", 0, 1)


def test_zmq_message_and_json_answer_must_agree_on_extras() -> None:
    header = video_header()
    check_message(header, EncodeMeta(**meta_body(extras=EXTRAS)), "video", 2, "http://e")
    with pytest.raises(ProtocolError, match="extras"):
        check_message(header, EncodeMeta(**meta_body()), "video", 2, "http://e")


# --- fuzzing: whatever a peer puts under "extras", only ProtocolError comes out ------

json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_like | st.dictionaries(st.text(max_size=70), json_like, max_size=10))
def test_fuzz_extras(extras: object) -> None:
    m = {**header_to_map(video_header(extras=None)), "extras": extras}
    try:
        decode_zmq_message(frames_of(m))
    except ProtocolError:
        pass
    try:
        decode_safetensors(st_body_with(json.dumps(extras)))
    except ProtocolError:
        pass
