"""The combination grid accounted at full size and, for WRN, timed at the active profile (``sweep``). WRN's accounted
rows are kept by key in ``data/combinations/wrn_memory.csv``, so that a grid that grows, or a sweep that was
stopped, accounts only what it has not.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm import tqdm

from lowmem import runs
from lowmem.config import resolve_device
from lowmem.memory.accounting import CATEGORIES, MIB
from lowmem.studies.combination_grid import (CombinationsParams, grid, mildness, name, translation_params, wrn_shape,
                                             wrn_techniques)
from lowmem.studies.combination_search import select
from lowmem.studies.quality_model import dims
from lowmem.techniques import precision
from lowmem.wrn import memory as wrn_memory
from lowmem.wrn.data import load
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.recipe import make_optimizer
from lowmem.wrn.step import wrn_model
from lowmem.wrn.train import train_step


def wrn_memory_row(p: CombinationsParams, cfg: dict[str, Any], skip_repeats: bool = True) -> dict[str, Any]:
    """The accounted peak of one full-size step (``p.wrn``: WRN-28-2 at B = 128) under ``cfg``, by category
    (``lowmem.wrn.memory``, which follows microbatches 1, 2 and the last one unless ``skip_repeats`` is off)."""
    r = wrn_memory.account(wrn_techniques(p, cfg), wrn_shape(p), p.seed, skip_repeats)
    return {f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES} | {"total_mib": r.peak / MIB, "peak_phase": r.peak_phase}


# In the sweep's folder, persisted by DVC and committed: accounting the cpu grid takes most of an hour on 2 cores,
# and a grid that grows by a lever would otherwise account every old row again (``wrn_memory_rows``).
MEMORY_CACHE = "wrn_memory.csv"


# What a cached row holds; raise it when wrn_memory_row's columns or their meaning change.
MEMORY_ROW_FORMAT = 1


def _version(lib: str) -> str | None:
    """``lib``'s installed version, or None where it is not installed (a grid that does not use it needs none)."""
    try:
        return importlib.metadata.version(lib)
    except importlib.metadata.PackageNotFoundError:
        return None


def memory_keys(p: CombinationsParams, configs: list[dict[str, Any]]) -> tuple[list[str], str]:
    """Each configuration's accounted memory key, and the accountant's digest: of its code (``lowmem.runs.code_digest``
    of lowmem.wrn.memory's closure), the versions of the libraries whose optimizers it steps, and the row's format.
    A key covers what ``wrn_memory_row`` depends on (the run's Techniques, the full-size shape, the seed) and that
    digest, as run keys are made."""
    # The libraries count too: the accountant steps torch's, bitsandbytes' and torch-optimi's optimizers to size
    # their state.
    libraries = {lib: _version(lib) for lib in ("torch", "bitsandbytes", "torch-optimi")}
    digest = runs.make_key({"code": runs.code_digest(runs.closure("lowmem.wrn.memory")), "libraries": libraries,
                            "row": MEMORY_ROW_FORMAT}, [])
    shape = dataclasses.asdict(wrn_shape(p))
    return [runs.make_key({"techniques": dataclasses.asdict(wrn_techniques(p, cfg)), "shape": shape, "seed": p.seed,
                           "accountant": digest}, []) for cfg in configs], digest


def wrn_memory_rows(p: CombinationsParams, configs: list[dict[str, Any]], progress: bool = True,
                    cache: Path | None = None, every: int = 200) -> list[dict[str, Any]]:
    """``wrn_memory_row`` of each configuration, in order, on ``p.workers`` processes. With ``cache`` (a CSV that the
    sweep persists), a configuration whose memory key (``memory_keys``) is there is read from it, and what is
    accounted is added to it every ``every`` configurations, so that an interrupted sweep resumes and a grid that
    grows accounts only its new rows. Rows another version of the accountant wrote are dropped."""
    keys, digest = memory_keys(p, configs)
    known: dict[str, dict[str, Any]] = {}
    if cache is not None and cache.exists():
        # The keys as text: a digest of digits alone would read back as a number.
        old = pd.read_csv(cache, dtype={"memory_key": str, "accountant": str})
        known = {r.pop("memory_key"): r for r in old[old.accountant == digest].drop(columns="accountant").to_dict("records")}
    todo = [i for i, k in enumerate(keys) if k not in known]
    # Accounting on the meta device is PyTorch's dispatch in Python, one core per process. Spawned, not forked: the
    # workers import torch afresh rather than inherit a notebook kernel's threads. map keeps the configurations' order.
    pool = (ProcessPoolExecutor(p.workers, mp_context=multiprocessing.get_context("spawn"))
            if p.workers > 1 and len(todo) > 1 else None)
    account = partial(wrn_memory_row, p)

    def save() -> None:
        if cache is not None and known:
            table = pd.DataFrame([{"memory_key": k, "accountant": digest, **r} for k, r in known.items()])
            runs.atomic_write(cache, lambda tmp: table.to_csv(tmp, index=False))

    try:
        with tqdm(total=len(configs), initial=len(configs) - len(todo), disable=not progress, mininterval=10,
                  desc=f"accounting wrn combinations ({p.workers} process{'es' if p.workers > 1 else ''})") as bar:
            for start in range(0, len(todo), every):
                part = todo[start:start + every]
                cfgs = [configs[i] for i in part]
                for i, row in zip(part, pool.map(account, cfgs, chunksize=4) if pool else map(account, cfgs)):
                    known[keys[i]] = row
                    bar.update()
                save()
    except BaseException:
        if pool:
            # Cancels the configurations not yet started; those running (a chunk a process at most) finish before the
            # process exits.
            pool.shutdown(wait=False, cancel_futures=True)
        save()  # the rows accounted since the last write are kept too
        raise
    if pool:
        pool.shutdown()
    return [dict(known[k]) for k in keys]


def wrn_step_times(p: CombinationsParams, configs: list[dict[str, Any]], progress: bool = True) -> list[float]:
    """Seconds per training step of each configuration at the active profile (the trained model and batch, random
    inputs, on the baseline block's device): ``timing_repeats`` rounds over all configurations in turn after a
    warm-up step each, so that drift in the machine's speed hits all alike; the median of the rounds."""
    base = BaselineParams(**p.train)
    device = resolve_device(base.device)
    data = load(base.dataset, base.data_root, augment=False, seed=0)
    steps = []
    for cfg in tqdm(configs, desc="building and warming up", disable=not progress, mininterval=10):
        tech = wrn_techniques(p, cfg, base.batch_size)
        shape = (base.batch_size, data.in_channels, 32, 32)
        model = wrn_model(base.model, data.num_classes, data.in_channels, tech, device, p.seed, shape)
        opt = make_optimizer(model, name=tech.optimizer)
        prec = precision.parse(tech.precision)
        scaler = precision.make_scaler(prec, device.type)
        x = precision.cast_batch(torch.randn(shape, device=device), prec)
        y = torch.randint(0, data.num_classes, (base.batch_size,), device=device)
        step = (lambda m=model, o=opt, t=tech, s=scaler, x=x, y=y: train_step(m, o, x, y, t, scaler=s).item())
        step()
        steps.append(step)
    times: list[list[float]] = [[] for _ in configs]
    for _ in tqdm(range(p.timing_repeats), desc="timing rounds", disable=not progress):
        for i, step in enumerate(steps):
            t0 = time.perf_counter()
            step()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def sweep(p: CombinationsParams, progress: bool = True, cache: Path | None = None) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """Every combination of the grid accounted at full size (and, for WRN, timed at the active profile), and the
    subset chosen for training: (table, selection). WRN's accounted rows come from and go to ``cache``
    (``wrn_memory_rows``)."""
    configs = grid(p)
    rows = []
    if p.task == "dynamicconv":
        from lowmem.studies import translation as translation_study  # fairseq: imported only where DynamicConv runs

        mem = translation_study.memory(translation_params(p, configs), progress, p.workers)
        by_name = mem.set_index("technique")
    else:
        memory = wrn_memory_rows(p, configs, progress, cache)
    for i, cfg in enumerate(configs):
        n = name(p, cfg)
        full = {d: cfg.get(d, getattr(p, d)[0]) for d in dims(p.task)}
        row: dict[str, Any] = {"name": n, **full, "config": json.dumps(cfg), "techniques": len(cfg), "mildness": mildness(p, cfg)}
        if p.task == "wrn":
            row |= memory[i]
        else:
            m = by_name.loc[n]
            row |= {"options": m.options, **{f"{c}_mib": m[f"{c}_mib"] for c in CATEGORIES}, "total_mib": m.total_mib,
                    "peak_phase": m.peak_phase}
        rows.append(row)
    df = pd.DataFrame(rows)
    df["reduction"] = df.total_mib.iloc[0] / df.total_mib
    if p.task == "wrn":
        secs = wrn_step_times(p, configs, progress)
        df["step_s"] = secs
        df["time_ratio"] = df.step_s / df.step_s.iloc[0]
    chosen = select(p, df)
    return df, chosen

