"""Packing captured planes into ring slots: contents, async == sync, capture-buffer safety."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from dflash_ipc.config import TargetConfig
from dflash_ipc.target.model import build_target
from dflash_ipc.target.packing import AsyncPacker, BatchMeta, OverlapMeter, PackHandle, flat_batch_meta, pack_into_slot, real_token_index
from dflash_ipc.target_spec.hf_config import tiny_spec
from dflash_ipc.transport.slots import SlotLayout

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
K, H = 3, 32


def _layout(k=K, h=H, max_tokens=256, max_seqs=8, dtype="float32") -> SlotLayout:
    return SlotLayout(num_planes=k, hidden_size=h, max_tokens=max_tokens, max_seqs=max_seqs, plane_dtype=dtype)


def _slot(layout: SlotLayout, device, fill: int = 0xAB) -> torch.Tensor:
    return torch.full((layout.slot_bytes,), fill, dtype=torch.uint8, device=device)


def _batch(rng: random.Random, device, k=K, h=H, max_b=6, max_l=40, dtype=torch.float32):
    b = rng.randint(1, max_b)
    lens = [rng.randint(1, max_l) for _ in range(b)]
    L = max(lens)
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    captured = [torch.randn(b, L, h, generator=g).to(device=device, dtype=dtype) for _ in range(k)]
    for t in captured:  # pad positions hold garbage, as in a real forward
        for i, n in enumerate(lens):
            t[i, n:] = float("nan")
    ids = torch.randint(0, 1000, (b, L), generator=g)
    mask = torch.rand(b, L, generator=g) < 0.7
    return captured, BatchMeta(seq_lens=lens, token_ids=ids.to(device), loss_mask=mask)


def _expected(captured, meta):
    """Reference by a per-sequence Python loop (independent of the packer's index math)."""
    lens = meta.lens()
    planes = torch.stack([torch.cat([t[i, :n] for i, n in enumerate(lens)]) for t in captured])
    ids = torch.cat([meta.token_ids[i, :n] for i, n in enumerate(lens)]).long()
    mask = torch.cat([meta.loss_mask[i, :n] for i, n in enumerate(lens)]).to(torch.uint8)
    return planes.cpu(), ids.cpu(), mask.cpu(), torch.tensor(lens, dtype=torch.int32)


def _check_slot(layout, slot, captured_or_expected, meta=None):
    exp = captured_or_expected if meta is None else _expected(captured_or_expected, meta)
    planes, ids, mask, lens = exp
    v = layout.views(slot, planes.shape[1], lens.shape[0])
    assert torch.equal(v.planes.cpu(), planes.to(v.planes.dtype))
    assert torch.equal(v.token_ids.cpu(), ids)
    assert torch.equal(v.loss_mask.cpu(), mask)
    assert torch.equal(v.seq_lens.cpu(), lens)


def _used_bytes(layout, slot, n, b) -> bytes:
    return b"".join(slot[o : o + nb].cpu().numpy().tobytes() for o, nb in layout.used_ranges(n, b))


def test_real_token_index():
    idx = real_token_index(torch.tensor([3, 1, 2]), padded_len=4, n_tokens=6)
    assert idx.tolist() == [0, 1, 2, 4, 8, 9]


@pytest.mark.parametrize("device", DEVICES)
def test_slot_holds_real_tokens_only(device):
    layout = _layout()
    rng = random.Random(0)
    for _ in range(5):
        captured, meta = _batch(rng, device)
        slot = _slot(layout, device)
        pack_into_slot(layout, slot, captured, meta)
        _check_slot(layout, slot, captured, meta)
        n, b = sum(meta.lens()), len(meta.lens())
        # nothing written outside the used ranges (planes are one contiguous [k, n, H] prefix)
        used = torch.zeros(layout.slot_bytes, dtype=torch.bool)
        for o, nb in layout.used_ranges(n, b):
            used[o : o + nb] = True
        assert bool((slot.cpu()[~used] == 0xAB).all())
        assert not torch.isnan(layout.views(slot, n, b).planes).any()


def test_flat_meta_and_dtype_conversion():
    layout = _layout(dtype="bfloat16")
    captured, meta = _batch(random.Random(1), "cpu")
    planes, ids, mask, lens = _expected(captured, meta)
    flat = BatchMeta(seq_lens=torch.tensor(meta.lens()), token_ids=ids.int(), loss_mask=mask.bool())
    slot = _slot(layout, "cpu")
    pack_into_slot(layout, slot, captured, flat)
    _check_slot(layout, slot, (planes.to(torch.bfloat16), ids, mask, lens))


def test_rejects_bad_batches():
    layout = _layout(max_tokens=16, max_seqs=2)
    captured, meta = _batch(random.Random(2), "cpu", max_b=1, max_l=8)
    slot = _slot(layout, "cpu")
    with AsyncPacker(layout, "cpu") as p:
        with pytest.raises(ValueError, match="planes"):
            p.submit(captured[:2], meta, 0, slot)
        with pytest.raises(ValueError, match="exceeds"):
            big = [torch.zeros(3, 8, H) for _ in range(K)]
            p.submit(big, BatchMeta([8, 8, 8], torch.zeros(3, 8, dtype=torch.long), torch.ones(3, 8)), 0, slot)
        # an error inside the worker surfaces at wait()
        bad = BatchMeta(meta.seq_lens, torch.zeros(5, 5, dtype=torch.long), meta.loss_mask)
        h = p.submit(captured, bad, 0, slot)
        with pytest.raises(RuntimeError, match="slot 0"):
            h.wait(timeout=10)
        with pytest.raises(RuntimeError, match="earlier pack failed"):
            p.drain()


@pytest.mark.parametrize("device", DEVICES)
def test_async_bit_identical_to_sync(device):
    layout = _layout()
    n_slots = 3
    slots_async = [_slot(layout, device) for _ in range(n_slots)]
    slots_sync = [_slot(layout, device) for _ in range(n_slots)]
    rng = random.Random(3)
    sync = AsyncPacker(layout, device, async_pack=False)
    with AsyncPacker(layout, device, async_pack=True, max_pending=2) as apk:
        pending = []
        for i in range(30):
            captured, meta = _batch(rng, device)
            s = i % n_slots
            hs = sync.submit(captured, meta, s, slots_sync[s]).wait()
            ha = apk.submit(captured, meta, s, slots_async[s])
            del captured  # the packer owns them now
            pending.append((ha, hs, s))
            # keep up to two packs in flight; check each before its slot is reused
            while len(pending) > 1 or (i == 29 and pending):
                ha, hs, s = pending.pop(0)
                ha.wait()
                n, b = ha.n_tokens, ha.n_seqs
                assert _used_bytes(layout, slots_async[s], n, b) == _used_bytes(layout, slots_sync[s], n, b)
                assert ha.pack_time_s is not None and ha.pack_time_s >= 0
        st = apk.stats()
    assert st["packs"] == 30 and st["pending"] == 0 and st["pack_s_total"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_freed_capture_buffers_cannot_corrupt_slot(device):
    """Drop the captured tensors right after submit and immediately reuse/overwrite memory of
    the same size (what the next forward does) while the pack is delayed: the slot must still
    hold the original planes."""
    layout = _layout(max_tokens=512)
    rng = random.Random(4)
    with AsyncPacker(layout, device, async_pack=True, _debug_delay_s=0.05) as p:
        for _ in range(3):
            captured, meta = _batch(rng, device, max_l=80)
            expected = _expected(captured, meta)
            shape = captured[0].shape
            slot = _slot(layout, device)
            h = p.submit(captured, meta, 0, slot)
            del captured, meta
            gc.collect()
            junk = [torch.empty(shape, device=device).fill_(float("nan")) for _ in range(2 * K)]
            for j in junk:
                j.mul_(2)
            h.wait()
            _check_slot(layout, slot, expected)
            del junk


@pytest.mark.gpu
def test_negative_control_without_keepalive_is_caught():
    """With the keep-alive disabled (test-only switch) the same scenario corrupts the slot:
    proves the test above would catch a freed/reused capture buffer."""
    layout = _layout(max_tokens=512)
    rng = random.Random(5)
    corrupted = 0
    with AsyncPacker(layout, "cuda", async_pack=True, _debug_delay_s=0.05, _unsafe_no_keepalive=True) as p:
        for _ in range(3):
            captured, meta = _batch(rng, "cuda", max_l=80)
            expected = _expected(captured, meta)
            shape = captured[0].shape
            slot = _slot(layout, "cuda")
            h = p.submit(captured, meta, 0, slot)
            del captured, meta
            junk = [torch.empty(shape, device="cuda").fill_(float("nan")) for _ in range(2 * K)]
            h.wait()
            planes = layout.views(slot, expected[0].shape[1], expected[3].shape[0]).planes.cpu()
            corrupted += int(not torch.equal(planes, expected[0]))
            del junk
    assert corrupted > 0


@pytest.mark.gpu
def test_cuda_capture_into_pinned_host_slot():
    layout = _layout()
    slot = _slot(layout, "cpu").pin_memory()
    captured, meta = _batch(random.Random(6), "cuda")
    with AsyncPacker(layout, "cuda") as p:
        p.submit(captured, meta, 0, slot).wait()
    _check_slot(layout, slot, captured, meta)


@pytest.mark.gpu
def test_cuda_submit_does_not_wait_for_the_forward():
    """submit returns while the compute stream is still busy (pack queued on the side stream)."""
    layout = _layout()
    captured, meta = _batch(random.Random(7), "cuda")
    slot = _slot(layout, "cuda")
    with AsyncPacker(layout, "cuda") as p:
        torch.cuda._sleep(int(0.2 * 1.5e9))  # a long "forward" on the compute stream
        h = p.submit(captured, meta, 0, slot)
        assert not h.done()
        h.wait()
    _check_slot(layout, slot, captured, meta)


def test_sync_mode_cpu():
    layout = _layout()
    captured, meta = _batch(random.Random(8), "cpu")
    slot = _slot(layout, "cpu")
    p = AsyncPacker(layout, "cpu", async_pack=False)
    h = p.submit(captured, meta, 2, slot)
    assert h.done() and h.slot_index == 2 and h.pack_time_s > 0
    _check_slot(layout, slot, captured, meta)


@pytest.mark.parametrize("device", DEVICES)
def test_flat_host_meta_packs_the_same_bytes(device):
    """The target's path (real-token ids/mask flattened on the host, pinned on GPU hosts)
    writes exactly the slot the padded [B, L] meta writes."""
    layout = _layout()
    rng = random.Random(21)
    with AsyncPacker(layout, device) as p:
        for i in range(20):
            captured, meta = _batch(rng, device)
            padded = BatchMeta(meta.seq_lens, meta.token_ids.cpu(), meta.loss_mask.cpu())
            flat = flat_batch_meta(padded.token_ids, padded.loss_mask, torch.tensor(meta.lens()), pin=device == "cuda")
            assert flat.token_ids.dim() == 1 and flat.token_ids.numel() == sum(meta.lens())
            a, b = _slot(layout, device, 0x11), _slot(layout, device, 0x11)
            p.submit(captured, padded, i, a)
            p.submit(captured, flat, i, b).wait()
            p.drain()
            assert torch.equal(a, b)
            _check_slot(layout, b, captured, padded)


def _host_pack(start: float, end: float) -> PackHandle:
    h = PackHandle(0, 1, 1)
    h._host_interval = (start, end)
    h._finish()
    return h


def test_overlap_meter_arithmetic():
    m = OverlapMeter("cpu")
    m.add_forward(0.0, 1.0)
    m.add_pack(_host_pack(0.5, 1.5))  # half under forward 1, half in the gap
    m.add_pack(_host_pack(2.2, 2.4))  # wholly under forward 2
    assert m.stats()["packs_measured"] == 0  # nothing settled before a forward ends after them
    m.add_forward(2.0, 3.0)
    st = m.stats()
    assert st["packs_measured"] == 2
    assert st["pack_overlap_pct"] == pytest.approx(100 * 0.7 / 1.2)
    assert st["pack_exposed_ms"] == pytest.approx(1e3 * 0.5 / 2)
    m.add_pack(_host_pack(3.5, 3.6))  # the last pack: no forward after it
    assert m.stats()["packs_measured"] == 2
    assert m.stats(final=True)["packs_measured"] == 3


@pytest.mark.parametrize("device", DEVICES)
def test_overlap_meter_sync_packing_is_fully_exposed(device):
    """Packing inline between two forwards can overlap neither (stream / thread order)."""
    layout = _layout()
    m = OverlapMeter(device)
    p = AsyncPacker(layout, device, async_pack=False)
    rng = random.Random(11)
    for i in range(3):
        captured, meta = _batch(rng, device)
        f0 = m.mark()
        (captured[0] @ captured[0].transpose(1, 2)).sum()  # a "forward" on the same stream
        f1 = m.mark()
        h = p.submit(captured, meta, i, _slot(layout, device))
        h.wait()
        if device == "cuda":
            torch.cuda.synchronize()
        m.add_forward(f0, f1)
        m.add_pack(h)
    f0 = m.mark()
    f1 = m.mark()
    if device == "cuda":
        torch.cuda.synchronize()
    m.add_forward(f0, f1)
    st = m.stats()
    assert st["packs_measured"] == 3
    assert st["pack_overlap_pct"] == 0.0
    assert st["pack_exposed_ms"] > 0


def test_overlap_meter_async_pack_inside_a_running_forward_cpu():
    """A pack submitted while a forward runs, which ends only after the pack: fully overlapped."""
    layout = _layout()
    m = OverlapMeter("cpu")
    rng = random.Random(12)
    with AsyncPacker(layout, "cpu") as p:
        for i in range(3):
            captured, meta = _batch(rng, "cpu")
            f0 = m.mark()
            h = p.submit(captured, meta, i, _slot(layout, "cpu"))
            h.wait()
            m.add_forward(f0, m.mark())
            m.add_pack(h)
        m.add_forward(m.mark(), m.mark())
    st = m.stats()
    assert st["packs_measured"] == 3 and st["pack_overlap_pct"] == pytest.approx(100.0)


@pytest.mark.gpu
def test_overlap_meter_cuda_pack_runs_under_next_forward():
    """The real pattern: pack N on the side stream, forward N+1 on the compute stream."""
    layout = _layout()
    m = OverlapMeter("cuda")
    captured, meta = _batch(random.Random(13), "cuda")
    with AsyncPacker(layout, "cuda", _debug_delay_s=0.02) as p:
        f0 = m.mark()
        torch.cuda._sleep(int(0.01 * 1.5e9))
        f1 = m.mark()
        h = p.submit(captured, meta, 0, _slot(layout, "cuda"))
        g0 = m.mark()
        torch.cuda._sleep(int(0.2 * 1.5e9))  # forward N+1, much longer than the pack
        g1 = m.mark()
        torch.cuda.synchronize()
        h.wait()
    m.add_forward(f0, f1)
    m.add_pack(h)
    m.add_forward(g0, g1)
    st = m.stats()
    assert st["packs_measured"] == 1 and st["pack_overlap_pct"] > 50.0


def test_pack_real_capture_equals_unpadded_forward():
    """End to end on the tiny target: padded capture -> slot == per-sequence unpadded capture."""
    t = build_target(TargetConfig(spec=tiny_spec(300), layer_ids=[1, 2, 4]), "cpu")
    lens = [7, 12, 3]
    ids = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(9))
    mask = torch.ones(3, 12, dtype=torch.bool)
    captured = t.capture(ids)
    layout = _layout(k=3, h=64, max_tokens=64)
    slot = _slot(layout, "cpu")
    with AsyncPacker(layout, "cpu") as p:
        p.submit(captured, BatchMeta(lens, ids, mask), 0, slot).wait()
    v = layout.views(slot, sum(lens), 3)
    off = 0
    for b, n in enumerate(lens):
        alone = t.capture(ids[b : b + 1, :n])
        for j in range(3):
            torch.testing.assert_close(v.planes[j, off : off + n], alone[j][0], rtol=1e-5, atol=1e-5)
        assert torch.equal(v.token_ids[off : off + n], ids[b, :n])
        off += n
    assert v.seq_lens.tolist() == lens
