"""`dflash-ipc bench gpu-ring`: reference copies and the two-process ring measurements on this host.

* :func:`measure_reference_gbps` — raw ``copy_`` between two devices in one process (CUDA
  events, median of repeats): the ceiling a ring is compared with.
* :func:`measure_pinned_reference_gbps` — pinned D2H / H2D in one process (host-pinned ceiling).
* :func:`run_bench` — the references, then ring throughput and handoff scenarios through
  :func:`dflash_ipc.bench.gpu_ring.run_scenarios` (GPU 0 produces).
"""

from __future__ import annotations

import os
import statistics

import torch

from dflash_ipc.bench.gpu_ring import (
    GIB,
    MIB,
    handoff_scenario,
    layout_for_bytes,
    run_scenarios,
    scenario,
)
from dflash_ipc.platform.devices import as_device, cuda_device
from dflash_ipc.transport.factory import choose_backend


def measure_reference_gbps(src_dev, dst_dev, nbytes: int, *, repeats: int = 10, warmup: int = 3) -> float:
    """GB/s (1e9 bytes/s) of ``dst.copy_(src)`` of ``nbytes`` between two devices in one process.

    Timed with CUDA events on the copy's stream (the source device's current stream; host
    memory is pinned when one side is the CPU); median of ``repeats``."""
    src_dev, dst_dev = (cuda_device(d) if as_device(d).type == "cuda" else as_device(d) for d in (src_dev, dst_dev))
    nbytes = int(nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev, pin_memory=src_dev.type == "cpu")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev, pin_memory=dst_dev.type == "cpu")
    src.fill_(7)
    timing_dev = src_dev if src_dev.type == "cuda" else dst_dev
    stream = torch.cuda.current_stream(timing_dev)
    times = []
    with torch.cuda.device(timing_dev):
        for r in range(warmup + repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            if r >= warmup:
                times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / 1e9


def measure_pinned_reference_gbps(dev, nbytes: int, *, repeats: int = 5) -> dict:
    """Pinned D2H and H2D GB/s of one device; ``min`` is the host-pinned ring's ceiling."""
    d2h = measure_reference_gbps(dev, "cpu", nbytes, repeats=repeats, warmup=1)
    h2d = measure_reference_gbps("cpu", dev, nbytes, repeats=repeats, warmup=1)
    return {"d2h": d2h, "h2d": h2d, "min": min(d2h, h2d)}


def run_bench(quick: bool = False, progress=print) -> dict:
    """Reference copies and ring throughput / handoff on this host (GPU 0 produces)."""
    n = torch.cuda.device_count()
    if n == 0:
        raise RuntimeError("no CUDA device")
    other = 1 if n > 1 else 0
    out: dict = {
        "torch": torch.__version__,
        "devices": [torch.cuda.get_device_name(i) for i in range(n)],
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    if n > 1:
        out["peer_access"] = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
        out["auto"] = list(choose_backend(0, [1]))
    out["reference_gbps"] = ref = reference_copies(other, progress)
    rings = run_scenarios(ring_scenarios(other, quick), timeout=500)
    for r in rings:
        if r["mode"] == "stream":
            label = "1GiB" if r["slot_bytes"] >= GIB else "256MiB"
            if r["backend"] == "cuda-ipc":
                refv = ref[("peer_" if r["consumer_device"] != r["producer_device"] else "same_") + label]
            else:
                refv = ref["pinned_256MiB"]["min"]
            r["reference_gbps"] = refv
            r["ratio"] = r["gbps"] / refv if r["gbps"] and refv else None
            progress(
                f"[ring] {r['name']} ({r['copy_mode']}): {r['gbps']:.1f} GB/s ({100 * (r['ratio'] or 0):.1f}% of {refv:.1f}), "
                f"{r['slots']} slots, errors {r['errors']}, open {r['open_s'] * 1e3:.0f} ms"
            )
        else:
            progress(
                f"[handoff] {r['name']} ({r['copy_mode']}): "
                f"commit->copied p50 {r['handoff_us_p50']:.0f} us p99 {r['handoff_us_p99']:.0f} us, "
                f"round trip p50 {r['roundtrip_us_p50']:.0f} us p99 {r['roundtrip_us_p99']:.0f} us, errors {r['errors']}"
            )
    out["rings"] = rings
    if n > 1 and not quick:
        for key, env in (
            ("expandable_segments", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
            ("push", {"DFLASH_IPC_CUDA_COPY": "push"}),
        ):
            out[f"rings_{key}"] = environment_variant_rings(key, env, other, ref, progress)
    return out


def reference_copies(other: int, progress) -> dict:
    """Plain copy bandwidths the rings are measured against: device to device (cuda:0 to ``other`` and
    to itself, 1 GiB and 256 MiB) and through pinned host memory (256 MiB)."""
    ref = {}
    for size, label in ((GIB, "1GiB"), (256 * MIB, "256MiB")):
        ref[f"peer_{label}"] = measure_reference_gbps(0, other, size)
        ref[f"same_{label}"] = measure_reference_gbps(0, 0, size)
        progress(f"[ref] {label}: cuda:0->cuda:{other} {ref[f'peer_{label}']:.1f} GB/s, cuda:0->cuda:0 {ref[f'same_{label}']:.1f} GB/s")
    pin = measure_pinned_reference_gbps(0, 256 * MIB)
    pin1 = measure_pinned_reference_gbps(other, 256 * MIB)
    ref["pinned_256MiB"] = {
        "d2h_0": pin["d2h"],
        "h2d_0": pin["h2d"],
        "d2h_other": pin1["d2h"],
        "h2d_other": pin1["h2d"],
        "min": min(pin["d2h"], pin1["h2d"]),
    }
    progress(f"[ref] pinned 256 MiB: D2H {pin['d2h']:.1f}, H2D(other) {pin1['h2d']:.1f} GB/s")
    return ref


def ring_scenarios(other: int, quick: bool) -> list:
    """The ring streams (cuda-ipc to ``other`` and to itself, host-pinned, with and without the
    producer's fill) and handoffs; ``quick``: a quarter of the iterations (at least 20)."""
    it = (lambda x: max(20, x // 4)) if quick else (lambda x: x)
    return [
        scenario("cuda-ipc 1GiB other", "cuda-ipc", 0, other, layout_for_bytes(GIB), num_slots=4, iters=it(150), warmup=10),
        scenario("cuda-ipc 256MiB other", "cuda-ipc", 0, other, layout_for_bytes(256 * MIB), num_slots=4, iters=it(400), warmup=20),
        scenario("cuda-ipc 1GiB same", "cuda-ipc", 0, 0, layout_for_bytes(GIB), num_slots=4, iters=it(150), warmup=10),
        scenario("cuda-ipc 256MiB same", "cuda-ipc", 0, 0, layout_for_bytes(256 * MIB), num_slots=4, iters=it(400), warmup=20),
        scenario("host-pinned 256MiB other", "host-pinned", 0, other, layout_for_bytes(256 * MIB), num_slots=4, iters=it(60), warmup=5),
        scenario(
            "cuda-ipc 256MiB other nofill",
            "cuda-ipc",
            0,
            other,
            layout_for_bytes(256 * MIB),
            num_slots=4,
            iters=it(400),
            warmup=20,
            fill="none",
        ),
        scenario("cuda-ipc 1GiB same nofill", "cuda-ipc", 0, 0, layout_for_bytes(GIB), num_slots=4, iters=it(150), warmup=10, fill="none"),
        scenario(
            "cuda-ipc 256MiB same nofill", "cuda-ipc", 0, 0, layout_for_bytes(256 * MIB), num_slots=4, iters=it(400), warmup=20, fill="none"
        ),
        handoff_scenario("cuda-ipc", 0, other, iters=it(2000)),
        handoff_scenario("cuda-ipc", 0, 0, iters=it(2000)),
        handoff_scenario("host-pinned", 0, other, iters=it(1000)),
    ]


def environment_variant_rings(key: str, env: dict[str, str], other: int, ref: dict, progress) -> list:
    """The peer cuda-ipc streams (and, for ``push``, a handoff) again under ``env``."""
    scs = [
        scenario(f"cuda-ipc 1GiB other {key}", "cuda-ipc", 0, other, layout_for_bytes(GIB), num_slots=4, iters=100, warmup=10),
        scenario(f"cuda-ipc 256MiB other {key}", "cuda-ipc", 0, other, layout_for_bytes(256 * MIB), num_slots=4, iters=300, warmup=20),
    ]
    if key == "push":
        scs.append(handoff_scenario("cuda-ipc", 0, other, iters=1000))
    rs = run_scenarios(scs, env=env, timeout=300)
    for r in rs:
        if r["mode"] != "stream":
            progress(
                f"[handoff] {r['name']} {key} ({r['copy_mode']}): commit->copied p50 {r['handoff_us_p50']:.0f} us "
                f"p99 {r['handoff_us_p99']:.0f} us, errors {r['errors']}"
            )
            continue
        refv = ref["peer_1GiB" if r["slot_bytes"] >= GIB else "peer_256MiB"]
        r["reference_gbps"] = refv
        r["ratio"] = r["gbps"] / refv if r["gbps"] else None
        progress(
            f"[ring] {r['name']} ({r['copy_mode']}): {r['gbps']:.1f} GB/s ({100 * (r['ratio'] or 0):.1f}% of {refv:.1f}), "
            f"errors {r['errors']}"
        )
    return rs
