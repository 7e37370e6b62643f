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
    from_wire,
    to_wire,
)
from dflash_ipc.control.ring_descriptor import DESCRIPTOR_VERSION, RingDescriptor, ShmSegment, SlotLayoutWire
from dflash_ipc.control.stats import (
    ChildInfo,
    ConsumerSummary,
    DrafterStats,
    DrafterSummary,
    DrafterWork,
    FastPath,
    GpuMemory,
    PlaneSlots,
    ProducerPlaneStats,
    ProducerSummary,
    ResumePoint,
    RoutedSlot,
    RoutingLog,
    TargetStats,
    TargetWork,
    Vitals,
)

DESCRIPTOR = RingDescriptor(
    backend="cpu-shm",
    version=DESCRIPTOR_VERSION,
    run_id="abcd1234",
    producer_rank=0,
    producer_pid=4242,
    num_slots=4,
    slot_bytes=4096,
    layout=SlotLayoutWire(num_planes=1, hidden_size=8, max_tokens=16, max_seqs=2, plane_dtype="float32"),
    shm=ShmSegment(name="dflash-ipc-abcd1234-target0"),
)

VITALS = Vitals(state="running", uptime_s=12.5, rss_bytes=123 << 20, rejected_messages=2, rejected_by_kind={"undecodable": 2})
TARGET_STATS = TargetStats(
    vitals=VITALS,
    work=TargetWork(
        forwards=7,
        forward_ms=12.5,
        pack_ms=1.25,
        pack_submit_ms=0.1,
        packs_measured=6,
        pack_overlap_pct=97.5,
        pack_exposed_ms=0.03,
        slot_wait_ms=4.0,
        busy_pct=88.0,
        tokens_per_s=9100.0,
        tokens=57344,
        batches_left=3,
        planned=10,
        skipped_ledgered=0,
        tflops=1.5,
        steady_tokens_per_s=9500.0,
        steady_tflops=1.6,
        steady_wall_s=6.0,
        steady_forward_s=5.5,
        steady_forward_tflops=1.75,
        bare_forward_s=0.0,
        bare_forwards=0,
        first_pass_forward_s=0.0,
        layers_run=4,
        gpu=GpuMemory(allocated_bytes=30 << 30, reserved_bytes=34 << 30, peak_bytes=31 << 30),
    ),
    plane=ProducerPlaneStats(
        slots=PlaneSlots(free=1, filling=1, queued=0, ready=2), inflight_per_drafter=[1, 1], routed_per_drafter=[4, 3], batches_sent=7
    ),
)
DRAFTER_STATS = DrafterStats(
    vitals=VITALS,
    work=DrafterWork(
        step=5, loss=float("nan"), acc=None, tau=1.25, tokens_per_s=9000.0, tokens=40960, params=1_000_000, train_elapsed_s=4.5, gpu=None
    ),
    queue_depth=1,
    outstanding=2,
    copying=0,
    wait_pct=12.5,
    slots_per_target=[3, 2],
)
DRAFTER_SUMMARY = DrafterSummary(final=DRAFTER_STATS, reason="max_steps 5", checkpoint="/run/checkpoints/step-5", export=None)
PAYLOADS = [
    TARGET_STATS,
    DRAFTER_STATS,
    DRAFTER_SUMMARY,
    VITALS,
    ProducerSummary(
        batches=7,
        rejected=0,
        plane=TARGET_STATS.plane,
        routing=RoutingLog(max_outstanding=2, decisions=[RoutedSlot(consumer=1, loads=[2, 0])]),
    ),
    ConsumerSummary(slots=10, bytes=40960, verified=True, active_s=1.5, copy_s=0.25, handoff_ns=[1, 2, 3], rejected=0, per_producer=[10]),
    ChildInfo(resume=ResumePoint(checkpoint="/run/checkpoints/step-5", step=5)),
    ChildInfo(fast_path=FastPath(fla=True, causal_conv1d=False)),
    ChildInfo(),
    ResumePoint(checkpoint="/c", step=0),
]

SAMPLES: dict[type, list[protocol.Message]] = {
    Hello: [
        Hello(role="target", rank=1, pid=4242, device="cuda:0", ring=DESCRIPTOR, endpoint="ipc:///tmp/x/sock/t1"),
        Hello(role="drafter", rank=0, pid=1, device="cpu"),
        Hello(role="drafter", rank=1, pid=1, device="cpu", info=ChildInfo(resume=ResumePoint(checkpoint="/c/step-5", step=5))),
        Hello(role="target", rank=0, pid=1, device="cpu", info=ChildInfo(fast_path=FastPath(fla=False, causal_conv1d=False))),
    ],
    Start: [
        Start(rings=[DESCRIPTOR, DESCRIPTOR], target_endpoints=["ipc://a", "ipc://b"], drafter_endpoints=["ipc://c"]),
        Start(rings=[], target_endpoints=[], drafter_endpoints=[], resume=ResumePoint(checkpoint="/c/step-5", step=5)),
    ],
    Ready: [Ready(role="drafter", rank=3)],
    Heartbeat: [Heartbeat(role="target", rank=0, target=TARGET_STATS), Heartbeat(role="drafter", rank=1, drafter=DRAFTER_STATS)],
    Done: [
        Done(role="consumer", rank=0, consumer=PAYLOADS[5]),
        Done(role="producer", rank=0, producer=PAYLOADS[4]),
        Done(role="drafter", rank=1, drafter=DRAFTER_SUMMARY),
        Done(role="target", rank=1, target=TARGET_STATS),
    ],
    Dead: [Dead(role="target", rank=0, error="RuntimeError: boom \u2603")],
    Shutdown: [Shutdown(reason="operator", checkpoint=True), Shutdown(reason="done")],
    SlotReady: [
        SlotReady(
            producer=1, slot=3, batch_id=[0, 1, 17], bucket=2, n_tokens=1000, n_seqs=3, seq=5, sent_ns=123456789, meta={"padded_len": 512}
        ),
        SlotReady(producer=0, slot=0, batch_id=[0, 0, 0], bucket=0, n_tokens=0, n_seqs=0, seq=0),
    ],
    SlotFree: [SlotFree(producer=0, slot=2, consumer=1, outstanding=2, received=9)],
    Load: [Load(consumer=1, outstanding=0, received=[3, 4])],
    EndOfData: [EndOfData(producer=1, batches_sent=77)],
}


def frame(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def good_slot_ready(**over) -> dict:
    d = {
        "v": PROTOCOL_VERSION,
        "t": "slot_ready",
        "producer": 0,
        "slot": 1,
        "batch_id": [0, 0, 3],
        "bucket": 0,
        "n_tokens": 8,
        "n_seqs": 1,
        "seq": 0,
    }
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
    assert _same(back, msg)
    assert _same(decode(bytearray(data)), msg) and _same(decode(memoryview(data)), msg)
    raw = msgpack.unpackb(data, raw=False)
    assert raw["v"] == PROTOCOL_VERSION and raw["t"] == msg.TAG


def test_every_type_round_trips_with_defaults_filled():
    # the minimal frame (only required fields) decodes to the dataclass defaults
    for tag, cls in MESSAGE_TYPES.items():
        full = msgpack.unpackb(encode(SAMPLES[cls][0]), raw=False)
        required = {
            f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        if cls in (Heartbeat, Done):
            required.add(full["role"])  # the role's payload field: optional by type, required by role
        minimal = {k: v for k, v in full.items() if k in required or k in ("v", "t")}
        out = decode(msgpack.packb(minimal, use_bin_type=True))
        assert type(out) is cls
        for f in dataclasses.fields(cls):
            if f.name not in required:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                assert getattr(out, f.name) == default, (tag, f.name)


def _same(a, b) -> bool:
    """Equality where NaN equals NaN (a diverged loss is a legitimate payload value)."""
    return repr(to_wire(a) if not isinstance(a, protocol.Message) else a) == repr(to_wire(b) if not isinstance(b, protocol.Message) else b)


# --------------------------------------------------------------------------- typed payloads


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: type(p).__name__)
def test_payload_round_trip(payload):
    wire = to_wire(payload)
    back = from_wire(type(payload), msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False))
    assert type(back) is type(payload) and _same(back, payload)


def _heartbeat_frame(role: str, payload) -> dict:
    return {"v": PROTOCOL_VERSION, "t": "heartbeat", "role": role, "rank": 0, role: to_wire(payload)}


@pytest.mark.parametrize(
    "role, payload, edit, expect",
    [
        (
            "drafter",
            DRAFTER_STATS,
            lambda d: d["work"].update(steps=d["work"].pop("step")),
            "missing_field: heartbeat.drafter.work.step missing",
        ),
        ("drafter", DRAFTER_STATS, lambda d: d["work"].update(step="5"), "bad_field_type: heartbeat.drafter.work.step = '5'"),
        (
            "drafter",
            DRAFTER_STATS,
            lambda d: d["vitals"]["rejected_by_kind"].update(undecodable=1.5),
            "bad_field_type: heartbeat.drafter.vitals.rejected_by_kind.undecodable = 1.5",
        ),
        ("drafter", DRAFTER_STATS, lambda d: d.update(wait_pct=-1.0), "out_of_range: heartbeat.drafter.wait_pct = -1.0 < 0"),
        (
            "target",
            TARGET_STATS,
            lambda d: d["plane"]["slots"].update(free=None),
            "bad_field_type: heartbeat.target.plane.slots.free = None",
        ),
        (
            "target",
            TARGET_STATS,
            lambda d: d["plane"]["slots"].update(fre=1),
            "unknown_field: heartbeat.target.plane.slots has unknown fields ['fre']",
        ),
        (
            "target",
            TARGET_STATS,
            lambda d: d["work"]["gpu"].update(peak_bytes=-1),
            "out_of_range: heartbeat.target.work.gpu.peak_bytes = -1 < 0",
        ),
        (
            "target",
            TARGET_STATS,
            lambda d: d["plane"]["inflight_per_drafter"].append("x"),
            "bad_field_type: heartbeat.target.plane.inflight_per_drafter[2] = 'x'",
        ),
    ],
)
def test_a_renamed_or_mistyped_nested_key_is_rejected_with_its_path(role, payload, edit, expect):
    f = _heartbeat_frame(role, payload)
    edit(f[role])
    with pytest.raises(ProtocolError) as ei:
        decode(msgpack.packb(f, use_bin_type=True))
    assert str(ei.value) == expect


def test_done_and_hello_payloads_are_checked_with_their_path():
    summary = to_wire(DRAFTER_SUMMARY)
    summary["final"]["work"]["los"] = summary["final"]["work"].pop("loss")
    with pytest.raises(ProtocolError, match=r"missing_field: done\.drafter\.final\.work\.loss missing"):
        decode(frame(v=1, t="done", role="drafter", rank=0, drafter=summary))
    with pytest.raises(ProtocolError, match=r"bad_field_type: hello\.info\.resume\.step = '5'"):
        decode(frame(v=1, t="hello", role="drafter", rank=0, pid=1, device="cpu", info={"resume": {"checkpoint": "/c", "step": "5"}}))
    with pytest.raises(ProtocolError, match=r"missing_field: start\.resume\.checkpoint missing"):
        decode(frame(v=1, t="start", rings=[], target_endpoints=[], drafter_endpoints=[], resume={"step": 5}))


def test_the_payload_field_must_match_the_role():
    # a drafter's figures sent as a target's, both, or none: refused on decode
    wrong = [
        frame(v=1, t="heartbeat", role="target", rank=0, drafter=to_wire(DRAFTER_STATS)),
        frame(v=1, t="heartbeat", role="drafter", rank=0, drafter=to_wire(DRAFTER_STATS), target=to_wire(TARGET_STATS)),
        frame(v=1, t="heartbeat", role="drafter", rank=0),
        frame(v=1, t="done", role="consumer", rank=0, producer=to_wire(PAYLOADS[4])),
    ]
    for f in wrong:
        with pytest.raises(ProtocolError, match="out_of_range: .*sends its payload in the field"):
            decode(f)
    # a target's figures in the drafter's field do not fit the drafter's type either
    with pytest.raises(ProtocolError, match=r"missing_field: heartbeat\.drafter\.work\.step missing"):
        decode(frame(v=1, t="heartbeat", role="drafter", rank=0, drafter=to_wire(TARGET_STATS)))
    with pytest.raises(ValueError, match="sends its payload"):
        Heartbeat(role="drafter", rank=0, target=TARGET_STATS)
    assert Heartbeat(role="target", rank=0, target=TARGET_STATS).stats is TARGET_STATS
    assert Done(role="drafter", rank=0, drafter=DRAFTER_SUMMARY).summary is DRAFTER_SUMMARY


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
    assert kinds <= {
        "undecodable",
        "not_a_map",
        "bad_version",
        "unknown_type",
        "missing_field",
        "bad_field_type",
        "unknown_field",
        "out_of_range",
    }


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
            data = data[: rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1) :]
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
        "not_a_map",
        "out_of_range",
        "undecodable",
    ]


def test_reject_counter_default_logger(caplog):
    rc = RejectCounter("producer-1")
    with caplog.at_level(logging.WARNING, logger=protocol.log.name):
        for _ in range(5):
            rc.reject("bad_slot_free", "slot 2 is free")
    assert rc.total == 5 and rc.by_kind == {"bad_slot_free": 5}
    assert len([r for r in caplog.records if "bad_slot_free" in r.getMessage()]) == 1
