"""Host memory of the drafter's rank record (weights sha256), the old way and the new, in one process.

Builds a real DrafterCore from CONFIG on DEVICE (no target, no data), then measures the process's
peak host RSS (ru_maxrss) around :meth:`DrafterCore.weights_digest` (one tensor on the host at a
time) and around the old digest (the whole trainable state copied to the host first, then hashed),
checking the two digests agree. The new way runs first: ru_maxrss is a high-water mark.

    python tools/digest_rss.py configs/h200-x2.toml cuda:0     # the 27B-shape drafter (1.78B params)
    python tools/digest_rss.py configs/tiny-cpu.toml cpu       # a dry run
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_ipc.config import load_config
from dflash_ipc.drafter.core import DrafterCore
from dflash_ipc.drafter.distributed import DistInfo


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def old_digest(core: DrafterCore) -> str:
    h = hashlib.sha256()
    for name, t in sorted(core.trainer.trainable_state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def main(config_path: str, device: str) -> None:
    cfg = load_config(config_path)
    out: dict = {"config": config_path, "device": device}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        core = DrafterCore(cfg, Path(tmp), DistInfo.single(device), torch.device(device), total_steps=10, resume=False)
        out |= {"build_s": round(time.perf_counter() - t0, 1), "params": core.n_params, "peak_rss_after_build_gib": round(peak_gib(), 2)}
        t0 = time.perf_counter()
        new = core.weights_digest()
        out |= {"new_s": round(time.perf_counter() - t0, 1), "peak_rss_after_new_digest_gib": round(peak_gib(), 2)}
        t0 = time.perf_counter()
        old = old_digest(core)
        out |= {"old_s": round(time.perf_counter() - t0, 1), "peak_rss_after_old_digest_gib": round(peak_gib(), 2)}
        out["digests_equal"] = new == old
        core.close()
    print(json.dumps(out))
    if not out["digests_equal"]:
        sys.exit("the two digests differ")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
