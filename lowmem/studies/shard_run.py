"""Sharded training run for real: one worker per device, started by ``torchrun``, on the gloo backend (the CPU's).

    torchrun --nproc-per-node 2 -m lowmem.studies.shard_run --model wrn:wrn-28-2 --batch 16 --input 3x32x32 --out DIR

Each rank, for each sharding mode (``lowmem.techniques.sharding.MODES``): builds the model from the same seed,
wraps it (DDP, DDP + ZeroRedundancyOptimizer, FSDP2), takes its share of one global batch and trains ``--steps``
steps. It writes ``DIR/rank<R>.json`` with, per mode:

- ``measured_peak_bytes``: the step's peak as the CPU allocator saw it (``torch.profiler``'s allocation events, as
  ``lowmem.memory.measure``), counting every tensor allocated since the model was built: weights, shards, DDP's
  buckets, optimizer state, batch. Every step after the first is measured; this is the lowest of them (the steady
  state), ``measured_peak_max_bytes`` the highest (a late release can add to one step). ``measured_collective_bytes``:
  the part of the peak allocated inside a collective (``c10d::*``, by the profiler's event tree) or flattened for one
  (DDP's broadcast of the weights at construction): gloo's copies, which live until gloo is done with them. ``lowmem.studies.sharding`` sets these beside the account;
- ``step_seconds``: the median wall time of the steps after the first, between barriers (on this machine's
  localhost: all ranks share its cores, so this is communication and wrapping overhead there, not an interconnect's);
- ``max_abs_diff``: the largest difference of any parameter from one process stepping on the
  whole global batch, split into the ranks' shares as microbatches (``lowmem.techniques.microbatch``). BatchNorm
  normalizes per rank, as per microbatch (SyncBatchNorm refuses CPU tensors), so the two compute the same step up
  to the order of the gradient sums: rounding. ``max_abs_step``: how far that reference moved any parameter, the
  scale the difference is read against.

``launch`` starts it with ``torchrun`` (``python -m torch.distributed.run``) after checking what would fail later
(``check``). A rank that fails makes torchrun stop the others; a collective that waits longer than ``TIMEOUT``
fails on its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from lowmem.cli import models
from lowmem.cli.profile import Request, make_optimizer
from lowmem.memory.accounting import account_step
from lowmem.memory.measure import CPUWorkspace, GlooWorkspace, workspaces
from lowmem.techniques import sharding
from lowmem.techniques.step import Techniques, train_step

TIMEOUT = timedelta(seconds=60)  # a collective waiting this long for a dead rank raises instead of hanging
MARK = "lowmem_measured_step"


def check(req: Request, modes: list[str]) -> None:
    """Raises ValueError on what would fail once processes run: the backend, the modes, the batch split."""
    if not dist.is_available() or not dist.is_gloo_available():
        raise ValueError("this PyTorch has no gloo backend (torch.distributed.is_gloo_available() is False); "
                         "a CPU run of several processes needs it")
    if req.spec.kind == "fairseq":
        raise ValueError("the gloo run trains models of lowmem profile's own step; a fairseq model is accounted "
                         "per device only (lowmem profile fairseq:... --devices N)")
    if req.vocab:
        raise ValueError("the gloo run takes float inputs (--input C x H x W); token-id models are accounted per "
                         "device only (lowmem profile ... --vocab V --devices N)")
    if req.devices < 2:
        raise ValueError(f"a run over devices needs at least 2, got {req.devices}")
    bad = [m for m in modes if m not in sharding.MODES]
    if not modes or bad:
        raise ValueError(f"modes {bad or modes} are not among {', '.join(sharding.MODES)}")
    for m in modes:
        sharding.check(models.build(req.spec, "meta"), sharding.Sharding(req.devices, m))


def _peak_in(prof: profile) -> list[tuple[int, int]]:
    """Per marked step: (bytes live at its highest point, of those allocated since profiling began; the part of them
    allocated inside a collective, ``c10d::*``, or flattened for one). A free of memory allocated before profiling (a previous mode's
    model, released late by a reference cycle) is left out: it would lower the count by bytes this step never held.
    Allocations are matched to their frees by address, and to the op that made them by the profiler's event tree
    (its kineto events carry neither)."""
    def walk(nodes: Any) -> Any:
        for node in nodes:
            yield node
            yield from walk(node.children)

    def in_collective(node: Any) -> bool:
        # Inside a collective (gloo's copies), or flattened for one: DDP's constructor broadcasts rank 0's weights as
        # one flat copy (torch's C++ _broadcast_coalesced), which gloo keeps alive into the steps in some runs.
        while node is not None:
            if node.name.startswith("c10d::") or node.name == "aten::flatten_dense_tensors":
                return True
            node = node.parent
        return False

    nodes = list(walk(prof.profiler.kineto_results.experimental_event_tree()))
    steps = sorted((n for n in nodes if n.name == MARK), key=lambda n: n.start_time_ns)
    allocs = sorted((n for n in nodes if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu"),
                    key=lambda n: n.start_time_ns)
    first_alloc = next((n.start_time_ns for n in allocs if n.extra_fields.alloc_size > 0), 0)
    live: dict[int, tuple[int, bool]] = {}
    early: set[int] = set()  # addresses freed (by another thread's clock) before their allocation was recorded
    running = comm = 0
    peaks = [(0, 0) for _ in steps]
    for n in allocs:
        size, ptr = n.extra_fields.alloc_size, n.extra_fields.ptr
        if size > 0:
            if ptr in early:
                # Its free, made on gloo's thread, sorts before the allocation made on this one: the two threads'
                # clocks differ by more than the block lived, so it is counted as never live.
                early.discard(ptr)
                continue
            if ptr in live:  # an address is not handed out twice while live: the earlier block's free was lost
                old, c = live.pop(ptr)
                running -= old
                comm -= old if c else 0
            live[ptr] = (size, in_collective(n))
            running += size
            comm += size if live[ptr][1] else 0
        elif ptr in live:
            size, c = live.pop(ptr)
            running -= size
            comm -= size if c else 0
        elif n.start_time_ns > first_alloc:
            early.add(ptr)
        for i, step in enumerate(steps):
            if step.start_time_ns <= n.start_time_ns <= step.end_time_ns and running > peaks[i][0]:
                peaks[i] = (running, comm)
    return peaks


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _ledger_peak(req: Request, shard: sharding.Sharding, x: torch.Tensor, y: torch.Tensor) -> int:
    """The accountant's peak of the same step, followed on this process's real tensors and real collectives (with
    the CPU's op and gloo workspaces): what separates the fake process group's account from the real op stream,
    and that from the allocator's count. The DDP modes are not wrapped when accounted, so this is for FSDP2's."""
    model = sharding.wrap(models.build(req.spec, "cpu", seed=0), shard, accounting=True)
    opt = make_optimizer(req.optimizer, model, shard, accounting=True)
    report = account_step(lambda mark: train_step(model, opt, x, y, mark=mark), model, opt, (x, y),
                          workspace=workspaces(CPUWorkspace(), GlooWorkspace()))
    return report.peak


def _train(req: Request, shard: sharding.Sharding, steps: int
           ) -> tuple[list[tuple[int, int]], list[float], Any, torch.Tensor, torch.Tensor]:
    """(``_peak_in`` of each step after the first, seconds per step, model, this rank's batch) of ``steps`` steps
    on the default process group, real or fake."""
    rank, b = dist.get_rank(), shard.per_device(req.batch)
    gc.collect()  # a previous mode's model, held by reference cycles (FSDP2 keeps some), goes before profiling
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = models.build(req.spec, "cpu", seed=0)
        x, y = models.batch(model, req.batch, req.input, req.vocab, "cpu")
        x, y = x[rank * b:(rank + 1) * b].clone(), y[rank * b:(rank + 1) * b].clone()  # only this rank's share stays
        model = sharding.wrap(model, shard)
        opt = make_optimizer(req.optimizer, model, shard)
        times = []
        for i in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            with record_function(MARK) if i > 0 else nullcontext():
                train_step(model, opt, x, y)
            dist.barrier()
            times.append(time.perf_counter() - t0)
    return _peak_in(prof), times, model, x, y


def one_process_peak(req: Request, steps: int = 4) -> int:
    """The measured peak of rank 0's step in one process, beside PyTorch's fake process group: real tensors, real
    wrappers, collectives that move nothing. It separates the account of the wrappers' step from what real
    collectives add (``lowmem.studies.sharding`` sets both beside the account)."""
    with sharding.fake_group(req.devices):
        return min(_train(req, req.sharding, steps)[0])[0]


def one_mode(req: Request, mode: str, steps: int, compare: bool) -> dict[str, Any]:
    rank, n = dist.get_rank(), dist.get_world_size()
    shard = sharding.Sharding(n, mode)
    b = shard.per_device(req.batch)
    peaks, times, model, x, y = _train(req, shard, steps)
    (peak, comm), highest = min(peaks), max(peaks)[0]
    row = {"mode": mode, "rank": rank, "devices": n, "batch": req.batch, "batch_per_device": b,
           "measured_peak_bytes": peak, "measured_collective_bytes": comm, "measured_peak_max_bytes": highest,
           "step_seconds": sorted(times[1:])[len(times[1:]) // 2]}
    if mode in sharding.FSDP_MODES:
        row["ledger_peak_bytes"] = _ledger_peak(req, shard, x, y)
    if compare:
        full = {k: _full(v).detach().clone() for k, v in model.named_parameters()}
        ref = models.build(req.spec, "cpu", seed=0)
        init = [v.detach().clone() for v in ref.parameters()]
        rx, ry = models.batch(ref, req.batch, req.input, req.vocab, "cpu")
        ropt = make_optimizer(req.optimizer, ref)
        for _ in range(steps):
            train_step(ref, ropt, rx, ry, Techniques(microbatch=b))
        diffs = [(full[k.removeprefix("module.")] - v.detach()).abs() for k, v in ref.named_parameters()
                 ] if mode in sharding.FSDP_MODES else [(full["module." + k] - v.detach()).abs() for k, v in ref.named_parameters()]
        row.update(max_abs_diff=max(d.max().item() for d in diffs),
                   max_abs_step=max((v.detach() - v0).abs().max().item() for v, v0 in zip(ref.parameters(), init)))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wrn:wrn-28-2")
    ap.add_argument("--batch", type=int, default=16, help="global batch, split over the ranks")
    ap.add_argument("--input", default="3x32x32")
    ap.add_argument("--optimizer", default="sgd-momentum")
    ap.add_argument("--modes", default=",".join(sharding.MODES))
    ap.add_argument("--steps", type=int, default=4, help="steps per mode; all but the first are measured and timed")
    ap.add_argument("--compare", action="store_true", help="also step one process on the whole batch and compare")
    ap.add_argument("--fail-rank", type=int, default=-1, help="this rank raises after joining (tests: no rank may hang)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    try:
        req = Request(args.model, args.batch, models.shape(args.input), args.optimizer, devices=dist.get_world_size())
        modes = args.modes.split(",")
        check(req, modes)
        if dist.get_rank() == args.fail_rank:
            raise RuntimeError(f"rank {args.fail_rank} fails on purpose (--fail-rank)")
        rows = [one_mode(req, m, args.steps, args.compare) for m in modes]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(rows, indent=2))
    finally:
        dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(req: Request, modes: list[str], out: Path, steps: int = 4, compare: bool = True, fail_rank: int = -1,
           timeout: float = 600) -> list[dict[str, Any]]:
    """Runs ``main`` on ``req.devices`` processes with torchrun; returns every rank's rows. Raises ValueError before
    starting anything that ``check`` refuses, and RuntimeError (with torchrun's output) if a rank fails."""
    check(req, modes)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(req.devices),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "lowmem.studies.shard_run", "--model", req.model, "--batch", str(req.batch),
           "--input", "x".join(map(str, req.input)), "--optimizer", req.optimizer, "--modes", ",".join(modes),
           "--steps", str(steps), "--out", str(out), "--fail-rank", str(fail_rank), *(["--compare"] if compare else [])]
    # One thread per rank: the ranks share this machine's cores (torchrun sets it too, with a warning).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Its own session, so that a timeout can stop torchrun and every worker it started, not torchrun alone.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"torchrun did not finish within {timeout:.0f} s; it and its workers were killed") from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if done.returncode:
        # Every rank's exception line first (the first failure is the cause; the others' are its consequences).
        errors = [line for line in done.stderr.splitlines() if re.match(r"\[rank\d+\]: \w+(Error|Exception):", line)]
        raise RuntimeError(f"torchrun exited with {done.returncode}; " + "; ".join(errors) + f"\n{done.stderr[-3000:]}")
    return [row for r in range(req.devices) for row in json.loads((out / f"rank{r}.json").read_text())]


if __name__ == "__main__":
    sys.exit(main())
