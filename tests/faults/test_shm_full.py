"""A /dev/shm too small for the rings: refused before spawn naming /dev/shm and
the key, never a SIGBUS mid-run.

The real thing runs in a private mount namespace (``unshare -m``) with an 8 MiB tmpfs on
/dev/shm, as the trial did: it needs root and a kernel that allows it, and is skipped with the
reason otherwise. The check itself is also tested with an injected free-space figure.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import write_toml
from test_bad_configs import base_config

from dflash_ipc.config import ConfigError, config_from_dict
from dflash_ipc.drafter.model.dflash_drafter import DrafterModelConfig
from dflash_ipc.runtime import liveness, resources
from dflash_ipc.runtime.preflight import check_memory
from dflash_ipc.target_spec.hf_config import default_layer_ids, make_hf_config

SMALL_SHM = "8m"  # the trial's size; the tiny config's two rings need 12.1 MiB


def _namespace_problem() -> str | None:
    """Why a private mount namespace with its own /dev/shm cannot be made here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={SMALL_SHM} tmpfs /dev/shm"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        return f"cannot mount a private /dev/shm (needs root and unshare -m): {probe.stderr.strip() or probe.returncode}"
    return None


def in_small_shm(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``argv`` in a private mount namespace whose /dev/shm is an 8 MiB tmpfs."""
    problem = _namespace_problem()
    if problem:
        pytest.skip(problem)
    script = f'mount -t tmpfs -o size={SMALL_SHM} tmpfs /dev/shm && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *argv], capture_output=True, text=True, timeout=300, cwd=cwd)


def tiny_shapes(cfg):
    hf = make_hf_config(cfg.target.spec, 1024)
    ids = default_layer_ids(int(hf.num_hidden_layers), cfg.target.num_capture_layers)
    return hf, ids, DrafterModelConfig.from_configs(cfg.drafter, hf, ids, 5)


def test_rings_larger_than_free_shm_refused_with_injected_figure():
    cfg = config_from_dict(base_config(), "tiny.toml")
    hf, ids, shape = tiny_shapes(cfg)
    rings = sum(n.nbytes for n in resources.estimate(cfg, hf, ids, shape, "cpu-shm") if n.place == resources.SHM)
    plenty = 1 << 40
    # exactly enough (rings + margin) passes; one byte less is refused
    check_memory(cfg, hf, ids, shape, resources.Available(host=plenty, shm=rings + resources.SHM_MARGIN_BYTES))
    with pytest.raises(ConfigError) as ei:
        check_memory(cfg, hf, ids, shape, resources.Available(host=plenty, shm=rings + resources.SHM_MARGIN_BYTES - 1))
    msg = str(ei.value)
    assert msg.startswith(f"tiny.toml: transport.ring_slots: the rings need {rings / 2**20:.1f} MiB of shared memory in /dev/shm"), msg
    assert "target-0 ring (4 slots x " in msg and "target-1 ring" in msg and "--shm-size" in msg
    # host memory counts the rings too (tmpfs pages are RAM)
    with pytest.raises(ConfigError, match=r"the run needs at least .* of host memory but 1\.0 MiB is available"):
        check_memory(cfg, hf, ids, shape, resources.Available(host=1 << 20, shm=plenty))
    # rings on a GPU (cuda-ipc) are not counted in /dev/shm
    on_gpu = [n for n in resources.estimate(cfg, hf, ids, shape, "cuda-ipc") if n.place == resources.SHM]
    assert on_gpu == []


def test_gpu_memory_refused_per_device():
    raw = base_config()
    raw["topology"] = {"targets": ["cuda:0"], "drafters": ["cuda:0"]}
    raw["transport"]["backend"] = "cuda-ipc"
    cfg = config_from_dict(raw, "gpu.toml")
    hf, ids, shape = tiny_shapes(cfg)
    needs = resources.estimate(cfg, hf, ids, shape, "cuda-ipc")
    on_device = sum(n.nbytes for n in needs if n.place == "cuda:0")
    resources.check_fits(cfg, needs, resources.Available(host=1 << 40, shm=0, cuda={0: on_device}))
    with pytest.raises(ConfigError, match=r"^gpu\.toml: [a-z_.]+: cuda:0 would hold at least .* but has .* free \(target-0"):
        resources.check_fits(cfg, needs, resources.Available(host=1 << 40, shm=0, cuda={0: on_device - 1}))


@pytest.mark.parametrize(
    "name, patch, key, available_gib",
    [
        ("64 CPU drafters", {"topology": {"drafters": ["cpu"] * 64}}, "topology.drafters", 8),
        ("200 CPU targets", {"topology": {"targets": ["cpu"] * 200}}, "topology.targets", 19),  # this test machine's 19 GiB
        ("64 exec'd CPU drafters", {"topology": {"drafters": ["cpu"] * 64}, "run": {"launcher": "exec"}}, "topology.drafters", 16),
    ],
)
def test_every_process_counts_its_own_memory(name, patch, key, available_gib):
    """Each target and drafter holds ~0.2 GiB of its own (forked; ~0.3 GiB exec'd: resources.FORKED_PROCESS_HOST_BYTES):
    many CPU processes were spawned against a host whose memory the items alone fit, and an OOM kill named a target."""
    raw = base_config()
    for section, table in patch.items():
        raw[section].update(table)
    cfg = config_from_dict(raw, "many.toml")
    hf, ids, shape = tiny_shapes(cfg)
    needs = resources.estimate(cfg, hf, ids, shape, "cpu-shm")
    items = sum(n.nbytes for n in needs if n.place in (resources.HOST, resources.SHM) and "processes' own memory" not in n.what)
    available = resources.Available(host=available_gib << 30, shm=1 << 40)
    assert items < available.host, "the items alone fit: only the processes' own memory tells"
    with pytest.raises(ConfigError) as ei:
        check_memory(cfg, hf, ids, shape, available)
    msg = str(ei.value)
    assert msg.startswith(f"many.toml: {key}: the run needs at least ") and "processes' own memory (interpreter, torch: " in msg, msg
    check_memory(config_from_dict(base_config(), "tiny.toml"), hf, ids, shape, resources.Available(host=2 << 30, shm=1 << 40))


@pytest.mark.slow
def test_up_in_a_small_dev_shm_is_refused_before_spawn(tmp_path):
    """The trial: 8 MiB /dev/shm died of SIGBUS after 105 s. Now `up` exits 2 naming /dev/shm, nothing spawned."""
    path = write_toml(tmp_path / "tiny.toml", base_config())
    cfg = config_from_dict(base_config(), str(path))
    hf, ids, shape = tiny_shapes(cfg)
    rings = sum(n.nbytes for n in resources.estimate(cfg, hf, ids, shape, "cpu-shm") if n.place == resources.SHM)
    assert rings + resources.SHM_MARGIN_BYTES > 8 << 20  # the embedded default's rings do not fit an 8 MiB /dev/shm
    run_dir = tmp_path / "run"
    proc = in_small_shm(sys.executable, "-m", "dflash_ipc.cli", "up", "--config", str(path), "--run-dir", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    need = f"the rings need {rings / 2**20:.1f} MiB of shared memory in /dev/shm"
    assert proc.stderr.startswith(f"error: {path}: transport.ring_slots: {need}"), proc.stderr
    assert "but /dev/shm has 8.0 MiB free" in proc.stderr and "Traceback" not in proc.stderr
    assert not run_dir.exists()  # refused by the probe, before the run directory (and any child) exists


@pytest.mark.slow
def test_segment_pages_reserved_at_creation(tmp_path):
    """Two producers sized against the same free space: the second's pages cannot be reserved.
    posix_fallocate makes that a SharedMemoryFullError at creation (segment removed), where a
    sparse segment (the old way, shown first) killed its writer with SIGBUS mid-run."""
    script = textwrap.dedent(
        """
        import mmap, os, signal, subprocess, sys
        # the old way: a sparse segment larger than /dev/shm, written page by page
        child = subprocess.run([sys.executable, "-c", '''
        import mmap, os
        fd = os.open("/dev/shm/sparse", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 16 << 20)
        m = mmap.mmap(fd, 16 << 20)
        for off in range(0, 16 << 20, 4096):
            m[off] = 1
        '''])
        os.unlink("/dev/shm/sparse")
        print("SPARSE", child.returncode)
        import dflash_ipc.transport.shm as shm
        shm.shm_free_bytes = lambda: 1 << 40  # the up-front check passed for both producers
        try:
            shm.create_shm_tensor("dflash-ipc-test-target0", 16 << 20)
            print("CREATED")
        except shm.SharedMemoryFullError as e:
            print("REFUSED", e)
        print("LEFT", sorted(os.listdir("/dev/shm")))
        """
    )
    proc = in_small_shm(sys.executable, "-c", script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert int(lines["SPARSE"]) == -signal.SIGBUS, proc.stdout  # what every run risked before
    assert "shared-memory exhaustion" in liveness.describe_exit(int(lines["SPARSE"]))
    assert lines["REFUSED"].startswith("shared memory full (reserving /dev/shm/dflash-ipc-test-target0: /dev/shm, need 16777216 bytes"), (
        proc.stdout
    )
    assert lines["LEFT"] == "[]"


def test_sigbus_exit_is_named_as_shared_memory_exhaustion():
    """A child that still dies of SIGBUS: the supervisor's text says shared memory and /dev/shm."""
    proc = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGBUS)"], timeout=60)
    assert proc.returncode == -signal.SIGBUS
    text = liveness.describe_exit(proc.returncode)
    assert text.startswith("killed by signal SIGBUS: shared-memory exhaustion") and "/dev/shm" in text
    hint = liveness.shm_exhaustion_hint(proc.returncode)
    assert "/dev/shm has" in hint and "--shm-size" in hint
    assert liveness.shm_exhaustion_hint(-signal.SIGKILL) == "" and liveness.describe_exit(-signal.SIGKILL) == "killed by signal SIGKILL"
