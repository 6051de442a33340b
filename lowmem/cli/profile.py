"""``lowmem profile``: the peak memory of one training step of any model, by category, at full size on tensors
without values (fake CPU tensors, or the meta device); with ``measure``, the same step run for real on the CPU and
the accountant's gap to PyTorch's own count.

The step is the project's (``lowmem.techniques.step.train_step``: forward, cross-entropy, backward, optimizer step)
under a ``Techniques`` configuration, so ``lowmem plan`` accounts the levers on the same step; a fairseq
architecture takes fairseq-train's own update instead (``lowmem.dynamicconv.memory``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lowmem.cli import hf, models
from lowmem.cli.models import Spec, SpecError, shape
from lowmem.cli.scalars import HostScalars, has_values
from lowmem.memory.accounting import MemoryReport, account_step
from lowmem.memory.ledger import Workspace
from lowmem.memory.measure import CPUWorkspace, measure_step
from lowmem.techniques import fused_step, optimizers, precision, registry, sharding
from lowmem.techniques.checkpoint import BlockCost, CheckpointedChain, Segment, block_costs, plan
from lowmem.techniques.step import Techniques, train_step

# The optimizers a step can take: torch's, with their usual hyperparameters (bytes do not depend on them),
# bitsandbytes' AdamW with 8-bit moments, and each optimizer lever's (lowmem.techniques.registry: Kahan-compensated
# SGD, 8-bit momentum, ...).
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps),
    "adamw": lambda ps: torch.optim.AdamW(ps),
    "adafactor": lambda ps: torch.optim.Adafactor(ps),
    "adamw-8bit": lambda ps: optimizers.adamw8bit(ps),
}
STEPS = ("plain", "fused")  # the optimizer step after backward, or fused into it (torch models on one device)
FAIRSEQ_OPTIMIZERS = {"sgd": "sgd", "sgd-momentum": "nag", "adam": "adam", "adafactor": "adafactor"}  # fairseq's names
# Module types whose step the accountant does not count exactly, with why (docs/planner.md has the
# measured gaps and the command that measures them). lowmem profile names them in its output.
KNOWN_GAPS: dict[str, tuple[type[nn.Module], str]] = {
    "nn.LSTM": (nn.LSTM, "on the CPU an LSTM trains through oneDNN's recurrent kernel (mkldnn_rnn_layer), whose "
                "kernel for tensors without values returns a workspace of another size than the real one, and the "
                "real kernel allocates scratch that no tensor holds; the account is below the real peak "
                "(lowmem profile ... --measure shows by how much)"),
}
CHAIN_MIN = 2  # an nn.Sequential of at least this many children is a chain of blocks that checkpointing can cut (ResNet-18: 2 per stage)


@dataclass(frozen=True)
class Request:
    """One training step to account: the model, its batch and its optimizer."""

    model: str  # a spec of lowmem.cli.models: torchvision:resnet50, wrn:wrn-28-2, fairseq:ARCH, pkg.mod:factory
    batch: int = 1  # examples per step (fairseq: sentences; see ``tokens``)
    input: tuple[int, ...] = ()  # one example's shape, e.g. (3, 224, 224); token ids: (length,) with ``vocab``
    optimizer: str = "sgd-momentum"
    vocab: int | None = None  # token models: ids drawn below this; fairseq: both dictionaries' size
    tokens: int | None = None  # fairseq: tokens per batch (--max-tokens); default batch x length
    devices: int = 1  # data-parallel devices the batch is split over (lowmem.techniques.sharding); accounted per device
    shard: str = "replicate"  # what they shard: one of lowmem.techniques.sharding.MODES
    step: str = "plain"  # one of STEPS: the optimizer's step after backward, or fused into it (lowmem.techniques.fused_step)

    def __post_init__(self) -> None:
        spec = models.parse(self.model)
        allowed = FAIRSEQ_OPTIMIZERS if spec.kind == "fairseq" else {**OPTIMIZERS, **dict.fromkeys(registry.optimizers()[1:])}
        if self.optimizer not in allowed:
            raise SpecError(f"optimizer {self.optimizer!r} is not one of {', '.join(allowed)}"
                            f"{' (for a fairseq model)' if spec.kind == 'fairseq' else ''}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise SpecError(f"batch {self.batch!r} must be a positive integer")
        if spec.kind == "fairseq" and (len(self.input) != 1 or not self.vocab):
            raise SpecError("a fairseq model needs --input LENGTH (tokens per sentence) and --vocab SIZE")
        if spec.kind == "hf":
            self._check_hf(spec)
        if spec.kind != "fairseq" and not self.input:
            raise SpecError("give one example's shape with --input, e.g. 3x224x224 (or a length with --vocab for token ids)")
        if self.step not in STEPS:
            raise SpecError(f"step {self.step!r} is not one of {', '.join(STEPS)}")
        if self.step == "fused" and (spec.kind == "fairseq" or self.devices > 1):
            raise SpecError("the fused step (--step fused) steps each parameter inside backward on one device: "
                            + ("fairseq-train steps after backward" if spec.kind == "fairseq" else
                               f"over {self.devices} devices the gradients must be reduced first") + "; use --step plain")
        try:
            self.sharding.per_device(self.batch if spec.kind != "fairseq" else _tokens(self))
        except ValueError as e:
            raise SpecError(str(e)) from None

    def _check_hf(self, spec: Spec) -> None:
        """A transformers model takes token ids: one length, below its position limit; ids below its vocabulary,
        which is the default --vocab."""
        try:
            cfg, _ = hf.config(spec.name)
        except hf.HFError as e:
            raise SpecError(str(e)) from None
        if len(self.input) != 1:
            raise SpecError(f"{self.model} takes token ids: give --input LENGTH (tokens per example), not {'x'.join(map(str, self.input)) or 'nothing'}")
        limit = hf.max_length(cfg)
        if limit is not None and self.input[0] > limit:
            raise SpecError(f"--input {self.input[0]} tokens is above {self.model}'s limit of {limit} positions")
        if self.vocab is not None and self.vocab > cfg.vocab_size:
            raise SpecError(f"--vocab {self.vocab} is above {self.model}'s vocabulary of {cfg.vocab_size}")
        object.__setattr__(self, "vocab", self.vocab or cfg.vocab_size)  # frozen: the default, filled in once

    @property
    def sharding(self) -> sharding.Sharding:
        try:
            return sharding.Sharding(self.devices, self.shard)
        except ValueError as e:
            raise SpecError(f"{e} (--devices, --shard)") from None

    @property
    def device_batch(self) -> int:
        """Examples one device steps on: the batch split over ``devices``."""
        return self.sharding.per_device(self.batch)

    @property
    def spec(self) -> Spec:
        return models.parse(self.model)


def request(m: dict) -> Request:
    """A model entry of params.yaml (``model``, ``batch``, ``input``, ``optimizer``) as a Request."""
    return Request(m["model"], m["batch"], shape(str(m["input"])), m["optimizer"])


def gap_notes(model: nn.Module) -> list[str]:
    """One line per module type of ``KNOWN_GAPS`` in ``model``: what the account misses there, and why."""
    return [f"not exact for {name}: {why}" for name, (kind, why) in KNOWN_GAPS.items()
            if any(isinstance(m, kind) for m in model.modules())]


def make_optimizer(name: str, model: nn.Module, shard: sharding.Sharding = sharding.Sharding(), accounting: bool = False,
                   fused: bool = False) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``model``'s parameters, sharded as ``shard`` says (ZeRO-1), or with ``fused``
    stepped inside backward (one device)."""
    def make(params: Any) -> torch.optim.Optimizer:
        if name in OPTIMIZERS:
            return OPTIMIZERS[name](params)
        return registry.make_optimizer(params, name, lr=0.1, momentum=0.9, nesterov=False, weight_decay=0.0)

    if fused:  # Request refuses the fused step over several devices
        return fused_step.FusedOptimizer(model.parameters(), make)
    return sharding.optimizer(model, shard, make, accounting)


def chains(model: nn.Module) -> list[tuple[nn.Module, str, nn.Sequential]]:
    """The model's chains of blocks: each outermost ``nn.Sequential`` of at least ``CHAIN_MIN`` children that all
    hold parameters, as (parent, attribute, chain). A torchvision ResNet has four (layer1-4), a ViT one
    (encoder.layers). A Sequential with parameter-free children (an in-place activation, dropout) is not cut: an
    in-place op would modify the input a segment keeps for its recomputation (MobileNetV3's classifier)."""
    found: list[tuple[nn.Module, str, nn.Sequential]] = []

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if isinstance(child, nn.Sequential) and len(child) >= CHAIN_MIN and \
                    all(any(True for _ in block.parameters()) for block in child):
                found.append((parent, name, child))
            else:
                visit(child)

    visit(model)
    return found


def checkpoint_chains(model: nn.Module, spec: str = "none", segments: list[list[Segment]] | None = None) -> int:
    """Checkpoints every chain of ``chains`` with strategy ``spec`` (lowmem.techniques.checkpoint), or with the
    given ``segments`` per chain (``lowmem plan``'s placement, from ``chain_costs``), in place; returns how many
    chains there were."""
    found = chains(model)
    if not found and spec != "none" and segments is None and hf.is_hf(model):
        if spec != "block":
            raise SpecError(f"checkpoint-{spec}: a transformers model checkpoints through transformers, each layer "
                            "a segment: use checkpoint-block")
        hf.checkpoint_layers(model)
        return 0
    if segments is not None and len(segments) != len(found):
        raise SpecError(f"{len(segments)} chains of segments given for a model with {len(found)} chains of blocks")
    for i, (parent, name, chain) in enumerate(found):
        if segments is not None:
            setattr(parent, name, CheckpointedChain(chain, segments[i]))
        elif spec != "none":
            setattr(parent, name, CheckpointedChain(chain, plan(spec, len(chain))))
    return len(found)


def chain_costs(req: Request, tech: Techniques, examples: int) -> tuple[list[BlockCost], list[int], list[str]]:
    """(block costs of every chain one after the other, each chain's length, each chain's name in the model) for a
    microbatch of ``examples`` in ``tech``'s precision (under autocast for mixed precision), on fake CPU tensors
    (the CPU's kernels, as ``account``): what ``lowmem.techniques.checkpoint.frontier`` plans over. Packed
    activations (``activation_bits``) are left out: the costs are relative, and the accountant counts the packing."""
    prec = precision.parse(tech.precision)
    model = precision.prepare(models.build(req.spec, "meta"), prec)
    found = chains(model)
    names = {id(m): n for n, m in model.named_modules()}
    inputs: dict[int, torch.Tensor] = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        models.to_empty(model, "cpu")
        hooks = [chain.register_forward_pre_hook(lambda _, args, i=i: inputs.setdefault(i, args[0]))
                 for i, (_, _, chain) in enumerate(found)]
        x, _ = models.batch(model, examples, req.input, req.vocab, "cpu", dtype=prec.dtype if prec.kind == "half" else torch.float32)
        inputs.clear()  # the probe of models.batch ran one example
        with torch.no_grad(), precision.autocast(prec, "cpu"):
            model(x)
        for h in hooks:
            h.remove()
        with precision.autocast(prec, "cpu"):
            costs = [c for i, (_, _, chain) in enumerate(found) for c in block_costs(chain, inputs[i])]
    return costs, [len(c) for _, _, c in found], [names[id(c)] for _, _, c in found]


def step_of(req: Request, tech: Techniques, device: torch.device | str, examples: int | None = None,
            model: nn.Module | None = None, segments: list[list[Segment]] | None = None
            ) -> tuple[Callable[[Callable[[str], None]], Any], nn.Module, Any, tuple[torch.Tensor, ...]]:
    """(step, model, optimizer, batch) of one training step of ``req`` under ``tech`` on ``device`` (``model``:
    already built there, in ``tech``'s precision; ``segments``: checkpoint placement, see ``checkpoint_chains``)."""
    prec = precision.parse(tech.precision)
    if req.step == "fused":
        try:
            fused_step.check(tech.microbatch, tech.precision)
        except ValueError as e:
            raise SpecError(str(e)) from None
    if model is None:
        model = precision.prepare(models.build(req.spec, device), prec)
    checkpoint_chains(model, tech.checkpoint, segments)
    # A float batch in the model's dtype (16-bit in half mode; autocast casts it itself in mixed mode).
    x, y = models.batch(model, req.device_batch, req.input, req.vocab, device, dtype=prec.dtype if prec.kind == "half" else torch.float32)
    model = sharding.wrap(model, req.sharding, accounting=True)
    opt = make_optimizer(req.optimizer, model, req.sharding, accounting=True, fused=req.step == "fused")
    scaler = precision.make_scaler(prec, torch.device(device).type, sync=False)

    def step(mark: Callable[[str], None]) -> None:
        with HostScalars() if not has_values(x) else nullcontext():
            train_step(model, opt, x[:examples], y[:examples], tech, mark, scaler)

    return step, model, opt, (x, y)


def _fairseq_args(req: Request, tech: Techniques) -> list[str]:
    if tech != Techniques():
        raise SpecError("a fairseq model takes the levers as fairseq-train flags (lowmem plan prints them), not a Techniques")
    return ["--arch", req.spec.name, "--task", "translation", "--criterion", "label_smoothed_cross_entropy",
            "--optimizer", FAIRSEQ_OPTIMIZERS[req.optimizer], "--lr", "0.0005", "--max-tokens", str(_tokens(req) // req.devices)]


def _tokens(req: Request) -> int:
    return req.tokens or req.batch * req.input[0]


SHAPES = ("cpu", "meta")  # what a step is accounted on: fake CPU tensors, or the meta device


def _shapes(shapes: str, tech: Techniques) -> tuple[Any, torch.device]:
    """(context, device) of tensors with shapes and dtypes only. Fake CPU tensors by default: an op's CPU kernel
    and its meta kernel may save different tensors for backward (attention: the CPU's flash kernel keeps a
    log-sum-exp, the meta device's math path the whole attention matrix), and on fake CPU tensors PyTorch picks
    the CPU's kernel, as the real step does. Mixed precision needs them anyway (autocast acts on a device type)."""
    if shapes not in SHAPES:
        raise SpecError(f"shapes={shapes!r} is not one of {', '.join(SHAPES)}")
    if shapes == "cpu" or precision.parse(tech.precision).kind == "mixed":
        return FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu")
    return nullcontext(), torch.device("meta")


def account(req: Request, tech: Techniques = Techniques(), workspace: Workspace | None = None, examples: int | None = None,
            shapes: str = "cpu", segments: list[list[Segment]] | None = None) -> MemoryReport:
    """The accounted report of one step at full size, on tensors of shapes only (``_shapes``: fake CPU tensors, or
    the meta device).
    ``workspace`` adds each op's internal scratch (``lowmem.memory.measure.CPUWorkspace``). ``examples``: step on
    the batch's first examples only, which ``lowmem.cli.plan`` uses to follow microbatches 1, 2 and the last one
    of a long accumulation (the others repeat microbatch 2's memory, as ``lowmem.wrn.memory`` explains)."""
    if req.spec.kind == "fairseq":
        from lowmem.dynamicconv import memory as fairseq_memory  # fairseq is imported only for a fairseq model
        # --max-tokens is per device in fairseq: each of the devices takes its share of the request's tokens.
        return fairseq_memory.account(_fairseq_args(req, tech), req.vocab, req.vocab, _tokens(req) // req.devices,
                                      req.input[0], shard=req.sharding)
    # Built on meta first: a model that deep-copies its layers (nn.TransformerEncoder) would copy fake tensors
    # into a fake mode of their own, which PyTorch cannot mix.
    model = precision.prepare(models.build(req.spec, "meta"), precision.parse(tech.precision))
    shard = req.sharding
    # FSDP2 places its shards on a device mesh of a real device type, so a sharded step is accounted on fake CPU
    # tensors, beside a fake process group (lowmem.techniques.sharding.fake_group).
    ctx, device = _shapes("cpu" if shard.active else shapes, tech)
    with ctx, sharding.fake_group(shard.devices) if shard.active else nullcontext():
        if device.type != "meta":
            models.to_empty(model, device)
        step, model, opt, batch = step_of(req, tech, device, examples, model, segments)
        return account_step(step, model, opt, batch, workspace=workspace, held=sharding.held_buckets(model, shard))


def measure(req: Request, tech: Techniques = Techniques()) -> tuple[MemoryReport, int | None]:
    """(``account``'s report with the step's peak measured on the CPU beside it (``lowmem.memory.measure``), the
    account with each op's CPU workspace added, where the step is not fairseq's)."""
    if req.sharding.active:
        raise SpecError("--measure runs one process; a sharded step is measured by torchrun processes "
                        "(python -m lowmem.studies.shard_run, docs/sharding.md)")
    report, with_workspace = account(req, tech), None
    if req.spec.kind == "fairseq":
        from lowmem.dynamicconv import memory as fairseq_memory
        peak, method = fairseq_memory.measure(_fairseq_args(req, tech), req.vocab, req.vocab, _tokens(req), req.input[0])
    else:
        step, model, opt, batch = step_of(req, tech, "cpu")
        peak, method = measure_step(step, model, opt, batch)
        with_workspace = account(req, tech, workspace=CPUWorkspace()).peak
    return dataclasses.replace(report, measured_peak=peak, measured_method=method), with_workspace
