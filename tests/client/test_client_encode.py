"""EncoderClient against scripted fake encoders (real ZMQ, MockTransport HTTP).

After every scenario the client's statistics must show nothing left behind.
"""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
import trio
import trio.testing
from PIL import Image

from client_fakes import DIM, Behaviour, FakeEncoders, decode_item, expected, extras_of, item_bytes
from epd_trio.client import ClientConfig, EncoderClient, RemoteEncodeError, open_encoder_client
from epd_trio.client.client import advertised_endpoint
from epd_trio.client.items import to_wire_item
from epd_trio.errors import (
    AbortedError,
    DeadlineExceeded,
    DrainingError,
    DuplicateRequestError,
    EncodeError,
    EncodeTimeout,
    EPDError,
    NotReadyError,
    PayloadTooLargeError,
    PeerUnavailable,
    ProtocolError,
    RequestError,
)
from epd_trio.protocol import encode_zmq_message, header_for
from epd_trio.transport import PushSocketCache

# Loopback addresses, so that finding the route to them asks no resolver.
E0, E1 = "http://127.0.0.10:8000", "http://127.0.0.11:8000"
KiB = 1024


@pytest.fixture
async def push() -> AsyncIterator[PushSocketCache]:
    async with PushSocketCache() as cache:
        yield cache


@pytest.fixture
def make(push: PushSocketCache) -> Callable[..., tuple[FakeEncoders, EncoderClient]]:
    def make(behaviours: dict[str, Behaviour] | None = None, **config: object
             ) -> tuple[FakeEncoders, EncoderClient]:
        if behaviours is None:
            behaviours = {E0: Behaviour(), E1: Behaviour()}
        fakes = FakeEncoders(push, behaviours)
        config.setdefault("pool_bytes", 64 * KiB)
        client = open_encoder_client(encoder_urls=list(behaviours), http_transport=fakes.transport(),
                                     **config)
        return fakes, client
    return make


def assert_clean(client: EncoderClient) -> None:
    s = client.statistics()
    assert s.requests_live == 0 and s.parts_live == 0, s
    assert all(n == 0 for n in s.outstanding.values()), s
    p = s.pool
    assert (p.slots, p.used_bytes, p.waiters, p.leaked) == (0, 0, 0, 0), p


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.001)


def images(n: int, start: int = 0) -> list[bytes]:
    return [item_bytes(i) for i in range(start, start + n)]


async def test_five_images_over_two_encoders_are_stitched_in_order(make: Callable) -> None:
    fakes, client = make()
    items = images(5)
    async with client:
        async with await client.encode({"image": items}) as result:
            rid = result.req_id
            # one req_id, parts told apart by part_idx; the endpoint is ours
            assert [(u, b["part_idx"], b["num_parts"], len(b["mm_items"])) for u, b in
                    sorted(fakes.encode_calls, key=lambda c: c[1]["part_idx"])] == \
                [(E0, 0, 2, 3), (E1, 1, 2, 2)]
            assert {b["req_id"] for _, b in fakes.encode_calls} == {rid}
            # two loopback encoders: one automatic bind, on loopback, told to both
            assert client.endpoint == ""  # no endpoint is configured
            (bound,) = client.receiver.addresses.endpoints
            assert bound.startswith("tcp://127.0.0.1:")
            assert {b["deliver"]["endpoint"] for _, b in fakes.encode_calls} == {bound}
            assert [decode_item(i) for i in fakes.calls_to(E0)[0]["mm_items"]] == items[:3]

            image = result.embeddings["image"]
            assert torch.equal(image, torch.cat([fakes.sent[(rid, 0)], fakes.sent[(rid, 1)]]))
            assert torch.equal(image, expected(items, "image"))
            assert image.dtype == torch.bfloat16 and image.shape[1] == DIM
            # the tensor lives in the pool's one buffer, in the request's slot
            slot = result.slot
            assert image.data_ptr() == slot.address
            assert pool_range(client)[0] <= image.data_ptr() < pool_range(client)[1]

            assert [(it.modality, it.index) for it in result.items] == [("image", i) for i in range(5)]
            for it, data in zip(result.items, items):
                assert torch.equal(it.embedding, expected([data], "image"))
                assert it.token_count == it.embedding.shape[0]
                assert it.grid_thw == (1, 2, 2 * it.token_count)
            assert result.token_counts["image"] == [it.token_count for it in result.items]
            assert client.statistics().pool.slots == 1
        assert result.released
        del image, it  # views this test kept: until they go, their bytes stay out of the pool
        s = client.statistics()
        assert (s.requests_done, s.requests_failed, s.messages_received, s.messages_dropped) == \
            (1, 0, 2, 0)
        assert fakes.abort_calls == []
        assert_clean(client)


def pool_range(client: EncoderClient) -> tuple[int, int]:
    return client.pool.address, client.pool.address + client.pool.capacity


async def test_modalities_are_laid_out_modality_major_with_their_own_dtypes(make: Callable) -> None:
    fakes, client = make()
    imgs, vids, auds = images(3), images(2, 10), images(1, 20)
    async with client:
        # dict order is not the layout order: images, videos, then audio
        async with await client.encode({"audio": auds, "video": vids, "image": imgs}) as result:
            rid = result.req_id
            plan = sorted((b["part_idx"], b["modality"], u) for u, b in fakes.encode_calls)
            assert plan == [(0, "image", E0), (1, "image", E1), (2, "video", E0), (3, "video", E1),
                            (4, "audio", E0)]
            assert torch.equal(result.embeddings["image"], expected(imgs, "image"))
            assert torch.equal(result.embeddings["video"],
                               torch.cat([fakes.sent[(rid, 2)], fakes.sent[(rid, 3)]]))
            audio = result.embeddings["audio"]
            assert audio.dtype == torch.float32 and torch.equal(audio, expected(auds, "audio"))
            assert audio.data_ptr() % 64 == 0
            assert [(it.modality, it.index) for it in result.items] == \
                [("image", 0), ("image", 1), ("image", 2), ("video", 0), ("video", 1), ("audio", 0)]
            assert result.items[-1].grid_thw is None and result.grid_thw["audio"] == []
            # per-item extras (the real encoder sends them for videos and audio) reach each item
            assert [it.extras for it in result.items] == [{}] * 3 + [
                {"second_per_grid_ts": v} for v in extras_of(vids, "video")["second_per_grid_ts"]] + [
                {"mel_frames": v} for v in extras_of(auds, "audio")["mel_frames"]]
            starts = [result.embeddings[m].data_ptr() for m in ("image", "video", "audio")]
            assert starts == sorted(starts)
        del audio  # a view this test kept: until it goes, its bytes stay out of the pool
        assert_clean(client)


async def test_an_http_error_fails_the_request_and_aborts_the_other_part(make: Callable) -> None:
    fakes, client = make({E0: Behaviour("hang"), E1: Behaviour("error")})
    async with client:
        with pytest.raises(EncodeError) as info:
            await client.encode({"image": images(5)}, req_id="r-err")
        err = info.value
        assert isinstance(err, RemoteEncodeError)
        assert (err.status_code, err.error_type, err.encoder_url, err.part_idx, err.req_id) == \
            (400, "RequestError", E1, 1, "r-err")
        assert "cannot decode" in err.message
        assert fakes.cancelled == [(E0, 0)]  # our /encode to E0 was cut short ...
        assert fakes.abort_calls == [(E0, {"req_id": "r-err", "part_idx": 0})]  # ... and aborted
        s = client.statistics()
        assert (s.requests_failed, s.aborts_sent, s.aborts_failed) == (1, 1, 0)
        assert_clean(client)


async def test_a_part_refused_by_a_draining_encoder_moves_to_another(make: Callable) -> None:
    draining = Behaviour("error", DrainingError("the encoder is draining and accepts no new requests"))
    fakes, client = make({E0: draining, E1: Behaviour()})
    async with client:
        items = images(3)
        async with await client.encode({"image": items}) as result:
            assert [p.encoder_url for p in result.parts] == [E1, E1]
            assert torch.equal(result.embeddings["image"], expected(items, "image"))
        assert fakes.abort_calls == []  # E0 took nothing: nothing to abort there
        assert client.statistics().retries == 1
        assert_clean(client)
    # With no encoder left to move to, the refusal is the answer.
    fakes, client = make({E0: draining, E1: draining})
    async with client:
        with pytest.raises(RemoteEncodeError) as info:
            await client.encode({"image": images(2)})
        assert (info.value.status_code, info.value.error_type) == (503, "DrainingError")
        assert_clean(client)


async def test_a_zmq_error_fails_fast_while_http_still_waits(make: Callable) -> None:
    fakes, client = make({E0: Behaviour("hang"), E1: Behaviour("zmq_error", NotReadyError("draining"))})
    async with client:
        with trio.fail_after(5):  # the request timeout is 60 s: this is the fast path
            with pytest.raises(RemoteEncodeError) as info:
                await client.encode({"image": images(2)}, req_id="r-zmq")
        assert (info.value.status_code, info.value.error_type) == (503, "NotReadyError")
        # E1 said it is done with part 1: only E0's part is aborted
        assert fakes.abort_calls == [(E0, {"req_id": "r-zmq", "part_idx": 0})]
        assert sorted(fakes.cancelled) == [(E0, 0), (E1, 1)]
        assert client.statistics().messages_received == 1
        assert_clean(client)


async def test_a_deadline_raises_encode_timeout_at_that_time(
        make: Callable, autojump_clock: trio.testing.MockClock) -> None:
    fakes, client = make({E0: Behaviour("hang"), E1: Behaviour("hang")}, timeout=30.0)
    async with client:
        start = trio.current_time()
        with pytest.raises(EncodeTimeout, match="within 30 s") as info:
            await client.encode({"image": images(3)}, req_id="r-slow")
        assert trio.current_time() == start + 30.0
        assert isinstance(info.value, DeadlineExceeded) and info.value.req_id == "r-slow"
        start = trio.current_time()
        with pytest.raises(EncodeTimeout):
            await client.encode({"video": images(1)}, timeout=2.5)
        assert trio.current_time() == start + 2.5
        assert sorted((u, b["part_idx"]) for u, b in fakes.abort_calls) == [(E0, 0), (E0, 0), (E1, 1)]
        assert client.statistics().requests_failed == 2
        assert_clean(client)


async def test_the_callers_cancellation_cleans_up_the_same_way(
        make: Callable, autojump_clock: trio.testing.MockClock) -> None:
    fakes, client = make({E0: Behaviour("hang"), E1: Behaviour("hang")})
    async with client:
        with trio.move_on_after(7) as scope:
            await client.encode({"image": images(4)}, req_id="r-gone")
        assert scope.cancelled_caught and trio.current_time() == 7
        assert sorted((u, b["req_id"], b["part_idx"]) for u, b in fakes.abort_calls) == \
            [(E0, "r-gone", 0), (E1, "r-gone", 1)]
        assert_clean(client)


async def test_an_unreachable_encoder_moves_its_part_to_another(make: Callable) -> None:
    fakes, client = make({E0: Behaviour("down"), E1: Behaviour()})
    items = images(5)
    async with client:
        async with await client.encode({"image": items}) as result:
            assert torch.equal(result.embeddings["image"], expected(items, "image"))
            # both parts ran on E1, under the same req_id and their own part_idx
            assert sorted(b["part_idx"] for b in fakes.calls_to(E1)) == [0, 1]
            assert fakes.calls_to(E0) == []
        s = client.statistics()
        assert s.retries == 1 and fakes.abort_calls == []
        assert_clean(client)


async def test_no_reachable_encoder_is_peer_unavailable(make: Callable) -> None:
    fakes, client = make({E0: Behaviour("down"), E1: Behaviour("down")})
    async with client:
        with pytest.raises(PeerUnavailable, match="no encoder reachable"):
            await client.encode({"image": images(2)})
        assert fakes.abort_calls == [] and fakes.encode_calls == []
        assert_clean(client)
    _, empty = make({})
    async with empty:
        with pytest.raises(PeerUnavailable, match="no encoder is available"):
            await empty.encode({"image": images(1)})


async def test_messages_for_no_live_part_are_dropped_and_counted(
        make: Callable, push: PushSocketCache) -> None:
    fakes, client = make()
    async with client:
        async with await client.encode({"image": images(2)}) as result:
            rid = result.req_id
        stale = fakes.sent[(rid, 0)]
        header = header_for(stale, req_id=rid, part_idx=0, num_parts=2, modality="image",
                            token_counts=[stale.shape[0]])
        (endpoint,) = client.receiver.addresses.endpoints
        await push.send(endpoint, encode_zmq_message(header, stale), 5)  # a late duplicate
        unknown = header_for(stale, req_id="nobody", part_idx=0, num_parts=1, modality="image",
                             token_counts=[stale.shape[0]])
        await push.send(endpoint, encode_zmq_message(unknown, stale), 5)
        await push.send(endpoint, [b"\x81\xa1v\x01"], 5)  # malformed header
        await wait_until(lambda: client.statistics().malformed_messages == 1)
        s = client.statistics()
        assert (s.messages_received, s.messages_dropped) == (4, 2)
        async with await client.encode({"image": images(3)}) as again:  # still serving
            assert torch.equal(again.embeddings["image"], expected(images(3), "image"))
        assert_clean(client)


async def test_a_second_message_for_a_part_is_dropped_not_used(make: Callable) -> None:
    fakes, client = make({E0: Behaviour("twice")})
    seen: list[tuple[int, int, int]] = []

    async def both_arrived() -> None:  # the fake answers /encode only after this
        await wait_until(lambda: client.statistics().messages_received == 2)
        s = client.statistics()
        seen.append((s.parts_live, s.messages_received, s.messages_dropped))

    fakes.before_answer = both_arrived
    async with client:
        async with await client.encode({"image": images(3)}) as result:
            assert torch.equal(result.embeddings["image"], expected(images(3), "image"))
        assert seen == [(1, 2, 1)]  # the duplicate came while its part was still live
        assert client.statistics().messages_dropped == 1
        assert_clean(client)


async def test_a_full_pool_holds_the_next_request_until_the_first_is_released(
        make: Callable) -> None:
    items = images(4)
    _fakes, client = make(pool_bytes=expected(items, "image").nbytes)
    done = trio.Event()

    async def second() -> None:
        async with await client.encode({"image": items}) as result:
            assert torch.equal(result.embeddings["image"], expected(items, "image"))
            done.set()

    async with client, trio.open_nursery() as nursery:
        first = await client.encode({"image": items})
        nursery.start_soon(second)
        await wait_until(lambda: client.statistics().pool.waiters == 1)
        assert not done.is_set() and client.statistics().requests_live == 1
        first.release()
        with trio.fail_after(5):
            await done.wait()
    assert_clean(client)
    assert client.statistics().pool.acquired == 2


async def test_a_request_bigger_than_the_pool_is_refused(make: Callable) -> None:
    fakes, client = make(pool_bytes=256)
    async with client:
        with pytest.raises(PayloadTooLargeError, match="never fit"):
            await client.encode({"image": images(8)})
        assert fakes.abort_calls == []
        assert_clean(client)


async def test_a_message_that_disagrees_with_the_http_answer_is_a_protocol_error(
        make: Callable) -> None:
    _fakes, client = make({E0: Behaviour("bad_meta")})
    async with client:
        with pytest.raises(ProtocolError, match="does not match"):
            await client.encode({"image": images(2)})
        assert_clean(client)


@pytest.mark.parametrize("status", [200, 500])
async def test_an_answer_nested_past_the_parser_is_a_protocol_error(make: Callable, status: int) -> None:
    _fakes, client = make({E0: Behaviour("deep_json", status=status)})
    async with client:
        with pytest.raises(EPDError) as info:  # not a RecursionError in an ExceptionGroup
            await client.encode({"image": images(2)})
        assert_clean(client)
    assert isinstance(info.value, ProtocolError if status == 200 else RemoteEncodeError), info.value
    if status == 500:
        assert info.value.status_code == 500 and info.value.error_type == "HTTPError"


@pytest.mark.parametrize("mode", ["CMYK", "YCbCr", "HSV", "LAB", "F"])
def test_pil_images_in_modes_png_cannot_store_go_as_rgb(mode: str) -> None:
    image = Image.new("RGB", (4, 3), (250, 10, 20)).convert(mode) if mode != "F" else Image.new("F", (4, 3), 7.5)
    sent = Image.open(io.BytesIO(decode_item(to_wire_item(image, "image", 0))))
    assert sent.mode == "RGB" and sent.size == (4, 3)
    assert sent.getpixel((1, 1)) == image.convert("RGB").getpixel((1, 1))  # as the processors would see it


def test_a_pil_image_that_cannot_be_read_is_a_request_error(tmp_path: Path) -> None:
    path = tmp_path / "cut.png"
    whole = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(whole, format="PNG")
    path.write_bytes(whole.getvalue()[:80])  # the header, then nothing: PIL opens it lazily
    with Image.open(path) as image, pytest.raises(RequestError, match="image item 2: the PIL image cannot"):
        to_wire_item(image, "image", 2)


async def test_items_become_data_uris_and_bad_items_are_refused(make: Callable) -> None:
    fakes, client = make({E0: Behaviour()})
    image = Image.new("RGB", (3, 2), (250, 10, 20))
    data_uri = "data:image/png;base64," + base64.b64encode(item_bytes(7)).decode()
    async with client:
        async with await client.encode({"IMAGE": [image, bytearray(item_bytes(3)), data_uri]}):
            sent = fakes.calls_to(E0)[0]["mm_items"]
        assert sent[0].startswith("data:image/png;base64,")
        assert Image.open(io.BytesIO(decode_item(sent[0]))).getpixel((2, 1)) == (250, 10, 20)
        assert decode_item(sent[1]) == item_bytes(3) and sent[2] == data_uri
        for bad, match in [
            ({"image": [3]}, "got int"), ({"text": [b"x"]}, "unknown modality"),
            ({"image": []}, "at least one item"), ({"image": b"xy"}, "must be a list"),
            ({"image": [""]}, "empty string"), ([b"x"], "map a modality"),
        ]:
            with pytest.raises(RequestError, match=match):
                await client.encode(bad)  # type: ignore[arg-type]
        with pytest.raises(RequestError, match="req_id"):
            await client.encode({"image": [b"x"]}, req_id="")
        assert len(fakes.encode_calls) == 1
        assert_clean(client)


async def test_a_live_req_id_cannot_be_reused(make: Callable) -> None:
    _fakes, client = make({E0: Behaviour("hang")})
    async with client, trio.open_nursery() as nursery:
        nursery.start_soon(lambda: client.encode({"image": images(1)}, req_id="same", timeout=1))
        await wait_until(lambda: client.statistics().requests_live == 1)
        with pytest.raises(DuplicateRequestError):
            await client.encode({"image": images(1)}, req_id="same")
        nursery.cancel_scope.cancel()
    assert_clean(client)


async def test_closing_the_client_fails_requests_in_flight(make: Callable) -> None:
    fakes, client = make({E0: Behaviour("hang")})
    caught: list[BaseException] = []

    async def run() -> None:
        try:
            await client.encode({"image": images(2)})
        except AbortedError as exc:
            caught.append(exc)

    async with trio.open_nursery() as nursery:
        async with client:
            nursery.start_soon(run)
            await wait_until(lambda: len(fakes.encode_calls) == 1)
    assert len(caught) == 1 and "closed" in caught[0].message
    # closing waited for the request's clean-up, so its /abort still went out
    assert fakes.abort_calls == [(E0, {"req_id": caught[0].req_id, "part_idx": 0})]
    assert client.statistics().aborts_sent == 1
    assert_clean(client)
    with pytest.raises(trio.ClosedResourceError):
        await client.encode({"image": images(1)})


async def test_a_close_while_items_convert_aborts_that_request_too(
        make: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from epd_trio.client import client as client_module

    converting, go_on = threading.Event(), threading.Event()
    real = client_module.to_wire_items

    def slow(items: object) -> object:  # the thread-run PNG/base64 work of large items
        converting.set()
        go_on.wait(10)
        return real(items)

    monkeypatch.setattr(client_module, "to_wire_items", slow)
    monkeypatch.setattr(client_module, "is_heavy", lambda items: True)
    _, client = make()
    caught: list[BaseException] = []

    async def run() -> None:
        try:
            await client.encode({"image": images(1)})
        except BaseException as exc:  # noqa: BLE001 (what reaches the caller is the test)
            caught.append(exc)

    async with trio.open_nursery() as nursery:
        async with client:
            nursery.start_soon(run)
            await trio.to_thread.run_sync(converting.wait, 10)
        go_on.set()  # the client is closed now; the conversion ends after it
    assert len(caught) == 1 and isinstance(caught[0], AbortedError), caught
    assert "closed" in caught[0].message


async def test_statistics_repr_and_endpoint(make: Callable) -> None:
    _, client = make()
    with pytest.raises(RuntimeError, match="async with"):
        await client.encode({"image": images(1)})
    async with client:
        assert client.endpoint == "" and client.receiver.addresses.endpoints == ()  # bound on first need
        assert "2 encoders, 0 requests live" in repr(client)
        assert client.statistics().encoders == (E0, E1)


@pytest.mark.parametrize(
    ("bound", "advertise", "endpoint"),
    [
        ("tcp://127.0.0.1:5000", None, "tcp://127.0.0.1:5000"),
        ("tcp://0.0.0.0:5000", "tcp://node-7:0", "tcp://node-7:5000"),
        ("tcp://0.0.0.0:5000", "tcp://node-7:6000", "tcp://node-7:6000"),
        ("ipc:///tmp/x.sock", "ipc:///tmp/x.sock", "ipc:///tmp/x.sock"),
    ],
)
def test_advertised_endpoint(bound: str, advertise: str | None, endpoint: str) -> None:
    assert advertised_endpoint(bound, advertise) == endpoint


def test_advertised_endpoint_is_validated() -> None:
    with pytest.raises(RequestError):
        advertised_endpoint("tcp://127.0.0.1:5000", "http://node-7:80")


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="http"):
        ClientConfig(encoder_urls=("enc0:8000",))
    with pytest.raises(ValueError, match="timeout"):
        ClientConfig(timeout=0)
    with pytest.raises(ValueError, match="pool_bytes"):
        ClientConfig(pool_bytes=0)
