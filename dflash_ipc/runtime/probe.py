"""What ``up`` needs torch and transformers for, in a short-lived process of its own.

The supervisor never imports torch or transformers (with them its host memory is ~1.5 GB on a
CUDA host, without them ~50 MB). What needs them runs once per ``Supervisor.prepare``, in
``python -m dflash_ipc.runtime.probe``: the checks of :func:`preflight.check_machine` (the CUDA
devices visible here, the target's Hugging Face config, the tokenizer against its vocabulary,
the drafter against the target), then tokenizing the corpus into the run's data cache (the
targets load it from there) and planning the epochs. The probe prints one JSON line, a
:class:`ProbeResult`, and exits::

    supervisor ── resolved config (a private temp file), run dir, shards ──▶ probe
    probe: check_machine ─ refused ─▶ ProbeResult(error=ProbeError(kind, message, file, key))
             │                         supervisor: the same ConfigError / ValueError / OSError
             │                         as in-process (``up`` exits 2); nothing was created
             └─ passed ─▶ run dir + data/ (0700) ─▶ tokenize ─▶ plan ─▶ ProbeResult(plan=DataPlan)
    crashed, or no answer within ``timeout_s`` ─▶ ProbeFailed: what happened + its stderr tail

A process that has already imported torch (a test, a program embedding the supervisor) runs the
same :func:`check_and_plan` in-process: there is no memory to save there, and importing torch
again in a subprocess would only cost seconds of CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from dflash_ipc.config import ConfigError, DFlashConfig, read_resolved_config, write_resolved_config
from dflash_ipc.control.protocol import ProtocolError, Struct, from_wire, to_wire
from dflash_ipc.platform.third_party_logs import quiet_import_notes
from dflash_ipc.rundir.fsutil import NotPrivate, make_private_dir
from dflash_ipc.runtime import liveness, stop_signals
from dflash_ipc.runtime.family_check import describe_target
from dflash_ipc.runtime.forkserver import ForkServer
from dflash_ipc.runtime.launch import child_env
from dflash_ipc.runtime.preflight import check_machine, torch_loaded

# Tokenizing a large corpus takes minutes; a probe stuck (in CUDA initialisation, say) is still ended.
PROBE_TIMEOUT_S = 3600.0
ERROR_KINDS = ("config", "value", "os")


@dataclass(frozen=True)
class ProbeError(Struct):
    """A refusal: ``kind`` "config" (``file`` and ``key`` set when the check named them), "value"
    (bad data or tokenizer) or "os"; ``message`` is what to change."""

    kind: str
    message: str
    file: str | None = None
    key: str | None = None

    def __post_init__(self):
        if self.kind not in ERROR_KINDS:
            raise ValueError(f"kind must be one of {ERROR_KINDS} (got {self.kind!r})")

    @classmethod
    def of(cls, e: ConfigError | ValueError | OSError) -> ProbeError:
        if isinstance(e, ConfigError):
            if e.key is not None:
                return cls("config", e.detail or "", e.source, e.key)
            return cls("config", str(e))
        return cls("value" if isinstance(e, ValueError) else "os", str(e))

    def exception(self) -> ConfigError | ValueError | OSError:
        """The error the same check raises in-process (same type, same text)."""
        if self.kind == "config" and self.file is not None and self.key is not None:
            return ConfigError.at(self.file, self.key, self.message)
        if self.kind == "config":
            return ConfigError(self.message)
        return ValueError(self.message) if self.kind == "value" else OSError(self.message)


@dataclass(frozen=True)
class DataPlan(Struct):
    """The corpus as tokenized (``summary``: its report) and the batches of every target shard over all epochs."""

    n_batches_total: int
    n_batches_per_shard: list[int]
    samples: int
    summary: str
    seconds: float
    fingerprint: dict | None = None  # data/fingerprint.py: which batches the plan's ids are
    target: str = ""  # runtime.family_check.describe_target: what the target will run

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"n_batches_total", "samples", "seconds"})

    def plan_json(self) -> dict:
        """``plan.json`` of the run directory."""
        return {
            "n_batches_total": self.n_batches_total,
            "n_batches_per_shard": self.n_batches_per_shard,
            "samples": self.samples,
            "data_fingerprint": self.fingerprint,
        }


@dataclass(frozen=True)
class ProbeResult(Struct):
    """The probe's one line: a plan (None when only checks were asked for), or the refusal."""

    plan: DataPlan | None = None
    error: ProbeError | None = None

    def __post_init__(self):
        if self.plan is not None and self.error is not None:
            raise ValueError("a probe result holds a plan or an error, not both")


class ProbeFailed(RuntimeError):
    """The probe process crashed, or gave no answer in time: not a refusal of the config."""


# --------------------------------------------------------------------------- the work (either process)


def check_and_plan(cfg: DFlashConfig, run_dir: Path | None, n_shards: int) -> DataPlan | None:
    """The checks; then, given a run dir, make it and its data/ private and plan the data into it."""
    check_machine(cfg)
    if run_dir is None:
        return None
    make_private_dir(run_dir)
    make_private_dir(run_dir / "data", root=run_dir)
    return dataclasses.replace(plan_data(cfg, run_dir, n_shards), target=describe_target(cfg))


def plan_data(cfg: DFlashConfig, run_dir: Path, n_shards: int) -> DataPlan:
    from dflash_ipc.data.corpus import load_corpus
    from dflash_ipc.data.fingerprint import file_entries, make_fingerprint, plan_digest, tokens_digest
    from dflash_ipc.data.mix import mix_line, mix_report
    from dflash_ipc.data.plan import plan_epoch
    from dflash_ipc.data.tokenizer import check_target_tokenizer, config_tokenizer

    t0 = time.perf_counter()
    tok = config_tokenizer(cfg)  # the corpus exactly as the targets render it
    check_target_tokenizer(cfg.target, tok)
    data_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else run_dir / "data"
    try:
        corpus = load_corpus(cfg.data, tok, data_dir)
    except NotPrivate as e:  # a cache another user could have written: refused by the key that names it
        if not cfg.data.cache_dir:
            raise
        raise ConfigError.at(cfg.source, "data.cache_dir", str(e)) from None
    per_shard = [0] * n_shards
    planned: list[tuple[list[int], tuple[int, ...]]] = []
    for e in range(cfg.data.num_epochs):
        for s in range(n_shards):
            batches = plan_epoch(corpus.lengths, cfg.data, cfg.run.seed, e, n_shards, s, corpus.sources)
            per_shard[s] += len(batches)
            planned += [(b.id.to_wire(), b.sample_indices) for b in batches]
    fingerprint = make_fingerprint(
        file_entries(cfg.data.paths, cfg.data.builtin_samples, corpus.report.source_digests),
        corpus.num_samples,
        int(corpus.tokens.numel()),
        tokens_digest(corpus.tokens, corpus.loss_mask, corpus.offsets),
        per_shard,
        plan_digest(planned),
    )
    summary = corpus.report.summary()
    if cfg.drafter.draft_vocab_size:
        from dflash_ipc.data.draft_vocab import ensure_draft_vocab
        from dflash_ipc.target_spec.hf_config import target_vocab_size

        vocab_size = target_vocab_size(cfg.target, len(tok))
        summary += "; " + ensure_draft_vocab(run_dir, corpus.tokens, corpus.loss_mask, vocab_size, cfg.drafter.draft_vocab_size).describe()
    if cfg.data.weights:
        summary += "; " + mix_line(
            mix_report(corpus.lengths, corpus.sources, cfg.data.paths, cfg.data.weights, cfg.run.seed, cfg.data.num_epochs)
        )
    return DataPlan(sum(per_shard), per_shard, corpus.num_samples, summary, time.perf_counter() - t0, fingerprint)


# --------------------------------------------------------------------------- the supervisor's side


def run_probe(
    cfg: DFlashConfig,
    run_dir: Path | None = None,
    n_shards: int = 0,
    *,
    isolate: bool | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
    launcher: ForkServer | None = None,
) -> DataPlan | None:
    """:func:`check_and_plan`, in a probe process unless this one has imported torch (``isolate``
    None) or ``isolate`` says; the probe is forked from ``launcher`` when given (run.launcher), else
    a new Python. A refusal raises what the check raises in-process."""
    if isolate is None:
        isolate = not torch_loaded()
    if not isolate:
        return check_and_plan(cfg, run_dir, n_shards)
    with tempfile.TemporaryDirectory(prefix="dflash-ipc-probe-") as tmp:  # 0700
        argv = [sys.executable, "-m", "dflash_ipc.runtime.probe", "--config", str(write_resolved_config(cfg, Path(tmp)))]
        if run_dir is not None:
            argv += ["--run-dir", str(run_dir), "--shards", str(n_shards)]
        result = run_isolated(argv, timeout_s, launcher)
    if result.error is not None:
        raise result.error.exception()
    return result.plan


def run_isolated(argv: list[str], timeout_s: float, launcher: ForkServer | None = None) -> ProbeResult:
    """Run one probe process; its last stdout line is the answer. Its stderr (log lines: tokenizing a
    large corpus takes minutes) is passed on as it comes, and its tail kept for a failure's message."""
    what = f"the config probe (python -m dflash_ipc.runtime.probe, {timeout_s:g} s limit)"
    tail: deque[str] = deque(maxlen=20)
    answer: list[str] = []
    with contextlib.ExitStack() as pipes:
        proc, stdout, stderr = _start_probe(argv, launcher, pipes)
        readers = [
            threading.Thread(target=_relay, args=(stderr, tail), name="probe-stderr", daemon=True),
            threading.Thread(target=lambda: answer.extend(stdout), name="probe-stdout", daemon=True),
        ]
        for r in readers:
            r.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
        for r in readers:  # both pipes reach EOF once the process is gone
            r.join(timeout=5)
        if timed_out:
            raise ProbeFailed(f"{what} gave no answer within {timeout_s:g} s and was killed{_tail(tail)}")
    lines = "".join(answer).strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ProbeFailed(f"{what} ended ({liveness.describe_exit(proc.returncode)}) without an answer{_tail(tail)}")
    try:
        return from_wire(ProbeResult, json.loads(lines[-1]))
    except (ValueError, ProtocolError) as e:
        raise ProbeFailed(f"{what} answered {lines[-1]!r:.200} ({e}){_tail(tail)}") from None


def _start_probe(argv: list[str], launcher: ForkServer | None, pipes: contextlib.ExitStack):
    """The probe process and its stdout and stderr as text streams (closed with ``pipes``). It gets the
    environment every child of ``up`` gets (:func:`~dflash_ipc.runtime.launch.child_env`), not this process's:
    a fork server's preload read that one, and a caller's own (a shell without PYTHONUNBUFFERED) would differ."""
    env = child_env()
    if launcher is None:
        proc = pipes.enter_context(
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
        )
        return proc, proc.stdout, proc.stderr
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    stdout = pipes.enter_context(open(out_r, closefd=True))  # noqa: SIM115 (closed with the ExitStack)
    stderr = pipes.enter_context(open(err_r, closefd=True))  # noqa: SIM115
    try:
        return launcher.popen(argv, env=env, stdout=out_w, stderr=err_w), stdout, stderr  # its stdin: the server's, /dev/null
    finally:
        os.close(out_w)
        os.close(err_w)


def _relay(stream, tail: deque[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        tail.append(line.rstrip("\n"))


def _tail(lines: deque[str]) -> str:
    return "; last lines of its stderr:\n" + "\n".join(f"    {x}" for x in lines) if lines else "; it wrote nothing to stderr"


# --------------------------------------------------------------------------- the probe process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_ipc.runtime.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, type=Path, help="a resolved config (config.json as write_resolved_config writes it)")
    parser.add_argument("--run-dir", type=Path, default=None, help="plan the data into this run directory (default: only check)")
    parser.add_argument("--shards", type=int, default=0, help="target shards of the whole run (every target of every node)")
    stop_signals.end_at_once()  # the supervisor had the signal too, and reports the stop
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # as `dflash-ipc up` logs
    quiet_import_notes()
    # The corpus's summary line: `up` prints it once, as "[up] data: ..." from the plan this returns (its warnings still show).
    logging.getLogger("dflash_ipc.data.corpus").setLevel(logging.WARNING)
    cfg = read_resolved_config(args.config)
    try:
        result = ProbeResult(plan=check_and_plan(cfg, args.run_dir, args.shards))
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        result = ProbeResult(error=ProbeError.of(e))
    print(json.dumps(to_wire(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
