"""Hypothesis strategies for hostile request bodies (shared with tools/fuzz.py)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=12)

items = st.one_of(
    st.sampled_from(["data:image/png;base64,", "data:image/png;base64,AAAA", "data:text/plain,hi",
                     "file:///etc/passwd", "ftp://x/y", "../../etc/passwd", "/etc/hostname",
                     "http://127.0.0.1:9/x.png", "ipc:///tmp/x", ""]),
    st.text(max_size=30), json_values,
    st.fixed_dictionaries({"url": st.one_of(st.text(max_size=20), json_values)},
                          optional={"content_hash": json_values}),
)
endpoints = st.one_of(st.sampled_from(["tcp://127.0.0.1:9", "tcp://h:0", "ipc://", "udp://x:1", ""]),
                      json_values)
deliveries = st.one_of(
    json_values,
    st.fixed_dictionaries({"backend": st.sampled_from(["inline", "zmq", "mooncake", "x"])},
                          optional={"endpoint": endpoints, "endpoints": st.lists(endpoints, max_size=3),
                                    "receive_count": json_values}),
)
encode_bodies = st.fixed_dictionaries(
    {},
    optional={"req_id": st.one_of(st.text(max_size=300), json_values),
              "modality": st.one_of(st.sampled_from(["image", "VIDEO", "audio", "smell"]), json_values),
              "mm_items": st.one_of(st.lists(items, max_size=3), json_values),
              "num_parts": st.one_of(st.integers(-3, 5), json_values),
              "part_idx": st.one_of(st.integers(-3, 5), json_values),
              "hashes": json_values, "deliver": deliveries},
)
send_bodies = st.fixed_dictionaries(
    {},
    optional={"req_id": json_values, "part_idx": json_values,
              "session": st.one_of(st.sampled_from(["127.0.0.1:1", "h:0", "nohost"]), json_values),
              "buffer_address": st.one_of(st.integers(-5, 2**70), json_values),
              "buffer_length": st.one_of(st.integers(-5, 2**70), json_values)},
)
abort_bodies = st.fixed_dictionaries({}, optional={"req_id": json_values, "part_idx": json_values})
registry_bodies = st.fixed_dictionaries(
    {}, optional={"url": st.one_of(st.sampled_from(["http://h:1", "https://h:65536", "http://:1", "ftp://h:1",
                                                     "http://user:pw@h:1", "http://h:1/#x", " http://h:1"]),
                                   json_values)})


# SGLang's bodies (``--api sglang``): its field names, hostile values.
_sglang_well_formed = st.fixed_dictionaries({  # past SGLang's checks: reaches media and delivery
    "req_id": st.sampled_from(["r_local_part_0", "q_local_part_1"]),
    "modality": st.sampled_from(["IMAGE", "VIDEO", "AUDIO"]),
    "mm_items": st.lists(items, min_size=1, max_size=2),
    "num_parts": st.integers(1, 4), "part_idx": st.integers(0, 3),
    "prefill_host": st.sampled_from(["127.0.0.1", "::1"]),
    "embedding_port": st.one_of(st.none(), st.integers(1, 65535)),
})
sglang_encode_bodies = _sglang_well_formed | st.fixed_dictionaries(
    {},
    optional={"req_id": st.one_of(st.sampled_from(["r_local_part_0", "r", ""]), st.text(max_size=40),
                                  json_values),
              "modality": st.one_of(st.sampled_from(["IMAGE", "VIDEO", "AUDIO", "image", "SMELL"]),
                                    json_values),
              "mm_items": st.one_of(st.lists(items, max_size=3), items, json_values),
              "num_parts": st.one_of(st.integers(-3, 5), json_values),
              "part_idx": st.one_of(st.integers(-3, 5), json_values),
              "prefill_host": st.one_of(st.sampled_from(["127.0.0.1", "::1", "", "h o s t"]), json_values),
              "embedding_port": st.one_of(st.none(), st.integers(-5, 70000), st.lists(st.integers(0, 9), max_size=3),
                                          json_values),
              "time_stats_json": json_values, "encoder_idx": json_values, "encoder_url": json_values},
)
sglang_rank_bodies = st.fixed_dictionaries(
    {},
    optional={"req_id": st.one_of(st.sampled_from(["r_local_part_0", ""]), json_values),
              "part_idx": st.one_of(st.integers(-3, 5), json_values),
              "receive_count": st.one_of(st.integers(-3, 5), json_values),
              "receive_url": st.one_of(st.sampled_from(["127.0.0.1:9", "[::1]:9", "h:0", "nohost", ""]),
                                       json_values),
              "modality": st.one_of(st.sampled_from(["IMAGE", "AUDIO"]), json_values),
              "session_id": json_values, "buffer_address": st.one_of(st.integers(-5, 2**70), json_values),
              "prefill_host": json_values, "embedding_port": json_values},
)


def raw(body: Any) -> bytes:
    return json.dumps(body).encode()


raw_bodies = st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode),
                       st.sampled_from([b"[" * 5000, b'{"a":' * 3000, b"\xff\xfe", b"null", b"1e999"]))
