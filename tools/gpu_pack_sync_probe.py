"""Which part of a pack submit blocks the host? (GPU diagnostic, ~1 min)

A 200 ms sleep kernel is queued on the compute stream first; the pack's side stream waits for
it. An asynchronous submit returns in well under 200 ms; one that synchronizes takes >= 200 ms.
"""

import time

import torch

from dflash_ipc.target.packing import AsyncPacker, BatchMeta, real_token_index
from dflash_ipc.transport.slots import SlotLayout

dev = torch.device("cuda:0")
torch.cuda.set_device(dev)
B, L, H, K = 48, 768, 5120, 5
lens = torch.randint(L // 2, L + 1, (B,))
lens[0] = L
n = int(lens.sum())
layout = SlotLayout(num_planes=K, hidden_size=H, max_tokens=49152, max_seqs=128, plane_dtype="bfloat16")
slot = torch.empty(layout.slot_bytes, dtype=torch.uint8, device=dev)
ids_cpu = torch.randint(0, 1000, (B, L))
mask_cpu = torch.rand(B, L) < 0.7
with torch.inference_mode():
    planes_inf = [torch.randn(B, L, H, device=dev, dtype=torch.bfloat16) for _ in range(K)]
planes = [torch.randn(B, L, H, device=dev, dtype=torch.bfloat16) for _ in range(K)]
SLEEP = int(0.2 * 1.5e9)


def timed(label, fn):
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    print(f"{label:60s} host {1e3 * dt:8.2f} ms  {'BLOCKS' if dt > 0.15 else 'async'}", flush=True)


side = torch.cuda.Stream(dev)
idx = real_token_index(lens.to(dev), L, n)
out = torch.empty(n, H, dtype=torch.bfloat16, device=dev)
ids_buf = torch.empty(n, dtype=torch.int64, device=dev)
for _ in range(2):
    timed("index_select(out=) on compute stream", lambda: torch.index_select(planes[0].reshape(-1, H), 0, idx, out=out))
    timed("index_select (no out) on compute stream", lambda: planes[0].reshape(-1, H).index_select(0, idx))
    timed("advanced indexing flat[idx]", lambda: planes[0].reshape(-1, H)[idx])
    timed("index_select inference tensor", lambda: torch.index_select(planes_inf[0].reshape(-1, H), 0, idx, out=out))
    timed("real_token_index on GPU from pinned lens", lambda: real_token_index(lens.pin_memory().to(dev, non_blocking=True), L, n))
    timed("pin_memory + H2D of ids", lambda: ids_buf.copy_(ids_cpu.reshape(-1)[:n].contiguous().pin_memory(), non_blocking=True))
    timed("CPU gather of ids", lambda: ids_cpu.reshape(-1).index_select(0, real_token_index(lens, L, n)))
    for inf in (False, True):
        for ids_dev in (False, True):
            p = AsyncPacker(layout, dev)
            meta = BatchMeta(seq_lens=lens, token_ids=ids_cpu.to(dev) if ids_dev else ids_cpu, loss_mask=mask_cpu)
            timed(
                f"AsyncPacker.submit inference={inf} ids_on_gpu={ids_dev}",
                lambda p=p, inf=inf, meta=meta: p.submit(planes_inf if inf else planes, meta, 0, slot),
            )
            p.close()

# The fix: the target prepares the real-token ids / mask on the host while its forward runs
# (flat [n], pinned), so submit only enqueues GPU gathers and pinned H2D copies.
flat_idx = real_token_index(lens, L, n)
flat_ids = ids_cpu.reshape(-1).index_select(0, flat_idx).pin_memory()
flat_mask = mask_cpu.reshape(-1).index_select(0, flat_idx).to(torch.uint8).pin_memory()
for _ in range(3):
    for inf in (False, True):
        p = AsyncPacker(layout, dev)
        meta = BatchMeta(seq_lens=lens, token_ids=flat_ids, loss_mask=flat_mask)
        timed(
            f"AsyncPacker.submit flat pinned meta, inference={inf}",
            lambda p=p, inf=inf, meta=meta: p.submit(planes_inf if inf else planes, meta, 0, slot),
        )
        p.close()
