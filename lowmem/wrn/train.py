"""Training WRN on an image dataset with the paper's recipe, and the memory techniques as one configuration.

Every accuracy in the study comes from ``train``: the baseline, each technique and each combination go through the
same loop. The recipe (paper notes): SGD with Nesterov momentum 0.9, weight decay 5e-4, lr 0.1 multiplied by 0.2 at
30%, 60% and 80% of the steps (epochs 60/120/160 of 200), so the schedule scales with the run's length.

Runs are resumable: a checkpoint is written (then renamed into place) after every epoch, and every epoch reseeds
the RNGs from (seed, epoch), so a resumed run draws the same batches and augmentations as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from lowmem import runs
from lowmem.config import resolve_device
from lowmem.techniques import precision, registry, sparsity
from lowmem.techniques.step import Techniques, train_step
from lowmem.wrn.data import load, subset
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.recipe import SGDRecipe, make_optimizer
from lowmem.wrn.step import wrn_model


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DataLoader, device: torch.device, prec: precision.Precision = precision.parse("fp32")
) -> tuple[float, float, torch.Tensor]:
    """(accuracy, mean loss, per-example correctness as a bool vector in ``loader``'s order) on ``loader``,
    computed in the precision the model trains in."""
    model.eval()
    correct, loss_sum = [], 0.0
    for x, y in loader:
        x, y = precision.cast_batch(x.to(device), prec), y.to(device)
        with precision.autocast(prec, device.type):
            out = model(x).float()
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct.append((out.argmax(1) == y).cpu())
    hits = torch.cat(correct)
    return hits.sum().item() / len(hits), loss_sum / len(hits), hits


CORRECT_FILE = "test_correct.npy"  # a finished run's per-example correctness on its test split (packed bits)


def _save_bits(path: Path, bits: np.ndarray) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: np.save would add ".npy" to the temporary name
            np.save(f, np.packbits(bits))

    runs.atomic_write(path, write)


def correct_per_example(run: runs.Run, examples: int) -> np.ndarray | None:
    """The finished ``run``'s per-example correctness on its ``examples`` test images (bool), or None if it has
    none: what paired per-example statistics (``lowmem.studies.quality.per_example``) compare."""
    path = run.dir / CORRECT_FILE
    return np.unpackbits(np.load(path), count=examples).astype(bool) if path.exists() else None


def _peak_memory_mib(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "torch.cuda.max_memory_allocated"
    # No CPU allocator counter exists; the process's peak resident set is the honest whole-process number.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process peak RSS"


# The code on a WRN run's training path, for its key. lowmem.config is left out: it only validates and holds
# defaults, and every value it resolves that changes training is in the run's fields (``run_fields``).
TRAIN_CODE = [m for m in runs.closure(__name__) if m not in ("lowmem.config", "lowmem.wrn.params")]
# Fields of BaselineParams that do not change a run: what it is called, where it runs and reads from, and the list of
# seeds it belongs to (each run has its own seed).
NOT_IN_KEY = ("profile", "seed", "seeds", "data_root", "device", "num_workers")


def run_techniques(tech: Techniques, batch_size: int) -> dict[str, Any]:
    """The techniques as they change training: a field that has no effect in this configuration is dropped, so two
    spellings of one run share a key.

    - ``sparse_format`` is counted by the accountant only;
    - the sparse method and DSR's schedule mean nothing for a dense run, and DSR's schedule nothing for a static one;
    - a microbatch of the whole batch or more is no split (one microbatch of weight 1);
    - the checkpoint strategy recomputes the same forward: tests/test_checkpoint.py proves the gradients and BN
      statistics bit-equal to the plain step in every precision and with sparse layers, so a checkpointed
      configuration is the plain run and is not trained again. Not so with compressed activations: what a
      segment recomputes is exact where the plain step's saved tensors are packed, so there it stays in the key.
    """
    t = asdict(tech)
    t.pop("sparse_format")
    if not tech.activation_bits:
        t.pop("checkpoint")
    for k, off in (("optimizer", "sgd"), ("activation_bits", 0)):  # levers beyond the paper, off: no key changes
        if t[k] == off:
            t.pop(k)
    if tech.sparsity == 0:
        for k in ("sparse_method", "dsr_periods", "dsr_reallocate"):
            t.pop(k)
    elif tech.sparse_method == "static":
        t.pop("dsr_periods")
        t.pop("dsr_reallocate")
    if tech.microbatch >= batch_size:
        t["microbatch"] = 0
    return t


def run_fields(p: BaselineParams, seed: int, tech: Techniques) -> dict[str, Any]:
    """What a WRN run's key is made of, besides its code: the resolved training fields, the seed, the techniques."""
    fields = {k: v for k, v in asdict(p).items() if k not in NOT_IN_KEY}
    return {**fields, "seed": seed, "techniques": run_techniques(tech, p.batch_size)}


def store_run(p: BaselineParams, seed: int, tech: Techniques = Techniques(), root: Path | None = None) -> runs.Run:
    # A lever added after the trainer (lowmem.techniques.registry) is on the code path of the runs that set it only.
    fields = run_fields(p, seed, tech)
    return runs.Run("wrn", fields, TRAIN_CODE + runs.closure(*registry.modules_for(fields["techniques"])), root)


def train(
    p: BaselineParams,
    seed: int,
    tech: Techniques = Techniques(),
    progress: bool = True,
    on_epoch_end: Callable[[int, dict[str, Any]], None] | None = None,
    root: Path | None = None,
) -> list[dict[str, Any]]:
    """The run's metrics, one row per epoch, from the run store (``root``, default ``lowmem.runs.store()``): a
    finished run is read, an interrupted one resumes from its last epoch's checkpoint, a new one is trained."""
    run = store_run(p, seed, tech, root)
    done = run.result()
    if done is not None:
        run.log("reused")
        return done
    # The run as its key says: checkpointing is left out of the key (bit-equal), so it trains without.
    tech = dataclasses.replace(tech, checkpoint="none")
    t_start = time.perf_counter()
    device = resolve_device(p.device)
    data = load(p.dataset, p.data_root, augment=p.augment, seed=0)
    # The subsets are fixed across seeds: seeds vary the initialization and the batch order, not the data.
    train_set, test_set = subset(data.train, p.train_subset, 0), subset(data.test, p.test_subset, 0)
    test_loader = DataLoader(test_set, batch_size=max(p.batch_size, 256), num_workers=p.num_workers)

    model = wrn_model(p.model, data.num_classes, data.in_channels, tech, device, seed, (p.batch_size, data.in_channels, 32, 32))
    layers = sparsity.sparse_layers(model)
    prec = precision.parse(tech.precision)
    optimizer = make_optimizer(model, SGDRecipe(p.lr, p.momentum, p.nesterov, p.weight_decay), tech.optimizer)
    scaler = precision.make_scaler(prec, device.type)
    # The schedule steps per iteration, so its milestones keep the recipe's fractions even for a few epochs.
    steps_per_epoch = -(-len(train_set) // p.batch_size)  # type: ignore[arg-type]
    milestones = sorted({max(1, round(f * p.epochs * steps_per_epoch)) for f in p.milestones})
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=p.gamma)
    dsr = None
    if layers and tech.sparse_method == "dsr":
        realloc = sparsity.scaled_reallocation(model, tech.dsr_reallocate)
        dsr = sparsity.DSR(layers, p.epochs * steps_per_epoch, realloc, tuple(tech.dsr_periods), seed=seed)

    run.start()
    ckpt = run.dir / "checkpoint.pt"
    history: list[dict[str, Any]] = []
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        if state["key"] == run.key:
            if layers:
                sparsity.resize_to(model, state["model"])  # DSR moved nonzeros between layers
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if scaler is not None:
                scaler.load_state_dict(state["scaler"])
            if dsr is not None:
                dsr.load_state_dict(state["dsr"])
            history = state["history"]
            run.log(f"resumed at epoch {len(history)}")

    hits = None
    for epoch in range(len(history), p.epochs):
        # Batches and augmentations depend only on (seed, epoch): the same after a resume.
        torch.manual_seed(seed * 100_003 + epoch)
        order = torch.Generator().manual_seed(seed * 100_003 + epoch)
        loader = DataLoader(train_set, batch_size=p.batch_size, shuffle=True, generator=order, num_workers=p.num_workers)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model.train()
        loss_sum, n_seen, step_times = 0.0, 0, []
        t_epoch = time.perf_counter()
        # Plain-text tqdm with a slow refresh: under papermill --log-output it streams to the terminal as log lines.
        bar = tqdm(loader, desc=f"seed {seed} epoch {epoch + 1}/{p.epochs}", disable=not progress, mininterval=10)
        for x, y in bar:
            x, y = precision.cast_batch(x.to(device), prec), y.to(device)
            t0 = time.perf_counter()
            loss = train_step(model, optimizer, x, y, tech, scaler=scaler).item()
            scheduler.step()
            if dsr is not None:
                dsr.after_step(optimizer)  # rewiring is part of DSR's step time
            step_times.append(time.perf_counter() - t0)
            loss_sum += loss * len(y)
            n_seen += len(y)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        train_seconds = time.perf_counter() - t_epoch
        lr = optimizer.param_groups[0]["lr"]
        acc, test_loss, hits = evaluate(model, test_loader, device, prec)
        peak, how = _peak_memory_mib(device)
        row = {
            "seed": seed,
            "epoch": epoch + 1,
            "data": data.source,
            "train_examples": len(train_set),  # type: ignore[arg-type]
            "test_examples": len(test_set),  # type: ignore[arg-type]
            "lr_end": lr,
            "train_loss": loss_sum / n_seen,
            "test_loss": test_loss,
            "test_acc": acc,
            "images_per_s": n_seen / train_seconds,
            "step_s": sum(step_times) / len(step_times),
            "epoch_s": time.perf_counter() - t_epoch,
            "peak_mem_mib": peak,
            "peak_mem_method": how,
            # Steps a 16-bit mode skipped for non-finite gradients, all epochs so far, and its loss scale (1 = none).
            "skipped_steps": scaler.skipped if scaler is not None else 0,
            "loss_scale": scaler.scale_value if scaler is not None else 1.0,
            # Nonzeros of the sparse layers (constant: DSR moves them, never adds any), and rewirings so far.
            "sparse_nnz": sum(layer.nnz for layer in layers.values()),
            "rewirings": dsr.rewirings if dsr is not None else 0,
        }
        history.append(row)
        if progress:
            tqdm.write(f"seed {seed} epoch {epoch + 1}/{p.epochs}: train loss {row['train_loss']:.4f}, test acc {acc:.4f}, {row['images_per_s']:.0f} img/s")
        state = {"key": run.key, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        if dsr is not None:
            state["dsr"] = dsr.state_dict()
        runs.save_torch(ckpt, {**state, "scheduler": scheduler.state_dict(), "history": history})
        if on_epoch_end is not None:
            on_epoch_end(epoch + 1, row)
    # The last epoch's per-example correctness, kept beside the result: paired statistics need it, and a vector of
    # 10k bits is too large for the result rows that tables are made from.
    if hits is None:  # resumed after its last epoch's checkpoint: evaluate those weights once more
        hits = evaluate(model, test_loader, device, prec)[2]
    _save_bits(run.dir / CORRECT_FILE, hits.numpy())
    run.finish(history, time.perf_counter() - t_start)
    ckpt.unlink()  # the result is what a finished run keeps; its weights are not needed by any stage
    return history


def summarize(final: list[dict[str, Any]]) -> dict[str, Any]:
    """Metrics of a set of finished runs (one final-epoch row per seed): accuracy as mean and spread over seeds."""
    accs = torch.tensor([r["test_acc"] for r in final], dtype=torch.float64)
    return {
        "seeds": [r["seed"] for r in final],
        "test_acc_mean": round(accs.mean().item(), 5),
        "test_acc_std": round(accs.std().item(), 5) if len(accs) > 1 else 0.0,
        "test_acc_min": round(accs.min().item(), 5),
        "test_acc_max": round(accs.max().item(), 5),
        "images_per_s": round(sum(r["images_per_s"] for r in final) / len(final), 1),
        "step_s": round(sum(r["step_s"] for r in final) / len(final), 4),
        "peak_mem_mib": round(max(r["peak_mem_mib"] for r in final), 1),
        "peak_mem_method": final[0]["peak_mem_method"],
    }
