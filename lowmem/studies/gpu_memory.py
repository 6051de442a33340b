"""The GPU check's memory part: what it checks, and one configuration's real step against the accountant.

``configurations`` lists the baseline, the single levers and the combination study's combinations (``combinations``,
from its committed files); ``memory_row`` runs one of them for real on the check's device (``Check``) and sets
``torch.cuda.max_memory_allocated`` (or the CPU profiler's peak) beside the accountant's peak on the meta device,
alone and with a workspace model of each op's scratch memory (``CUDAWorkspace`` on CUDA,
``lowmem.memory.measure.CPUWorkspace`` on the CPU, each called through ``_Real``). The command that runs it on a lent
GPU, trains and writes the files is ``lowmem.studies.gpu_check``; ``lowmem.studies.cpu_check`` measures the
headline's rows on the CPU with the same ``memory_row``.

It runs on the GPU machine beside ``lowmem.studies.gpu_check``, so it imports no more than that does: a stock
PyTorch, numpy and PyYAML (no fairseq, torchvision, DVC, tqdm or pandas).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_leaves, tree_map

from lowmem.config import pick
from lowmem.memory.accounting import MIB, optimizer_tensors
from lowmem.memory.ledger import Workspace
from lowmem.memory.measure import CPUWorkspace, measure_step
from lowmem.studies.quality_model import techniques_config
from lowmem.techniques import precision
from lowmem.techniques.step import Techniques, train_step
from lowmem.wrn import memory as wrn_memory
from lowmem.wrn.recipe import make_optimizer
from lowmem.wrn.step import wrn_model

ROOT = Path(__file__).parents[2]


class CUDAWorkspace(CPUWorkspace):
    """Each op's scratch memory on CUDA (cuDNN and cuBLAS workspace, the caching allocator's rounding): the op runs
    once per call signature on random CUDA tensors of the same shapes, and its peak beyond its outputs is kept.
    No library reports this per op; ``torch.cuda.max_memory_allocated`` around the op is the allocator's own count."""

    DEVICE = "cuda"

    def _measure(self, func: Any, args: tuple, kwargs: dict) -> int:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
            real_args, real_kwargs = tree_map(self._real, (args, kwargs))
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            try:
                out = func(*real_args, **real_kwargs)
                torch.cuda.synchronize()
            except Exception:  # an op that random inputs cannot drive (e.g. needs valid indices): assume none
                return 0
            peak = torch.cuda.max_memory_allocated() - start
        outputs = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        inputs = {id(t.untyped_storage()) for t in tree_leaves((real_args, real_kwargs)) if isinstance(t, torch.Tensor)}
        return max(0, peak - sum(b for k, b in outputs.items() if k not in inputs))


class _Real:
    """Calls a workspace model outside the accountant's fake-tensor mode (mixed precision accounts on fake CPU
    tensors), so that it runs each op on real tensors."""

    def __init__(self, inner: Workspace) -> None:
        self.inner = inner

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> int:
        with unset_fake_temporarily():
            return self.inner(func, args, kwargs)


@dataclasses.dataclass
class Check:
    """What one run of the check works at: full size on CUDA, or ``dry`` (tiny, on the CPU, for the tests)."""

    device: torch.device
    shape: wrn_memory.Shape
    strategies: list[str]
    dry: bool

    def mode(self, mode: str) -> str:
        # The CPU has no fast fp16 convolution (about 130x slower than fp32, notebook 04): dry runs use bf16.
        return mode.replace("fp16", "bf16") if self.dry else mode


def load_check(dry: bool, params_path: Path = ROOT / "params.yaml") -> Check:
    params = yaml.safe_load(params_path.read_text())
    mp = params["memory_profile"]
    # A dry run is the smoke profile's check; a real one checks every strategy the paper profile studies.
    strategies = [s for s in pick(params["checkpointing"]["strategies"], "smoke" if dry else "paper") if s != "none"]
    if dry:
        return Check(torch.device("cpu"), wrn_memory.Shape("wrn-10-1", 8, mp["num_classes"], mp["in_channels"], mp["image_size"]),
                     strategies, True)
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device here. The check is for a GPU; run it with --dry on a CPU to test it.")
    return Check(torch.device("cuda"), wrn_memory.Shape(mp["model"], mp["reference_batch_size"], mp["num_classes"],
                                                        mp["in_channels"], mp["image_size"]), strategies, False)


def _named(c: Check, config: dict[str, Any]) -> Techniques:
    """A grid configuration as the run's Techniques, its 16-bit precision in the check's format (``Check.mode``)."""
    t = techniques_config("wrn", config)
    return Techniques(sparsity=t.get("sparsity", 0.0), precision=c.mode(t.get("precision", "fp32")),
                      microbatch=t.get("microbatch", 0), checkpoint=t.get("checkpoint", "none"),
                      activation_bits=t.get("activation_bits", 0), optimizer=t.get("optimizer", "sgd"))


def combinations(root: Path = ROOT) -> list[tuple[str, str, dict[str, Any]]]:
    """(role, the sweep's name, configuration) of the combinations: the headline's (best within the paper's budget), the
    strongest trained level and the grid's largest accounted reduction, from the combination study's files."""
    sweep = {r["name"]: r for r in csv.DictReader((root / "data/combinations/wrn_sweep.csv").open())}
    paper = yaml.safe_load((root / "lowmem/studies/paper_reference.yaml").read_text())["tasks"]["wrn"]
    best = json.loads((root / "metrics/combinations.json").read_text())["wrn"]["best_within"]["mean"]
    headline = best[f"{-float(paper['quality_change']):g}"]["config"]  # the paper's budget: its accuracy loss
    picks = json.loads((root / "data/combinations/wrn_selected.json").read_text())["selected"]
    search = root / "data/combinations/wrn_search.json"
    if search.exists():
        picks += json.loads(search.read_text())["selected"]
    levels = [c for c in picks if c["role"].startswith(("level", "search"))] or picks  # the search's picks, once it has run
    strongest = max(levels, key=lambda c: float(sweep[c["name"]]["reduction"]))
    largest = max(sweep.values(), key=lambda r: float(r["reduction"]))
    chosen = [("headline (best within the paper's budget, mean rule)", headline),
              (f"strongest trained ({strongest['role']})", strongest["name"]), ("largest accounted reduction", largest["name"])]
    # Every WRN row of the committed headline and of the budget table, so the headline's GPU column can be filled.
    for path, col, label in ((root / "figures/00_headline_full.csv", "our configuration", "headline"),
                             (root / "figures/09_wrn_budgets.csv", "name", "budget")):
        rows = list(csv.DictReader(path.open())) if path.exists() else []
        chosen += [(f"{label} ({r.get('levers', 'budget ' + r.get('budget', ''))}, {r['rule']} rule)", r[col])
                   for r in rows if r.get("task", "wrn") == "wrn" and r[col] in sweep]
    seen: set[str] = set()
    return [(role, name, json.loads(sweep[name]["config"])) for role, name in chosen if not (name in seen or seen.add(name))]


def configurations(c: Check, root: Path = ROOT) -> list[tuple[str, str, Techniques]]:
    """(name, role, techniques) in the order they are checked: the baseline and the single levers, then the
    combinations."""
    out = [("baseline", "baseline", Techniques())]
    out += [(m, "precision", Techniques(precision=c.mode(m))) for m in ("mixed-bf16", "mixed-fp16", "half-bf16", "half-fp16")]
    out += [(f"microbatch-{b}", "microbatching", Techniques(microbatch=b)) for b in (8, 1)]
    out += [(f"checkpoint-{s}", "checkpointing", Techniques(checkpoint=s)) for s in c.strategies]
    out += [("sparsity-0.9", "sparsity", Techniques(sparsity=0.9))]
    for role, name, cfg in combinations(root):
        out.append((name, role, _named(c, cfg)))
    if c.dry:  # one configuration per code path (lever, mixed and half precision, a combination) runs every path;
        # all of them would take minutes on 2 CPU cores. The headline's and budget table's rows all run.
        singles = ("baseline", "microbatching", "checkpointing", "sparsity")
        first: dict[str, tuple[str, str, Techniques]] = {}
        for row in out:
            kind = row[1] if row[1] in singles else row[0].split("-")[0] if row[1] == "precision" else "combination"
            first.setdefault(row[0] if row[1].startswith(("headline", "budget")) else kind, row)
        out = list(first.values())
    return out


def _live_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}.values())


def memory_row(c: Check, name: str, role: str, tech: Techniques, workspace: Workspace) -> dict[str, Any]:
    """One configuration: its real step's peak against the accountant's, with and without the workspace model."""
    t0 = time.perf_counter()
    s = c.shape
    tech = dataclasses.replace(tech, microbatch=tech.microbatch if tech.microbatch < s.batch_size else 0)
    prec = precision.parse(tech.precision)
    in_shape = (tech.microbatch or s.batch_size, s.in_channels, s.image_size, s.image_size)
    model = wrn_model(s.model, s.num_classes, s.in_channels, tech, c.device, 0, in_shape)
    x = precision.cast_batch(torch.randn(s.batch_size, s.in_channels, s.image_size, s.image_size, device=c.device), prec)
    y = torch.randint(0, s.num_classes, (s.batch_size,), device=c.device)
    opt = make_optimizer(model, name=tech.optimizer)
    scaler = precision.make_scaler(prec, c.device.type)
    measured, how = measure_step(lambda mark: train_step(model, opt, x, y, tech, mark, scaler), model, opt, (x, y))
    # What the allocator holds between steps beyond the step's tensors: the libraries' persistent workspace.
    names = {p: n for n, p in model.named_parameters()}
    live = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *model.buffers(),
            *(t for _, t in optimizer_tensors(opt, names)), x, y]
    held = torch.cuda.memory_allocated(c.device) - _live_bytes(live) if c.device.type == "cuda" else None
    del model, opt, x, y
    accounted = wrn_memory.account(tech, s, as_stored=True).peak
    with_ws = wrn_memory.account(tech, s, as_stored=True, workspace=workspace).peak
    # cuBLAS keeps its workspace allocated from its first call on, so it is in every step's peak but in no op's own
    # scratch: the full model adds it as measured here, once the step has run.
    full = with_ws + (held or 0)
    return {"configuration": name, "role": role, "precision": tech.precision, "microbatch": tech.microbatch,
            "checkpoint": tech.checkpoint, "sparsity": tech.sparsity, "measured_mib": measured / MIB,
            "accounted_mib": accounted / MIB, "gap_pct": 100 * (accounted - measured) / measured,
            "accounted_with_workspace_mib": with_ws / MIB, "gap_with_workspace_pct": 100 * (with_ws - measured) / measured,
            "persistent_library_mib": None if held is None else held / MIB,
            "accounted_full_mib": full / MIB, "gap_full_pct": 100 * (full - measured) / measured, "method": how,
            "seconds": round(time.perf_counter() - t0, 2)}
