"""The memory of one fairseq training update of DynamicConv (Sohoni et al. 2019, the translation benchmark's profile):
the model of a fairseq-train command line, built by fairseq itself (lowmem's ``--user-dir`` plugin included), its
label-smoothed loss, and the optimizer fairseq's Trainer would build for it (Adam; under ``--fp16`` or
``--memory-efficient-fp16``, fairseq's 16-bit wrappers), on ``--update-freq`` batches making up ``--max-tokens``
tokens. Sparse layers count as CSR; fp16 master weights and their gradients count with the optimizer that keeps them.

It runs on the meta device at full size, in a few seconds per command line. One line of fairseq needs a value
rather than a shape: the encoder asks whether the batch has any padding (``encoder_padding_mask.any()``).
The accounted batches have none (every sentence is ``length`` tokens), so :class:`_Unpadded` answers that question
on meta tensors; a test checks that meta and real CPU tensors account the same bytes.

The plugin's ``--precision mixed-bf16`` is accounted on fake CPU tensors instead (autocast acts on a device type,
and meta is none). Under ``half-bf16`` one kernel differs between meta and the CPU: meta's layer norm saves its
mean and 1/std in fp32, as CUDA's does, and the CPU's in bf16, 4 bytes less per token per layer norm; the
accountant keeps meta's (the GPU's) bytes, and a test states the difference exactly.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import time
import types
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import pandas as pd
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from lowmem.dynamicconv.microbatch import part_sizes
from lowmem.memory.accounting import CATEGORIES, MIB, MemoryReport, StepFn, StorageFormat, account_step, dense
from lowmem.memory.measure import measure_step
from lowmem.techniques import precision, sharding, sparsity

_root_level = logging.getLogger().level
from fairseq import optim  # noqa: E402
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq.models import ARCH_MODEL_REGISTRY  # noqa: E402

logging.getLogger().setLevel(_root_level)  # importing fairseq sets the root logger to DEBUG (environment notes)


def _dictionary(size: int) -> Dictionary:
    d = Dictionary()  # bos, pad, eos, unk
    for i in range(size - len(d)):
        d.add_symbol(f"w{i}")
    return d


def training_options(train_args: list[str]) -> tuple[argparse.Namespace, Any]:
    """A fairseq-train command line's options, parsed by fairseq-train's own parser (``--user-dir`` plugins
    included) and completed by its architecture's defaults: (args, fairseq's config). Copies of one parse per
    command line: Hydra's composition of the config is half the time of a whole account, and callers change the
    config they get (``build_optimizer``)."""
    args, cfg = _parsed(tuple(map(str, train_args)))
    return copy.deepcopy(args), copy.deepcopy(cfg)


@functools.lru_cache(maxsize=512)
def _parsed(train_args: tuple[str, ...]) -> tuple[argparse.Namespace, Any]:
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["<data>", *train_args])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Hydra's deprecation notices about fairseq's config schema
        return args, convert_namespace_to_omegaconf(args)


def model_args(train_args: list[str]) -> argparse.Namespace:
    return training_options(train_args)[0]


def step_options(train_args: list[str]) -> tuple[argparse.Namespace, Any]:
    """``training_options`` of the command line as an update runs it: the recipe's Adam where the command names no
    optimizer (a later --optimizer overrides it). The accountant reads this parse too, so that one account composes
    Hydra's config once, not twice."""
    return training_options(["--optimizer", "adam", *train_args])


def build(train_args: list[str] | argparse.Namespace, src_vocab: int, tgt_vocab: int, device: str | torch.device = "meta") -> tuple[torch.nn.Module, Any]:
    """(model, task-like holder of the two dictionaries) for a command line's architecture (or its parsed options)."""
    args = train_args if isinstance(train_args, argparse.Namespace) else model_args(train_args)
    task = types.SimpleNamespace(source_dictionary=_dictionary(src_vocab), target_dictionary=_dictionary(tgt_vocab))
    with torch.device(device):
        model = ARCH_MODEL_REGISTRY[args.arch].build_model(args, task)
    return model, task


def build_optimizer(cfg: Any, model: torch.nn.Module) -> Any:
    """The optimizer fairseq's Trainer builds for ``cfg`` (``Trainer._build_optimizer``), after casting the model
    as the Trainer does for --fp16."""
    if cfg.common.amp or cfg.common.bf16:
        raise ValueError("--amp (CUDA autocast) and --bf16 (TPU in fairseq 0.12) cannot be accounted on the meta device; "
                         "use --fp16 or --memory-efficient-fp16")
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.common.memory_efficient_fp16:
        return optim.MemoryEfficientFP16Optimizer.build_optimizer(cfg, params)
    if cfg.common.fp16:
        # Per-parameter fp32 copies instead of one flat buffer: the same bytes, and the flat buffer's constructor
        # asks CUDA for its device, which meta tensors do not need.
        cfg.common.fp16_no_flatten_grads = True
        return optim.FP16Optimizer.build_optimizer(cfg, params)
    return optim.build_optimizer(cfg.optimizer, params)


class _OptimizerView:
    """What ``account_step`` asks of an optimizer (``zero_grad`` and the tensors it keeps), for fairseq's wrappers.
    FP16Optimizer keeps fp32 master weights and their gradients itself; they count as optimizer state."""

    def __init__(self, fs_optimizer: Any) -> None:
        self.fs = fs_optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.fs.zero_grad()

    @property
    def state(self) -> dict[Any, dict[str, Any]]:
        state = {p: dict(s) for p, s in self.fs.optimizer.state.items()}
        if isinstance(self.fs, optim.FP16Optimizer):
            for p in self.fs.fp32_params:
                state.setdefault(p, {}).update(master=p.data, master_grad=p.grad)
        return state


def fairseq_step(
    train_args: list[str], src_vocab: int, tgt_vocab: int, tokens: int, length: int, seed: int = 0, device: str | torch.device = "meta",
    shard: sharding.Sharding = sharding.Sharding(), skip_repeats: bool = False,
) -> tuple[StepFn, torch.nn.Module, Any, list[torch.Tensor]]:
    """One update as fairseq-train takes it for ``train_args`` (the recipe plus any technique's options): for each
    of ``--update-freq`` k batches (each as the plugin's ``--microbatches`` sub-batches, one after the other, where
    it is given), criterion forward and backward (loss-scaled under --fp16); then gradients
    divided by the tokens, and the optimizer step. The update sees ``tokens`` tokens in k batches of
    ``tokens // k // length`` sentence pairs of ``length`` tokens each side. Returns (step, model, optimizer view,
    batch tensors). fairseq's gradient-norm computation (--clip-norm 0: logging only, one scalar per parameter)
    is left out: fairseq moves those scalars to the CPU, which meta tensors cannot do. ``shard``: one of
    ``shard.devices`` devices, each updating on ``tokens`` of its own, wrapped for accounting as
    ``lowmem.techniques.sharding.wrap`` says (the ZeRO-1 mode shards fairseq's own Adam with torch's
    ZeroRedundancyOptimizer: fairseq 0.12's --zero-sharding needs fairscale). ``skip_repeats`` (for accounting only):
    of a run of equal batches (sub-batches or --update-freq batches of one size), the step passes the first two and
    then goes on with the next size or the optimizer. From the second on, equal batches find the same tensors alive
    (the gradients are allocated, every batch's inputs were made up front) and leave them as they found them, so the
    ones skipped repeat the second's bytes exactly; a test compares the peaks with and without."""
    args, cfg = step_options(train_args)
    k = cfg.optimization.update_freq[0]
    batch = tokens // k // length
    if not 0 < length <= tokens or batch < 1:
        raise ValueError(f"{tokens} tokens in --update-freq {k} batches of sentences of length {length} leave no sentence per batch")
    # The plugin's exact microbatching runs each batch as sub-batches of its own sentences, one at a time.
    m = getattr(cfg.task, "microbatches", 1)
    parts = [len(p) for p in part_sizes([length] * batch, tokens // k // m, m)] if m > 1 else [batch]
    torch.manual_seed(seed)
    model, task = build(args, src_vocab, tgt_vocab, device)  # the options parsed above, not parsed again
    if cfg.common.fp16:
        model = model.half()
    model.train()
    model = sharding.wrap(model, shard, accounting=True)
    criterion = LabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1)
    # fairseq's own optimizer: Adam keeps fp32 exp_avg and exp_avg_sq per parameter, even for fp16 weights. Its
    # hyperparameters do not change the memory.
    optimizer = build_optimizer(cfg, model)
    if shard.active and shard.mode == "optimizer":
        if cfg.common.fp16 or cfg.common.memory_efficient_fp16:
            # fairseq's 16-bit wrappers keep fp32 master copies that a ZeroRedundancyOptimizer over the model's
            # parameters would not shard; fairseq's own --zero-sharding needs fairscale.
            raise ValueError("sharding mode 'optimizer' cannot be accounted with --fp16 or --memory-efficient-fp16; "
                             "use the plugin's --precision mixed-bf16/half-bf16, or another mode")
        inner = optimizer._optimizer
        optimizer._optimizer = sharding.optimizer(model, shard, type(inner), accounting=True, **inner.defaults)
    nspecial = task.target_dictionary.nspecial
    samples, inputs = [], []
    for n in [p for _ in range(k) for p in parts]:
        with torch.device(device):
            src = torch.randint(nspecial, src_vocab, (n, length))
            tgt = torch.randint(nspecial, tgt_vocab, (n, length))
            src_lengths = torch.full((n,), length)
        prev = torch.cat([torch.full_like(tgt[:, :1], task.target_dictionary.eos()), tgt[:, :-1]], dim=1)
        samples.append({"net_input": {"src_tokens": src, "src_lengths": src_lengths, "prev_output_tokens": prev},
                        "target": tgt, "ntokens": n * length, "nsentences": n})
        inputs += [src, tgt, prev, src_lengths]

    passed = samples
    if skip_repeats:  # the first two of each run of equal sizes (see above), in order
        passed = [s for i, s in enumerate(samples)
                  if i < 2 or s["nsentences"] != samples[i - 1]["nsentences"] or s["nsentences"] != samples[i - 2]["nsentences"]]

    def step(mark: Any) -> None:
        optimizer.zero_grad()
        for sample in passed:
            mark("forward")
            loss, _, _ = criterion(model, sample)
            mark("backward")
            optimizer.backward(loss)
            del loss
        mark("optimizer")
        optimizer.multiply_grads(1.0 / (k * batch * length))
        optimizer.step()

    return step, model, _OptimizerView(optimizer), inputs


def storage_format(model: torch.nn.Module) -> StorageFormat:
    """CSR for the sparse layers (``--sparsity``), every other tensor as stored."""
    return sparsity.CSRFormat(model) if sparsity.sparse_layers(model) else dense


class _Unpadded(TorchDispatchMode):
    """Answers "is any of this meta (or fake) tensor true?" with False. Only valid for batches without padding."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if (func is torch.ops.aten._local_scalar_dense.default and args[0].dtype == torch.bool
                and (args[0].device.type == "meta" or isinstance(args[0], FakeTensor))):
            return False
        return func(*args, **(kwargs or {}))


@contextmanager
def _shapes_as_sizes() -> Iterator[None]:
    """fairseq's sinusoidal positions take the batch's shape as a tensor (``torch.onnx.operators.shape_as_tensor``)
    and compare it with an int, which a fake tensor, having no data, cannot answer; the shape as a ``torch.Size``
    answers the same. Used on fake tensors only: on meta, torch computes the shape tensor on the CPU itself."""
    import torch.onnx.operators as onnx_ops

    real = onnx_ops.shape_as_tensor
    onnx_ops.shape_as_tensor = lambda x: x.shape  # type: ignore[assignment]
    try:
        yield
    finally:
        onnx_ops.shape_as_tensor = real


def account(recipe_args: list[str], src_vocab: int, tgt_vocab: int, tokens: int, length: int, device: str = "meta", seed: int = 0,
            shard: sharding.Sharding = sharding.Sharding(), skip_repeats: bool = True) -> MemoryReport:
    """The accountant's report of one update (on one of ``shard.devices`` devices, of ``tokens`` tokens: the
    device's share). Under the plugin's ``--precision mixed-bf16``, and for a sharded update (FSDP2 places shards
    on a mesh of a real device type), the meta device becomes fake CPU tensors, as on the WRN track
    (``lowmem.techniques.precision.shapes_only``): autocast acts on a device type, and meta is none."""
    ctx: Any = nullcontext()
    if device == "meta":
        mode = getattr(step_options(recipe_args)[0], "precision", None) or "fp32"
        if mode == "mixed-bf16" or shard.active:
            if "--sparsity" in recipe_args:
                # sparsify draws its pattern from values, which fake tensors do not have (lowmem.wrn.memory lays a
                # WRN's pattern out on meta first; the plugin builds its model in one go).
                raise ValueError("--sparsity cannot be accounted with --precision mixed-bf16 or on several devices "
                                 "(both need fake tensors); account --precision half-bf16 with --sparsity on one device")
            fake, dev = precision.shapes_only(precision.parse("mixed-bf16"))  # fake CPU tensors
            ctx, device = ExitStack(), str(dev)
            ctx.enter_context(fake)
            ctx.enter_context(_shapes_as_sizes())
            if shard.active:
                ctx.enter_context(sharding.fake_group(shard.devices))
    with ctx:
        step, model, opt, batch = fairseq_step(recipe_args, src_vocab, tgt_vocab, tokens, length, seed, device, shard,
                                               skip_repeats=skip_repeats)
        with _Unpadded():
            return account_step(step, model, opt, batch, storage_format(model),  # type: ignore[arg-type]
                                held=sharding.held_buckets(model, shard))


def measure(recipe_args: list[str], src_vocab: int, tgt_vocab: int, tokens: int, length: int, seed: int = 0) -> tuple[int, str]:
    step, model, opt, batch = fairseq_step(recipe_args, src_vocab, tgt_vocab, tokens, length, seed, "cpu")
    return measure_step(step, model, opt, batch)  # type: ignore[arg-type]


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
