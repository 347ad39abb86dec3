"""``decode_data_uri``'s fast path gives exactly what ``b64decode(validate=True)`` gives, errors included."""

from __future__ import annotations

import base64
import binascii

import pytest
from hypothesis import given, settings, strategies as st

from epd_trio.errors import RequestError
from epd_trio.model.media import decode_data_uri

CASES = ["", "QQ==", "QQ=", "QQ", "Q===", "QUJD", "QU JD", "QUJD\n", "=QUJD", "QU=JD", "QUJD==",
         "QQ==QQ==", "é", "QUJ*", "QUI=", "QUJ=", "QR==", "QUJDRA=", "QUJDRA", "QUJD-_",
         base64.b64encode(bytes(range(256)) * 9).decode()]


def reference(payload: str) -> bytes | str:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        return f"undecodable base64 in data: URI ({exc})"


@pytest.mark.parametrize("payload", CASES)
def test_same_bytes_or_same_error_as_validating_b64decode(payload: str) -> None:
    try:
        got: bytes | str = decode_data_uri(f"data:image/png;base64,{payload}", 3, 1 << 20)
    except RequestError as exc:
        got = exc.message.removeprefix("item 3: ")
    assert got == reference(payload)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(alphabet="QUJDRAgw+/=-_ \né", max_size=24),
                 st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode())))
def test_fuzzed_payloads_decode_as_validating_b64decode(payload: str) -> None:
    """pybase64's fast path accepts nothing the standard decoder refuses, and agrees on the bytes."""
    test_same_bytes_or_same_error_as_validating_b64decode(payload)
