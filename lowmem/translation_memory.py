"""The memory of one fairseq training step of DynamicConv (Sohoni et al. 2019, the translation benchmark's profile):
the recipe's ``lightconv_iwslt_de_en`` built by fairseq itself, its label-smoothed loss and fairseq's Adam, on a
batch of ``--max-tokens`` tokens.

It runs on the meta device at full size, in about a second per batch shape. One line of fairseq needs a value
rather than a shape: the encoder asks whether the batch has any padding (``encoder_padding_mask.any()``).
The accounted batches have none (every sentence is ``length`` tokens), so :class:`_Unpadded` answers that question
on meta tensors; a test checks that meta and real CPU tensors account the same bytes.
"""

from __future__ import annotations

import argparse
import logging
import time
import types
from typing import Any

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lowmem.accounting import CATEGORIES, MIB, MemoryReport, StepFn, account_step
from lowmem.measure import measure_step

_root_level = logging.getLogger().level
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY  # noqa: E402
from fairseq.optim.adam import Adam  # noqa: E402

logging.getLogger().setLevel(_root_level)  # importing fairseq sets the root logger to DEBUG (environment notes)


def _dictionary(size: int) -> Dictionary:
    d = Dictionary()  # bos, pad, eos, unk
    for i in range(size - len(d)):
        d.add_symbol(f"w{i}")
    return d


def model_args(recipe_args: list[str]) -> argparse.Namespace:
    """The model options of a fairseq-train command line, completed by its architecture's defaults, as
    fairseq-train resolves them (environment notes: a parser with SUPPRESS, the model's add_args, then the arch)."""
    ap = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    ap.add_argument("--arch", "-a", required=True)
    args, _ = ap.parse_known_args([str(a) for a in recipe_args])
    ARCH_MODEL_REGISTRY[args.arch].add_args(ap)
    args, _ = ap.parse_known_args([str(a) for a in recipe_args])
    ARCH_CONFIG_REGISTRY[args.arch](args)
    return args


def build(recipe_args: list[str], src_vocab: int, tgt_vocab: int, device: str | torch.device = "meta") -> tuple[torch.nn.Module, Any]:
    """(model, task-like holder of the two dictionaries) for ``recipe_args``'s architecture."""
    args = model_args(recipe_args)
    task = types.SimpleNamespace(source_dictionary=_dictionary(src_vocab), target_dictionary=_dictionary(tgt_vocab))
    with torch.device(device):
        model = ARCH_MODEL_REGISTRY[args.arch].build_model(args, task)
    return model, task


def fairseq_step(
    recipe_args: list[str], src_vocab: int, tgt_vocab: int, tokens: int, length: int, seed: int = 0, device: str | torch.device = "meta"
) -> tuple[StepFn, torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """One training step as fairseq-train takes it (criterion forward, backward, Adam step), on a batch of
    ``tokens // length`` sentence pairs of ``length`` tokens each side: (step, model, optimizer, batch tensors)."""
    if not 0 < length <= tokens:
        raise ValueError(f"length must be in 1..tokens ({tokens}), got {length}")
    torch.manual_seed(seed)
    model, task = build(recipe_args, src_vocab, tgt_vocab, device)
    model.train()
    criterion = LabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1)
    # fairseq's own Adam (the one --optimizer adam uses): fp32 exp_avg and exp_avg_sq per parameter. Its
    # hyperparameters do not change the memory.
    optimizer = Adam(model.parameters(), lr=5e-4, betas=(0.9, 0.98), weight_decay=1e-4)
    batch = tokens // length
    nspecial = task.target_dictionary.nspecial
    with torch.device(device):
        src = torch.randint(nspecial, src_vocab, (batch, length))
        tgt = torch.randint(nspecial, tgt_vocab, (batch, length))
        src_lengths = torch.full((batch,), length)
    prev = torch.cat([torch.full_like(tgt[:, :1], task.target_dictionary.eos()), tgt[:, :-1]], dim=1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths, "prev_output_tokens": prev},
              "target": tgt, "ntokens": batch * length, "nsentences": batch}

    def step(mark: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        mark("forward")
        loss, _, _ = criterion(model, sample)
        mark("backward")
        loss.backward()
        mark("optimizer")
        optimizer.step()

    return step, model, optimizer, [src, tgt, prev, src_lengths]


class _Unpadded(TorchDispatchMode):
    """Answers "is any of this meta tensor true?" with False. Only valid for batches without padding."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta" and args[0].dtype == torch.bool:
            return False
        return func(*args, **(kwargs or {}))


def account(recipe_args: list[str], src_vocab: int, tgt_vocab: int, tokens: int, length: int, device: str = "meta", seed: int = 0) -> MemoryReport:
    step, model, opt, batch = fairseq_step(recipe_args, src_vocab, tgt_vocab, tokens, length, seed, device)
    with _Unpadded():
        return account_step(step, model, opt, batch)


def measure(recipe_args: list[str], src_vocab: int, tgt_vocab: int, tokens: int, length: int, seed: int = 0) -> tuple[int, str]:
    step, model, opt, batch = fairseq_step(recipe_args, src_vocab, tgt_vocab, tokens, length, seed, "cpu")
    return measure_step(step, model, opt, batch)


def parameter_count(recipe_args: list[str], src_vocab: int, tgt_vocab: int) -> int:
    model, _ = build(recipe_args, src_vocab, tgt_vocab, "meta")
    return sum(p.numel() for p in model.parameters())


def breakdown(p: Any) -> pd.DataFrame:
    """One accounted row per sentence length at ``p.max_tokens`` (meta, full size), then one row per measured
    [tokens, length] step with the accounted peak beside the measured one. ``p``: TranslationMemoryParams."""
    rows = []
    for length in p.sentence_lengths:
        t0 = time.perf_counter()
        r = account(p.recipe_args, p.src_vocab, p.tgt_vocab, p.max_tokens, length, seed=p.seed)
        rows.append(_row("accounted", p.max_tokens, length, r, time.perf_counter() - t0))
    for tokens, length in p.measured:
        r = account(p.recipe_args, p.src_vocab, p.tgt_vocab, tokens, length, seed=p.seed)
        t0 = time.perf_counter()
        measured, method = measure(p.recipe_args, p.src_vocab, p.tgt_vocab, tokens, length, seed=p.seed)
        row = _row("measured", tokens, length, r, time.perf_counter() - t0)
        row.update(measured_mib=measured / MIB, gap_pct=100 * (r.peak - measured) / measured, method=method)
        rows.append(row)
    return pd.DataFrame(rows)


def _row(source: str, tokens: int, length: int, r: MemoryReport, seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {"source": source, "tokens": tokens, "sentence_length": length, "sentences": tokens // length}
    row.update({f"{c}_mib": r.at_peak[c] / MIB for c in CATEGORIES})
    row.update({f"{c}_max_mib": r.category_max[c] / MIB for c in ("model", "gradients", "optimizer")})
    row.update(total_mib=r.peak / MIB, peak_phase=r.peak_phase, seconds=seconds)
    return row


def summary(p: Any, df: pd.DataFrame) -> dict[str, Any]:
    ref = df[(df.source == "accounted") & (df.sentence_length == p.reference_length)].iloc[0]
    measured = df[df.source == "measured"]
    return {
        "profile": p.profile,
        "parameters": parameter_count(p.recipe_args, p.src_vocab, p.tgt_vocab),
        "max_tokens": p.max_tokens,
        "reference_length": p.reference_length,
        "at_peak_mib": {c: round(float(ref[f"{c}_mib"]), 3) for c in CATEGORIES} | {"total": round(float(ref.total_mib), 3)},
        "activation_share": round(float(ref.activations_mib / ref.total_mib), 4),
        # Weights, gradients and Adam's two states: what no batch size or activation technique reduces.
        "fixed_mib": round(float(ref.model_max_mib + ref.gradients_max_mib + ref.optimizer_max_mib), 3),
        "measured": {f"{int(r.tokens)}x{int(r.sentence_length)}": {"accounted_mib": round(float(r.total_mib), 3),
                     "measured_mib": round(float(r.measured_mib), 3), "gap_pct": round(float(r.gap_pct), 3)} for r in measured.itertuples()},
        "max_abs_gap_pct": round(float(measured.gap_pct.abs().max()), 3) if len(measured) else None,
    }
