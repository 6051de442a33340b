"""The GPU check: CUDA's own peak memory of real WRN-28-2 steps against the accountant, in one command.

    PYTHONPATH=. python3 -m lowmem.studies.gpu_check --out DIR [--data data/raw/fashion-mnist-idx] [--budget-s 270]
    PYTHONPATH=. python3 -m lowmem.studies.gpu_check --out DIR --dry      # the same code paths on the CPU, in seconds

It needs only a stock PyTorch, numpy, pandas, matplotlib and PyYAML (no fairseq, torchvision, DVC or tqdm), since
the machine it is for has nothing else. It works in this order, writing its files after every result, so that a
timeout still leaves what was done:

1. Memory. WRN-28-2 at B = 128 (params.yaml's ``memory_profile`` block), one real step on CUDA for the baseline
   and each lever that runs there: every precision mode, microbatches of 8 and 1, every checkpoint strategy of
   ``checkpointing.strategies``, sparsity 0.9, and the combinations of the combination study's files: the
   headline's configuration, the strongest trained level, the grid's largest accounted reduction, and every WRN
   row of the committed headline (``figures/00_headline_full.csv``) and budget table (``figures/09_wrn_budgets.csv``).
   Each gets ``torch.cuda.max_memory_allocated`` against the accountant's peak on the meta device, and against the
   accountant plus a CUDA workspace model: each op's scratch memory measured once per call signature, the way
   ``lowmem.memory.measure.CPUWorkspace`` does for the CPU.
2. DynamicConv: not run. lowmem's DynamicConv is fairseq's ``LightConvModel`` with the plugin's layers swapped in
   (``lowmem/dynamicconv/plugin.py``); without fairseq there is no such model to build, and a look-alike built here
   would check the look-alike, not the study's model. The output says so.
3. Training, with the time left: WRN-28-2 at full size on Fashion-MNIST (the four idx files, gzipped or not, in
   ``--data``; 28x28 zero-padded to 32x32 and normalized as ``lowmem.wrn.data`` does, no augmentation), the recipe's
   SGD at B = 128, in fp32, mixed-fp16 and half-fp16 one after the other: test accuracy per epoch and images/s.

The memory part (what is checked, and one configuration's real step against the accountant) is
``lowmem.studies.gpu_memory``; this module is the command: it runs that, trains, and writes the files.

Files written to ``--out`` (no subfolders): gpu_check.json (everything), gpu_check_memory.{csv,md,png},
gpu_check_training.{csv,md} and gpu_check.log.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lowmem.memory.measure import CPUWorkspace
from lowmem.studies.gpu_memory import ROOT, Check, CUDAWorkspace, _Real, configurations, load_check, memory_row
from lowmem.techniques import precision
from lowmem.techniques.step import Techniques, train_step
from lowmem.wrn.recipe import make_optimizer
from lowmem.wrn.step import wrn_model

FASHION = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
TRAINED_MODES = ("fp32", "mixed-fp16", "half-fp16")


# --- training -------------------------------------------------------------------------------------------------


def _idx(folder: Path, name: str) -> np.ndarray:
    path = folder / name if (folder / name).exists() else folder / f"{name}.gz"
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_mnist(folder: Path, device: torch.device, limit: int = 0) -> tuple[torch.Tensor, ...]:
    """(train x, train y, test x, test y) on ``device``: torchvision's ToTensor, 2 pixels of zero padding, then the
    training split's mean and std, as ``lowmem.wrn.data`` loads Fashion-MNIST (torchvision is not on the GPU machine).
    Reading idx files is a few lines, hence by hand."""
    missing = [n for n in FASHION if not (folder / n).exists() and not (folder / f"{n}.gz").exists()]
    if missing:
        raise FileNotFoundError(f"Fashion-MNIST is not in {folder} (missing {', '.join(missing)}): copy Debian's "
                                f"/usr/share/datasets/fashion-mnist/*.gz there and carry that folder (docs/gpu-check.md)")
    xtr, ytr, xte, yte = (_idx(folder, n) for n in FASHION)
    if limit:
        xtr, ytr, xte, yte = xtr[:limit], ytr[:limit], xte[:limit], yte[:limit]
    mean, std = float(xtr.mean() / 255), float((xtr / 255).std())

    def prep(a: np.ndarray) -> torch.Tensor:
        t = F.pad(torch.from_numpy(a.astype(np.float32) / 255).unsqueeze(1), (2, 2, 2, 2))
        return ((t - mean) / std).to(device)

    return prep(xtr), torch.from_numpy(ytr.astype(np.int64)).to(device), prep(xte), torch.from_numpy(yte.astype(np.int64)).to(device)


@torch.no_grad()
def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, prec: precision.Precision, batch: int) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        with precision.autocast(prec, x.device.type):
            correct += int((model(precision.cast_batch(x[i:i + batch], prec)).float().argmax(1) == y[i:i + batch]).sum())
    model.train()
    return correct / len(x)


def train_mode(c: Check, mode: str, data: tuple[torch.Tensor, ...], seconds: float, log: Any) -> list[dict[str, Any]]:
    """Trains WRN (``c.shape``) in ``mode`` for as many epochs as fit in ``seconds`` (timed on 20 steps first, so
    that the recipe's schedule spans the whole run): one row per epoch."""
    xtr, ytr, xte, yte = data
    s, B = c.shape, c.shape.batch_size
    tech, prec = Techniques(precision=mode), precision.parse(mode)
    torch.manual_seed(0)
    model = wrn_model(s.model, 10, 1, tech, c.device, 0, (B, 1, 32, 32))
    opt = make_optimizer(model)
    scaler = precision.make_scaler(prec, c.device.type)
    steps = -(-len(xtr) // B)

    def sync() -> None:
        if c.device.type == "cuda":
            torch.cuda.synchronize()

    probe = min(20, steps)
    sync()
    t0 = time.perf_counter()
    for i in range(probe):
        train_step(model, opt, precision.cast_batch(xtr[i * B:(i + 1) * B], prec), ytr[i * B:(i + 1) * B], tech, scaler=scaler)
    sync()
    per_step = (time.perf_counter() - t0) / probe
    epochs = max(1, math.floor(seconds / (per_step * steps * 1.1)))  # 10% for the evaluations
    torch.manual_seed(0)  # start over, on the schedule for `epochs`
    model = wrn_model(s.model, 10, 1, tech, c.device, 0, (B, 1, 32, 32))
    opt = make_optimizer(model)
    scaler = precision.make_scaler(prec, c.device.type)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, sorted({max(1, round(f * epochs * steps)) for f in (0.3, 0.6, 0.8)}), 0.2)
    rows = []
    for epoch in range(epochs):
        order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(epoch)).to(c.device)
        sync()
        t0 = time.perf_counter()
        for i in range(steps):
            idx = order[i * B:(i + 1) * B]
            train_step(model, opt, precision.cast_batch(xtr[idx], prec), ytr[idx], tech, scaler=scaler)
            sched.step()
        sync()
        secs = time.perf_counter() - t0
        rows.append({"mode": mode, "epoch": epoch + 1, "epochs_planned": epochs, "test_acc": _accuracy(model, xte, yte, prec, 1000),
                     "images_per_s": len(xtr) / secs})
        log(f"train {mode} epoch {epoch + 1}/{epochs}: test accuracy {rows[-1]['test_acc']:.4f}, {rows[-1]['images_per_s']:.0f} images/s")
    return rows


# --- output ---------------------------------------------------------------------------------------------------


def _markdown(rows: list[dict[str, Any]], caption: str) -> str:
    """A Markdown table; written by hand because pandas needs tabulate for it, which the GPU machine lacks."""
    if not rows:
        return f"{caption}\n\n(no rows)\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in cols) + " |" for r in rows]
    return f"{caption}\n\n" + "\n".join(lines) + "\n"


def _csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        if rows:
            # A failed configuration's row has only its name and error: the header is every row's keys, in order.
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)


def figure(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["configuration"] for r in rows]
    ys = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.6))
    h = 0.27
    ax.barh(ys - h, [r["measured_mib"] for r in rows], h, label=f"measured: {rows[0]['method']}")
    ax.barh(ys, [r["accounted_mib"] for r in rows], h, label="accounted (meta device)")
    ax.barh(ys + h, [r["accounted_full_mib"] for r in rows], h, label="accounted + workspace model + library-held memory")
    top = max(max(r["measured_mib"], r["accounted_full_mib"], r["accounted_mib"]) for r in rows)
    for y, r in zip(ys, rows):
        ax.text(top * 1.02, y, f"{r['gap_pct']:+.1f}% / {r['gap_full_pct']:+.1f}%", va="center", fontsize=8)
    ax.set(yticks=ys, yticklabels=names, xlim=(0, top * 1.3), title=title,
           xlabel="MiB at the step's peak. Right of the bars: the accountant's gap to the measured peak, alone / full model")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6 / (0.42 * len(rows) + 1.6)), fontsize=8, ncol=3, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def reductions(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each configuration's reduction of the baseline's peak: as measured, as the accountant alone has it, and as the
    full model has it (a configuration that failed has none)."""
    ok = [r for r in rows if "error" not in r]
    base = next((r for r in ok if r["role"] == "baseline"), None)
    if base is None:
        return []
    return [{"configuration": r["configuration"], "measured_mib": r["measured_mib"],
             "reduction_measured": base["measured_mib"] / r["measured_mib"],
             "reduction_accounted": base["accounted_mib"] / r["accounted_mib"],
             "reduction_full_model": base["accounted_full_mib"] / r["accounted_full_mib"],
             "library_share_of_measured_pct": 100 * (r["persistent_library_mib"] or 0.0) / r["measured_mib"]} for r in ok]


def write_files(result: dict[str, Any], out: Path) -> None:
    """Every file of the check from its result alone, so that ``--redraw`` can remake them from a committed JSON."""
    where, dry = result["device"], result["dry"]
    caption = (f"{result['model']} at batch {result['batch_size']}, one SGD step of the recipe per configuration, on {where} "
               f"(torch {result['torch']}), {result['when']}{'; DRY RUN (tiny model on the CPU, fp16 as bf16): not a GPU result' if dry else ''}. "
               f"Accounted: lowmem's accountant on the meta device, tensors as PyTorch stores them; + workspace: each op's "
               f"scratch memory measured once per call signature; full: + workspace + the memory the libraries hold between steps "
               f"(persistent_library: allocated after the step beyond its parameters, gradients, buffers, optimizer state and batch; "
               f"cuBLAS's workspace). Gap = (accounted - measured) / measured. MiB = 2^20 bytes." + (f" {result['runs']}" if "runs" in result else ""))
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    _csv(result["memory"], out / "gpu_check_memory.csv")
    # The reductions go into the same file: the device tool brings back at most 8.
    reduction_caption = ("Reductions of the baseline's peak, each as baseline / configuration: measured, by the accountant "
                         "alone, and by the full model; and the share of the measured peak that the libraries hold between steps.")
    (out / "gpu_check_memory.md").write_text(_markdown(result["memory"], caption) + "\n" + _markdown(reductions(result["memory"]), reduction_caption))
    _csv(result["training"], out / "gpu_check_training.csv")
    (out / "gpu_check_training.md").write_text(_markdown(result["training"], f"WRN training on Fashion-MNIST, {where}. {result['training_note']}"))
    rows = [r for r in result["memory"] if "error" not in r]
    if rows:
        figure(rows, out / "gpu_check_memory.png", f"Accounted against measured: {result['model']}, batch {result['batch_size']}, {where}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the files (created; no subfolders)")
    ap.add_argument("--data", type=Path, default=ROOT / "data/raw/fashion-mnist-idx", help="Fashion-MNIST's four idx files (.gz or not)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="wall time for all three parts; training takes what memory leaves")
    ap.add_argument("--dry", action="store_true", help="tiny, on the CPU: the same code paths in seconds (the test suite runs this)")
    ap.add_argument("--redraw", type=Path, metavar="JSON", help="remake the tables and the figure from a check's gpu_check.json into --out (no GPU)")
    args = ap.parse_args(argv)
    if args.redraw:
        args.out.mkdir(parents=True, exist_ok=True)
        write_files(json.loads(args.redraw.read_text()), args.out)
        return 0
    start = time.monotonic()
    c = load_check(args.dry)
    args.out.mkdir(parents=True, exist_ok=True)
    logf = (args.out / "gpu_check.log").open("w")

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - start:6.1f} s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    where = torch.cuda.get_device_name(c.device) if c.device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    result: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": where, "torch": torch.__version__,
        "python": platform.python_version(), "dry": c.dry, "model": c.shape.model, "batch_size": c.shape.batch_size,
        "memory": [], "dynamicconv": "not run: lowmem's DynamicConv is fairseq's LightConvModel with the plugin's layers "
        "(lowmem/dynamicconv/plugin.py), and this machine has no fairseq; a look-alike stack would not be the study's model",
        "training": [], "training_note": "", "budget_s": args.budget_s,
    }
    def write() -> None:
        result["elapsed_s"] = round(time.monotonic() - start, 1)
        write_files(result, args.out)

    log(f"GPU check on {where}, torch {torch.__version__}, budget {args.budget_s:.0f} s{' (dry)' if c.dry else ''}")
    workspace = _Real(CUDAWorkspace() if c.device.type == "cuda" else CPUWorkspace())
    for name, role, tech in configurations(c):
        try:
            row = memory_row(c, name, role, tech, workspace)
        except Exception as e:  # one failing configuration must not cost the others
            log(f"memory {name}: FAILED {type(e).__name__}: {e}")
            result["memory"].append({"configuration": name, "role": role, "error": f"{type(e).__name__}: {e}"})
            write()
            continue
        result["memory"].append(row)
        log(f"memory {name}: measured {row['measured_mib']:.1f} MiB, accounted {row['accounted_mib']:.1f} ({row['gap_pct']:+.2f}%), "
            f"with workspace {row['accounted_with_workspace_mib']:.1f} ({row['gap_with_workspace_pct']:+.2f}%), "
            f"full {row['accounted_full_mib']:.1f} ({row['gap_full_pct']:+.2f}%)")
        write()  # the figure too, after every configuration, so that a timeout still leaves it
        if c.device.type == "cuda":
            torch.cuda.empty_cache()
    log(result["dynamicconv"])

    left = args.budget_s - (time.monotonic() - start) - 15
    try:
        data = fashion_mnist(args.data, c.device, limit=32 if c.dry else 0)
    except FileNotFoundError as e:
        result["training_note"] = f"not run: {e}"
        log(result["training_note"])
        write()
        return 0
    modes = [c.mode(m) for m in TRAINED_MODES]
    if left < 10 * len(modes) and not c.dry:
        result["training_note"] = f"not run: {left:.0f} s of the budget were left"
    else:
        for i, mode in enumerate(modes):
            share = (args.budget_s - (time.monotonic() - start) - 15) / (len(modes) - i)
            result["training"] += train_mode(c, mode, data, share if not c.dry else 0.0, log)
            write()
        result["training_note"] = ("Fashion-MNIST (60k train / 10k test), 28x28 zero-padded to 32x32, no augmentation; "
                                   "the recipe's SGD at batch " f"{c.shape.batch_size}, epochs as fit in the budget, seed 0."
                                   + (" DRY RUN: 32 images, the tiny model, fp16 as bf16." if c.dry else ""))
    write()
    log(f"done in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
