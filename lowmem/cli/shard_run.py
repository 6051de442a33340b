"""Sharded training run for real: one worker per device, started by ``torchrun``, on the gloo backend (the CPU's).

    torchrun --nproc-per-node 2 -m lowmem.cli.shard_run --model wrn:wrn-28-2 --batch 16 --input 3x32x32 --out DIR

Each rank, for each sharding mode (``lowmem.techniques.sharding.MODES``): builds the model from the same seed,
wraps it (DDP, DDP + ZeroRedundancyOptimizer, FSDP2), takes its share of one global batch and trains ``--steps``
steps. It writes ``DIR/rank<R>.json`` with, per mode:

- ``measured_peak_bytes``: the peak of the last step as the CPU allocator saw it (``torch.profiler`` memory events,
  as ``lowmem.memory.measure``), counting every tensor allocated since the model was built: weights, shards,
  DDP's buckets, optimizer state, batch. Buffers that gloo allocates itself, outside PyTorch's allocator, are not in it;
  ``lowmem.cli.shard_study`` sets it beside the accountant's per-device peak;
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
import json
import os
import re
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
    if req.devices < 2:
        raise ValueError(f"a run over devices needs at least 2, got {req.devices}")
    bad = [m for m in modes if m not in sharding.MODES]
    if not modes or bad:
        raise ValueError(f"modes {bad or modes} are not among {', '.join(sharding.MODES)}")
    for m in modes:
        sharding.check(models.build(req.spec, "meta"), sharding.Sharding(req.devices, m))


def _peak_in(prof: profile) -> int:
    """Bytes live at the highest point of the marked step: every allocator event since profiling began, summed."""
    events = prof.profiler.kineto_results.events()
    step = next(e for e in events if e.name() == MARK)
    start, end = step.start_ns(), step.start_ns() + step.duration_ns()
    running = peak = 0
    for e in sorted((e for e in events if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns()):
        running += e.nbytes()
        if start <= e.start_ns() <= end:
            peak = max(peak, running)
    return peak


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


def one_mode(req: Request, mode: str, steps: int, compare: bool) -> dict[str, Any]:
    rank, n = dist.get_rank(), dist.get_world_size()
    shard = sharding.Sharding(n, mode)
    b = shard.per_device(req.batch)
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
            with record_function(MARK) if i == steps - 1 else nullcontext():
                train_step(model, opt, x, y)
            dist.barrier()
            times.append(time.perf_counter() - t0)
    row = {"mode": mode, "rank": rank, "devices": n, "batch": req.batch, "batch_per_device": b,
           "measured_peak_bytes": _peak_in(prof), "step_seconds": sorted(times[1:])[len(times[1:]) // 2]}
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
    ap.add_argument("--steps", type=int, default=3, help="steps per mode; the last is measured, the first not timed")
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


def launch(req: Request, modes: list[str], out: Path, steps: int = 3, compare: bool = True, fail_rank: int = -1,
           timeout: float = 600) -> list[dict[str, Any]]:
    """Runs ``main`` on ``req.devices`` processes with torchrun; returns every rank's rows. Raises ValueError before
    starting anything that ``check`` refuses, and RuntimeError (with torchrun's output) if a rank fails."""
    check(req, modes)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(req.devices),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "lowmem.cli.shard_run", "--model", req.model, "--batch", str(req.batch),
           "--input", "x".join(map(str, req.input)), "--optimizer", req.optimizer, "--modes", ",".join(modes),
           "--steps", str(steps), "--out", str(out), "--fail-rank", str(fail_rank), *(["--compare"] if compare else [])]
    # One thread per rank: the ranks share this machine's cores (torchrun sets it too, with a warning).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode:
        # Every rank's exception line first (the first failure is the cause; the others' are its consequences).
        errors = [line for line in done.stderr.splitlines() if re.match(r"\[rank\d+\]: \w+(Error|Exception):", line)]
        raise RuntimeError(f"torchrun exited with {done.returncode}; " + "; ".join(errors) + f"\n{done.stderr[-3000:]}")
    return [row for r in range(req.devices) for row in json.loads((out / f"rank{r}.json").read_text())]


if __name__ == "__main__":
    sys.exit(main())
