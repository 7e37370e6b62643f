"""msgpack wire messages: round trips, and every malformed frame rejected as ProtocolError."""

from __future__ import annotations

import dataclasses
import logging
import random

import msgpack
import pytest

from dflash_ipc.control import protocol
from dflash_ipc.control.protocol import (
    MAX_FRAME_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Dead,
    Done,
    EndOfData,
    Heartbeat,
    Hello,
    Load,
    ProtocolError,
    Ready,
    RejectCounter,
    Shutdown,
    SlotFree,
    SlotReady,
    Start,
    decode,
    encode,
)
from dflash_ipc.control.ring_descriptor import DESCRIPTOR_VERSION, RingDescriptor, ShmSegment, SlotLayoutWire

DESCRIPTOR = RingDescriptor(
    backend="cpu-shm", version=DESCRIPTOR_VERSION, run_id="abcd1234", producer_rank=0, producer_pid=4242, num_slots=4,
    slot_bytes=4096, layout=SlotLayoutWire(num_planes=1, hidden_size=8, max_tokens=16, max_seqs=2, plane_dtype="float32"),
    shm=ShmSegment(name="dflash-ipc-abcd1234-target0"),
)

SAMPLES: dict[type, list[protocol.Message]] = {
    Hello: [
        Hello(role="target", rank=1, pid=4242, device="cuda:0", ring=DESCRIPTOR, endpoint="ipc:///tmp/x/sock/t1"),
        Hello(role="drafter", rank=0, pid=1, device="cpu"),
    ],
    Start: [Start(rings=[DESCRIPTOR, DESCRIPTOR], target_endpoints=["ipc://a", "ipc://b"], drafter_endpoints=["ipc://c"])],
    Ready: [Ready(role="drafter", rank=3)],
    Heartbeat: [Heartbeat(role="target", rank=0, stats={"rss_bytes": 123, "slots": {"free": 2}, "ratio": 0.5}), Heartbeat(role="drafter", rank=1)],
    Done: [Done(role="consumer", rank=0, summary={"slots": 10, "verified": True, "handoff_ns": [1, 2, 3]})],
    Dead: [Dead(role="target", rank=0, error="RuntimeError: boom \u2603")],
    Shutdown: [Shutdown(reason="operator", checkpoint=True), Shutdown(reason="done")],
    SlotReady: [
        SlotReady(producer=1, slot=3, batch_id=[0, 1, 17], bucket=2, n_tokens=1000, n_seqs=3, seq=5, sent_ns=123456789, meta={"padded_len": 512}),
        SlotReady(producer=0, slot=0, batch_id=[0, 0, 0], bucket=0, n_tokens=0, n_seqs=0, seq=0),
    ],
    SlotFree: [SlotFree(producer=0, slot=2, consumer=1, outstanding=2, received=9)],
    Load: [Load(consumer=1, outstanding=0, received=[3, 4])],
    EndOfData: [EndOfData(producer=1, batches_sent=77)],
}


def frame(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def good_slot_ready(**over) -> dict:
    d = {"v": PROTOCOL_VERSION, "t": "slot_ready", "producer": 0, "slot": 1, "batch_id": [0, 0, 3], "bucket": 0, "n_tokens": 8, "n_seqs": 1, "seq": 0}
    d.update(over)
    return d


def rejected_kind(data) -> str:
    with pytest.raises(ProtocolError) as ei:
        decode(data)
    return ei.value.kind


# --------------------------------------------------------------------------- round trips


def test_samples_cover_every_message_type():
    assert set(SAMPLES) == set(MESSAGE_TYPES.values())
    assert len(set(MESSAGE_TYPES)) == len(MESSAGE_TYPES)  # tags are unique


@pytest.mark.parametrize("msg", [m for ms in SAMPLES.values() for m in ms], ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert isinstance(data, bytes) and len(data) <= MAX_FRAME_BYTES
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert decode(bytearray(data)) == msg and decode(memoryview(data)) == msg
    raw = msgpack.unpackb(data, raw=False)
    assert raw["v"] == PROTOCOL_VERSION and raw["t"] == msg.TAG


def test_every_type_round_trips_with_defaults_filled():
    # the minimal frame (only required fields) decodes to the dataclass defaults
    for tag, cls in MESSAGE_TYPES.items():
        full = msgpack.unpackb(encode(SAMPLES[cls][0]), raw=False)
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        minimal = {k: v for k, v in full.items() if k in required or k in ("v", "t")}
        out = decode(msgpack.packb(minimal, use_bin_type=True))
        assert type(out) is cls
        for f in dataclasses.fields(cls):
            if f.name not in required:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                assert getattr(out, f.name) == default, (tag, f.name)


# --------------------------------------------------------------------------- malformed frames


def test_random_bytes_fuzz_only_protocol_errors():
    rng = random.Random(20240611)
    kinds = set()
    for _ in range(400):
        n = rng.choice([0, 1, 2, 3, 5, 8, 16, 33, 64, 200])
        data = bytes(rng.getrandbits(8) for _ in range(n))
        try:
            msg = decode(data)
        except ProtocolError as e:
            kinds.add(e.kind)
            continue
        # in the unlikely event random bytes form a valid frame, it must be a real message
        assert isinstance(msg, protocol.Message)
    assert kinds <= {"undecodable", "not_a_map", "bad_version", "unknown_type", "missing_field", "bad_field_type", "unknown_field", "out_of_range"}


def test_mutated_valid_frames_fuzz_only_protocol_errors():
    rng = random.Random(7)
    frames = [encode(m) for ms in SAMPLES.values() for m in ms]
    for _ in range(400):
        data = bytearray(rng.choice(frames))
        op = rng.randrange(4)
        if op == 0 and data:  # flip some bytes
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.getrandbits(8)
        elif op == 1:  # truncate
            data = data[: rng.randrange(len(data) + 1)]
        elif op == 2:  # append junk
            data += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 8)))
        else:  # splice two frames
            other = rng.choice(frames)
            data = data[: rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1):]
        try:
            msg = decode(bytes(data))
        except ProtocolError:
            continue
        assert isinstance(msg, protocol.Message)


def test_not_bytes():
    assert rejected_kind("a string") == "not_bytes"
    assert rejected_kind(None) == "not_bytes"
    assert rejected_kind({"v": 1}) == "not_bytes"


def test_undecodable():
    assert rejected_kind(b"\xc1") == "undecodable"  # never-used msgpack byte
    assert rejected_kind(b"") == "undecodable"
    assert rejected_kind(encode(SAMPLES[Ready][0]) + b"\x00") == "undecodable"  # trailing data


def test_non_map_top_level():
    for top in ([1, 2, 3], 7, "slot_ready", None, b"bytes", 1.5, True):
        assert rejected_kind(msgpack.packb(top, use_bin_type=True)) == "not_a_map", top


def test_non_string_map_keys():
    # msgpack would happily decode integer keys; strict_map_key refuses them
    assert rejected_kind(msgpack.packb({1: 2})) == "undecodable"


def test_too_large_frame():
    big = frame(v=PROTOCOL_VERSION, t="heartbeat", role="target", rank=0, stats={"pad": "x" * MAX_FRAME_BYTES})
    assert len(big) > MAX_FRAME_BYTES
    assert rejected_kind(big) == "too_large"
    assert rejected_kind(b"\x00" * (MAX_FRAME_BYTES + 1)) == "too_large"


@pytest.mark.parametrize("version", [None, 0, 2, PROTOCOL_VERSION + 1, "1", [1], 1.0, True])
def test_wrong_version(version):
    d = good_slot_ready(v=version)
    if version is None:
        d.pop("v")
    assert rejected_kind(msgpack.packb(d)) == "bad_version"


@pytest.mark.parametrize("tag", [None, "slotready", "SLOT_READY", "", 3, ["slot_ready"]])
def test_unknown_type(tag):
    d = good_slot_ready(t=tag)
    if tag is None:
        d.pop("t")
    assert rejected_kind(msgpack.packb(d)) == "unknown_type"


def test_unknown_field():
    err_kind = rejected_kind(msgpack.packb(good_slot_ready(extra=1)))
    assert err_kind == "unknown_field"
    with pytest.raises(ProtocolError, match="extra"):
        decode(msgpack.packb(good_slot_ready(extra=1)))


@pytest.mark.parametrize("missing", ["producer", "slot", "batch_id", "bucket", "n_tokens", "n_seqs", "seq"])
def test_missing_field(missing):
    d = good_slot_ready()
    d.pop(missing)
    with pytest.raises(ProtocolError, match=f"slot_ready.{missing}") as ei:
        decode(msgpack.packb(d))
    assert ei.value.kind == "missing_field"


@pytest.mark.parametrize(
    "field, value",
    [
        ("slot", "3"),
        ("slot", 1.0),
        ("slot", True),
        ("slot", None),
        ("producer", [0]),
        ("batch_id", "0-0-3"),
        ("batch_id", [0, 0]),
        ("batch_id", [0, 0, "3"]),
        ("batch_id", [0, 0, -3]),
        ("batch_id", [0, True, 3]),
        ("meta", [1, 2]),
        ("sent_ns", 1.5),
    ],
)
def test_wrong_field_types(field, value):
    assert rejected_kind(msgpack.packb(good_slot_ready(**{field: value}))) == "bad_field_type"


def test_wrong_types_other_messages():
    assert rejected_kind(frame(v=1, t="hello", role=1, rank=0, pid=1, device="cpu")) == "bad_field_type"
    assert rejected_kind(frame(v=1, t="hello", role="t", rank=0, pid=1, device="cpu", ring=[1])) == "bad_field_type"
    assert rejected_kind(frame(v=1, t="load", consumer=0, outstanding=0, received={"0": 1})) == "bad_field_type"
    assert rejected_kind(frame(v=1, t="shutdown", reason="x", checkpoint=1)) == "bad_field_type"
    assert rejected_kind(frame(v=1, t="start", rings={}, target_endpoints=[], drafter_endpoints=[])) == "bad_field_type"


@pytest.mark.parametrize("field", ["slot", "producer", "n_tokens", "n_seqs", "seq", "bucket"])
def test_negative_values_out_of_range(field):
    assert rejected_kind(msgpack.packb(good_slot_ready(**{field: -1}))) == "out_of_range"


def test_negative_slot_in_slot_free_and_rank():
    assert rejected_kind(frame(v=1, t="slot_free", producer=0, slot=-2, consumer=0, outstanding=0, received=0)) == "out_of_range"
    assert rejected_kind(frame(v=1, t="ready", role="drafter", rank=-1)) == "out_of_range"
    assert rejected_kind(frame(v=1, t="end_of_data", producer=0, batches_sent=-5)) == "out_of_range"


def test_protocol_error_is_value_error_with_kind_and_detail():
    with pytest.raises(ValueError) as ei:
        decode(b"\xc1")
    e = ei.value
    assert isinstance(e, ProtocolError) and e.kind == "undecodable" and str(e).startswith("undecodable: ")


# --------------------------------------------------------------------------- reject counter


def test_reject_counter_counts_and_logs_once_per_kind(caplog):
    logger = logging.getLogger("test.rejects")
    rc = RejectCounter("consumer-0", logger)
    frames = [b"\xc1", b"\xc1\xc1", msgpack.packb([1]), b"\xc1", msgpack.packb(good_slot_ready(slot=-1)), msgpack.packb([2])]
    with caplog.at_level(logging.WARNING, logger="test.rejects"):
        for f in frames:
            try:
                decode(f)
            except ProtocolError as e:
                rc.reject(e.kind, e.detail)
    assert rc.by_kind == {"undecodable": 3, "not_a_map": 2, "out_of_range": 1}
    assert rc.total == 6
    records = [r for r in caplog.records if r.name == "test.rejects"]
    assert len(records) == 3
    assert all(r.levelno == logging.WARNING and "consumer-0" in r.getMessage() for r in records)
    assert sorted(k for r in records for k in ("undecodable", "not_a_map", "out_of_range") if f"({k})" in r.getMessage()) == [
        "not_a_map", "out_of_range", "undecodable"]


def test_reject_counter_default_logger(caplog):
    rc = RejectCounter("producer-1")
    with caplog.at_level(logging.WARNING, logger=protocol.log.name):
        for _ in range(5):
            rc.reject("bad_slot_free", "slot 2 is free")
    assert rc.total == 5 and rc.by_kind == {"bad_slot_free": 5}
    assert len([r for r in caplog.records if "bad_slot_free" in r.getMessage()]) == 1
