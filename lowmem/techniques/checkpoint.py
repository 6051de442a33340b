"""Gradient checkpointing of a chain of blocks (Sohoni et al. 2019, Sec. 4, "gradient checkpointing").

A checkpointed segment keeps only its input during the forward pass and recomputes its internals when the backward
pass reaches it, through ``torch.utils.checkpoint`` (non-reentrant). Strategies, as spec strings:

- ``none``; ``block``: every residual block its own segment; ``every-K``: segments of K blocks;
- ``sqrt``: segments of ceil(sqrt(n)) blocks (Chen et al. 2016);
- ``selective``: every block, but conv outputs are saved and only BN and ReLU recomputed (PyTorch's selective
  checkpoint policies);
- ``optimal-B``: the segmentation with the least modelled peak whose recompute stays within B times one forward
  pass of the chain (dynamic programming over the chain, on per-block costs from the accountant).

Two things go wrong with naive recomputation, and both are handled: BatchNorm would update its running statistics a
second time (the recompute restores them), and dropout would draw a new mask (``torch.utils.checkpoint`` restores
the RNG state, ``preserve_rng_state=True``).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from lowmem.memory.ledger import forward_saved_bytes, recomputing

STRATEGIES = ("none", "block", "every-K", "sqrt", "selective", "optimal-B")  # as written in a spec

LEVER = dict(  # lowmem.techniques.registry
    name="checkpointing",
    what="segments of the model's chains of blocks recomputed in backward instead of saving their activations",
    settings=STRATEGIES,
    field="checkpoint",
    short="checkpoint-STRATEGY",
    wrn="Techniques(checkpoint=STRATEGY): torch.utils.checkpoint over the planned segments",
    fairseq="--checkpoint-activations (fairseq's transformer; the plugin adds it to lightconv)",
    any_model="lowmem plan's checkpoint column: the DP planner's placement for the budget",
    accounted="the step accounted with checkpoint's hooks: a segment's inputs saved, its inside recomputed",
    exact="bit-exact",
    proof="tests/test_checkpoint.py::test_checkpointing_is_bit_equal_in_every_precision_and_with_sparse_layers",
    quality="",
)

Segment = tuple[int, int, bool]  # blocks [start, end), recomputed or not


@dataclass(frozen=True)
class BlockCost:
    """One block of the chain: the bytes of its input, all bytes it saves for backward (its input included when
    saved), and its forward FLOPs."""

    input_bytes: int
    saved_bytes: int
    flops: int


def parse(spec: str) -> tuple[str, float]:
    """'every-3' -> ('every', 3.0); 'optimal-0.5' -> ('optimal', 0.5); 'block' -> ('block', 0.0)."""
    name, _, arg = spec.partition("-")
    try:
        value = float(arg) if arg else 0.0
    except ValueError:
        value = -1.0
    ok = name in PLANNERS and (bool(arg) == (name in ARGUMENT_OK)) and (name not in ARGUMENT_OK or ARGUMENT_OK[name](value))
    if not ok:
        raise ValueError(f"unknown checkpoint strategy {spec!r}; use one of {', '.join(STRATEGIES)} (K an integer >= 1, B >= 0)")
    return name, value


def block_costs(blocks: nn.Sequential, x: torch.Tensor) -> list[BlockCost]:
    """Per-block costs for an input like ``x`` (meta tensors are enough)."""
    costs = []
    for block in blocks:
        x = x.detach().requires_grad_()
        saved = forward_saved_bytes(block, x)
        with FlopCounterMode(display=False) as fc:
            out = block(x)
        costs.append(BlockCost(x.untyped_storage().nbytes(), saved, fc.get_total_flops()))
        x = out
    return costs


def modelled(costs: list[BlockCost], segments: list[Segment]) -> tuple[int, int]:
    """(peak activation bytes, recompute FLOPs) under the planner's model: a plain block keeps what it saves, a
    checkpointed segment keeps its input, and the peak adds the largest segment's recomputed internals."""
    stored = extra = recompute = 0
    for s, e, ckpt in segments:
        if not ckpt:
            stored += sum(c.saved_bytes for c in costs[s:e])
            continue
        stored += costs[s].input_bytes
        extra = max(extra, sum(c.saved_bytes for c in costs[s:e]) - costs[s].input_bytes)
        recompute += sum(c.flops for c in costs[s:e])
    return stored + extra, recompute


def frontier(costs: list[BlockCost], lengths: list[int] | None = None) -> list[tuple[int, int, list[Segment]]]:
    """Every segmentation on the memory-recompute Pareto front, as (peak bytes, recompute FLOPs, segments).

    The peak's max term is not additive, so the DP runs once per candidate cap T on a segment's recomputed extra;
    under a cap, the stored bytes and the recompute both add up over the chain, and a Pareto set per prefix is exact.
    ``lengths``: the costs are several chains run one after the other (a ResNet's four stages), of these lengths;
    a segment never crosses from one to the next (``split`` gives each chain its own segments back).
    """
    n = len(costs)
    if lengths is not None and sum(lengths) != n:
        raise ValueError(f"chains of lengths {lengths} hold {sum(lengths)} blocks, not the {n} costed")
    ends = set(itertools.accumulate(lengths or [n]))
    chain = [sum(e <= i for e in ends) for i in range(n)]  # which chain block i is in
    saved = [0] * (n + 1)
    flops = [0] * (n + 1)
    for i, c in enumerate(costs):
        saved[i + 1], flops[i + 1] = saved[i] + c.saved_bytes, flops[i] + c.flops
    extra = {(j, i): saved[i] - saved[j] - costs[j].input_bytes for j in range(n) for i in range(j + 1, n + 1)
             if chain[j] == chain[i - 1]}
    points: list[tuple[int, int, list[Segment]]] = []
    for cap in sorted({0, *extra.values()}):
        best: list[list[tuple[int, int, list[Segment]]]] = [[(0, 0, [])]] + [[] for _ in range(n)]
        for i in range(1, n + 1):
            cands = [(m + costs[i - 1].saved_bytes, r, segs + [(i - 1, i, False)]) for m, r, segs in best[i - 1]]
            for j in range(i):
                if extra.get((j, i), cap + 1) <= cap:
                    cands += [(m + costs[j].input_bytes, r + flops[i] - flops[j], segs + [(j, i, True)]) for m, r, segs in best[j]]
            best[i] = _pareto(cands)
        points += [modelled(costs, segs) + (segs,) for _, _, segs in best[n]]
    return _pareto(points)


def _pareto(points: list[tuple[int, int, list[Segment]]]) -> list[tuple[int, int, list[Segment]]]:
    out: list[tuple[int, int, list[Segment]]] = []
    for m, r, segs in sorted(points, key=lambda p: (p[1], p[0])):  # by recompute, then memory
        if not out or m < out[-1][0]:
            out.append((m, r, segs))
    return out


def split(segments: list[Segment], lengths: list[int]) -> list[list[Segment]]:
    """The segments of ``frontier(costs, lengths)`` per chain, each counted from its chain's first block."""
    out, start = [], 0
    for n in lengths:
        out.append([(s - start, e - start, c) for s, e, c in segments if start <= s < start + n])
        start += n
    return out


def optimal(costs: list[BlockCost], max_recompute: float | None = None, max_memory: float | None = None,
            lengths: list[int] | None = None) -> list[Segment]:
    """The least-memory segmentation within a recompute budget (FLOPs), or the least-recompute one within a memory
    budget (bytes)."""
    front = frontier(costs, lengths)
    if max_memory is not None:
        fits = [p for p in front if p[0] <= max_memory]
        if not fits:
            raise ValueError(f"no segmentation fits in {max_memory} bytes; the least needs {min(p[0] for p in front)}")
        return min(fits, key=lambda p: (p[1], p[0]))[2]
    fits = [p for p in front if max_recompute is None or p[1] <= max_recompute]
    return min(fits, key=lambda p: (p[0], p[1]))[2]


def _every(n: int, k: int) -> list[Segment]:
    return [(s, min(s + k, n), True) for s in range(0, n, k)]


def _optimal(n: int, budget: float, costs: list[BlockCost] | None) -> list[Segment]:
    if costs is None:
        raise ValueError("the optimal strategy needs the chain's block costs")
    return optimal(costs, max_recompute=budget * sum(c.flops for c in costs))


# The strategies, by name: each plans the segments of a chain of n blocks from the spec's argument (and, for the
# planner, the blocks' costs). ``selective`` checkpoints every block but saves its convolutions' outputs.
Planner = Callable[[int, float, list[BlockCost] | None], list[Segment]]
PLANNERS: dict[str, Planner] = {
    "none": lambda n, _, __: [(0, n, False)],
    "block": lambda n, _, __: _every(n, 1),
    "selective": lambda n, _, __: _every(n, 1),
    "sqrt": lambda n, _, __: _every(n, math.ceil(math.sqrt(n))),
    "every": lambda n, k, __: _every(n, int(k)),
    "optimal": _optimal,
}
# The strategies that take an argument, and what it must satisfy.
ARGUMENT_OK: dict[str, Callable[[float], bool]] = {"every": lambda k: k >= 1 and k == int(k), "optimal": lambda b: b >= 0}


def plan(spec: str, n: int, costs: list[BlockCost] | None = None) -> list[Segment]:
    name, value = parse(spec)
    return PLANNERS[name](n, value, costs)


def _save_conv_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # type: ignore[no-untyped-def]
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.convolution.default else CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def _keep_batchnorm_stats(modules: list[nn.Module]) -> Iterator[None]:
    # The recompute runs BN in training mode again, which would move its running statistics a second time.
    bns = [m for mod in modules for m in mod.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    kept = [[b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None] for m in bns]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, k in zip(bns, kept):
                for buf, old in zip([b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None], k):
                    buf.copy_(old)


# Tensors the selective policy saves then pass through outer saved-tensor hooks, as the accountant's, like any other
# saved tensor. Older PyTorch (2.11, on the GPU check's machine) lacks the argument and would hand it to the function.
_HOOKS = {"respect_saved_tensors_hooks": True} if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {}


class CheckpointedChain(nn.Sequential):
    """The blocks of an ``nn.Sequential`` (same children, same state_dict keys) run segment by segment."""

    def __init__(self, blocks: nn.Sequential, segments: list[Segment], selective: bool = False) -> None:
        super().__init__(*blocks)
        self.segments, self.selective = segments, selective

    def _contexts(self, start: int, end: int):  # type: ignore[no-untyped-def]
        fwd, rec = create_selective_checkpoint_contexts(_save_conv_outputs) if self.selective else (nullcontext(), nullcontext())
        # The BN snapshot is taken before, and restored after, the selective-checkpoint mode (which replays only
        # the ops it recorded in the forward pass).
        return fwd, _Together(_keep_batchnorm_stats(list(self)[start:end]), recomputing(), rec)

    def _run(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        for block in list(self)[start:end]:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s, e, ckpt in self.segments:
            if ckpt and torch.is_grad_enabled():
                x = checkpoint(self._run, x, s, e, use_reentrant=False, context_fn=partial(self._contexts, s, e), **_HOOKS)
            else:
                x = self._run(x, s, e)
        return x


class _Together:
    """Several context managers entered as one (checkpoint's context_fn wants exactly two objects)."""

    def __init__(self, *cms) -> None:  # type: ignore[no-untyped-def]
        self.cms, self.stack = cms, ExitStack()

    def __enter__(self) -> None:
        for cm in self.cms:
            self.stack.enter_context(cm)

    def __exit__(self, *exc) -> bool:  # type: ignore[no-untyped-def]
        return self.stack.__exit__(*exc)


def apply(model: nn.Module, spec: str, input_shape: tuple[int, ...] | None = None) -> nn.Module:
    """Checkpoints ``model.blocks`` (an ``nn.Sequential``, as in ``lowmem.wrn.models``) with strategy ``spec``, in place.
    ``optimal-B`` needs ``input_shape`` (the shape of a batch) to cost the blocks."""
    name, _ = parse(spec)
    blocks = model.blocks
    if name == "none":
        return model
    costs = None
    if name == "optimal":
        if input_shape is None:
            raise ValueError("checkpoint strategy 'optimal-B' needs the batch's input shape to cost the blocks")
        costs = chain_costs(model, input_shape)
    model.blocks = CheckpointedChain(blocks, plan(spec, len(blocks), costs), selective=name == "selective")
    return model


def chain_costs(model: nn.Module, input_shape: tuple[int, ...]) -> list[BlockCost]:
    """Block costs of ``model.blocks`` for a batch of ``input_shape``, on a meta copy of the model (no compute)."""
    meta = copy.deepcopy(model).to("meta")
    seen: list[torch.Tensor] = []
    hook = meta.blocks.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    with torch.no_grad():
        meta(torch.empty(input_shape, device="meta"))
    hook.remove()
    return block_costs(meta.blocks, seen[0])
