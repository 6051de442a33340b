"""The optimizer of a run, as a lever: the recipe's SGD; torch-optimi's SGD, whose Kahan-compensated update keeps
16-bit weights from losing small steps to rounding; or bitsandbytes' SGD with its momentum stored in 8 bits.

A lever beyond Sohoni et al. (2019). In half-bf16 every weight is stored in bf16, whose 8-bit mantissa rounds away
any update smaller than half a unit in the last place: with lr 0.1 and a gradient of 1e-3, a weight near 1 moves by
1e-4, below bf16's spacing of 2^-8 there, so it never moves at all. Kahan summation keeps, per weight, the part of
each update that rounding dropped (a bf16 compensation buffer, counted as optimizer state) and adds it back on the
next step. torch-optimi's optimizers do this on the CPU (``kahan_sum``, on by default for 16-bit parameters).

- ``sgd``: ``torch.optim.SGD`` with the recipe's Nesterov momentum (``lowmem.wrn.recipe``).
- ``optimi-sgd``: ``optimi.SGD``, heavy-ball momentum with L2 weight decay, Kahan summation where the parameters are
  16-bit. optimi's SGD has no Nesterov momentum, so this arm changes the recipe in one more way than Kahan
  summation; in fp32 (no compensation) it measures that change alone.
- ``bnb-sgd8bit``: ``bitsandbytes.optim.SGD8bit``, the same heavy-ball update with L2 weight decay as ``optimi-sgd``
  in fp32 (both are tested equal to ``torch.optim.SGD`` without Nesterov), with the momentum of every parameter of at
  least ``MIN_8BIT_SIZE`` elements stored block-wise in 8 bits (Dettmers et al. 2022): one uint8 code per element, an
  fp32 absolute maximum per block of ``BLOCK`` elements, and one 256-entry fp32 code book (the signed dynamic map)
  shared by the whole optimizer. Smaller parameters keep fp32 momentum. Each step dequantizes a parameter's momentum
  to fp32, updates it and quantizes it back. bitsandbytes' CPU kernel does that in plain torch ops, so it runs here
  (torchao's 8-bit optimizers are Adam only, which is DynamicConv's, not the WRN recipe's SGD).

DynamicConv's counterpart of ``optimi-sgd`` is ``adamw_kahan`` (the fairseq plugin's ``lowmem_adamw_kahan``):
torch-optimi's AdamW, with Kahan summation where the parameters are 16-bit. In fp32 it is torch's AdamW (tested to
rounding). In bf16 it differs from the plugin's all-bf16 AdamW by the compensation, and in how optimi keeps its
moments (debiased, updated by ``lerp``), which rounds differently; with the compensation off it loses small updates
as all-bf16's AdamW does (tested).

Where the state is block-quantized, DSR cannot move single momentum values between positions as codes: ``realign``
dequantizes, moves and requantizes them.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

OPTIMIZERS = ("sgd", "optimi-sgd", "bnb-sgd8bit")
BLOCK = 256  # elements per absmax of bitsandbytes' block-wise 8-bit state (fixed in its CPU and CUDA kernels)
MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller parameters keep fp32 state (their share of the bytes is small)
_LIBRARIES = {"optimi-sgd": ("optimi", "torch-optimi"), "bnb-sgd8bit": ("bitsandbytes", "bitsandbytes")}

LEVERS = (  # lowmem.techniques.registry
    dict(
        name="kahan",
        what="16-bit weights updated with Kahan summation: a 16-bit buffer keeps what each update lost to rounding",
        settings=("optimi-sgd",),
        field="optimizer",
        short="",
        wrn="Techniques(optimizer=optimi-sgd): torch-optimi's SGD (heavy-ball; in fp32, the control arm)",
        fairseq="the plugin's --optimizer lowmem_adamw_kahan (torch-optimi's AdamW) under --precision half-bf16",
        any_model="lowmem plan --optimizer-state kahan (sgd-momentum under half-bf16)",
        accounted="the compensation buffer, in the weights' dtype, counted as optimizer state",
        exact="lossy",
        proof="tests/test_optimizers.py::test_kahan_keeps_the_updates_that_bf16_rounds_away",
        quality="metrics/levers_train.json",
    ),
    dict(
        name="8-bit-state",
        what="the optimizer's state stored block-wise in 8 bits (bitsandbytes), dequantized for each step",
        settings=("bnb-sgd8bit",),
        field="optimizer",
        short="",
        wrn="Techniques(optimizer=bnb-sgd8bit): bitsandbytes' SGD8bit (heavy-ball momentum in 8 bits)",
        fairseq="the plugin's --optimizer lowmem_adamw8bit (bitsandbytes' AdamW8bit: both moments in 8 bits)",
        any_model="lowmem plan --optimizer-state 8-bit (sgd-momentum, adamw); lowmem profile --optimizer adamw-8bit",
        accounted="one uint8 code per element, an fp32 maximum per block of 256 and the 256-entry code book",
        exact="lossy",
        proof="tests/test_optimizer_state.py::test_each_step_is_the_fp32_update_of_the_dequantized_momentum_and_stores_it_within_half_a_code",
        quality="metrics/levers_state_train.json",
    ),
)


def check(name: str) -> None:
    """Raises ValueError for an unknown optimizer, and for optimi-sgd where torch-optimi is not installed."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} is not one of {', '.join(OPTIMIZERS)}")
    if name in _LIBRARIES:
        _require(*_LIBRARIES[name], f"optimizer={name!r}")


def _require(module: str, package: str, what: str) -> None:
    """Raises ValueError, saying what to install, where ``module`` (from the pinned ``package``) is missing."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{what} needs {package}, which is not installed: `make setup` installs the pinned {package} "
                         "(requirements-2.txt)")


def make(params: Iterable[torch.Tensor], name: str, lr: float, momentum: float, nesterov: bool,
         weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params`` (``nesterov`` applies to ``sgd`` only: optimi's and bitsandbytes' SGD
    have none)."""
    check(name)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    if name == "bnb-sgd8bit":
        return _on_cpu(bnb_optim().SGD8bit, params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=False,
                       min_8bit_size=MIN_8BIT_SIZE)
    import optimi

    # foreach=False: one parameter at a time, as the accountant's meta tensors and the CPU run alike take it.
    return optimi.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=False)


def bnb_optim() -> Any:
    """``bitsandbytes.optim``, imported without its warning that the kernels package for 4-bit matrix products on
    AVX-512 CPUs is missing: lowmem uses its optimizers only, which do not need it."""
    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = cpu_ops.level
    cpu_ops.setLevel(logging.ERROR)
    try:
        import bitsandbytes.optim
    finally:
        cpu_ops.setLevel(level)
    return bitsandbytes.optim


def adamw8bit(params: Iterable[torch.Tensor], **options: Any) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW with both moments block-wise in 8 bits (``MIN_8BIT_SIZE``, ``BLOCK``): DynamicConv's lever
    (the fairseq plugin's ``lowmem_adamw8bit``) and ``lowmem profile --optimizer adamw-8bit``'s."""
    _require("bitsandbytes", "bitsandbytes", "8-bit AdamW (adamw-8bit, the plugin's lowmem_adamw8bit)")
    return _on_cpu(bnb_optim().AdamW8bit, params, **options, min_8bit_size=MIN_8BIT_SIZE)


def adamw_kahan(params: Iterable[torch.Tensor], **options: Any) -> torch.optim.Optimizer:
    """torch-optimi's AdamW (decoupled weight decay, as torch's AdamW) with Kahan summation on wherever a parameter is
    16-bit (optimi's default): per such parameter a compensation buffer in its dtype beside the two moments, all
    three counted as optimizer state. In fp32 there is no buffer and the update is torch's AdamW to rounding. The
    compensated step uses each ``.grad`` as scratch space, so whatever reads the gradients must do so before it."""
    _require("optimi", "torch-optimi", "Kahan-compensated AdamW (the plugin's lowmem_adamw_kahan)")
    import optimi

    # foreach=False: foreach would hold every parameter's temporaries at once; one parameter at a time, as torch's
    # AdamW steps on the CPU (lowmem_adamw), keeps the two levers' peaks comparable.
    return optimi.AdamW(params, **options, foreach=False)


def _on_cpu(cls: Any, params: Iterable[torch.Tensor], **options: Any) -> torch.optim.Optimizer:
    # bitsandbytes builds its code books from values at construction, which neither an accountant's default meta
    # device (lowmem.wrn.memory) nor its fake tensors (lowmem.cli.profile) hold: they are built as real CPU tensors,
    # and the first step moves them to the parameters' device.
    with unset_fake_temporarily(), torch.device("cpu"):
        return cls(params, **options)


def dequantized(state: dict[str, Any], i: int = 1) -> torch.Tensor:
    """bitsandbytes' block-wise 8-bit state tensor ``i`` (1: momentum or Adam's first moment, 2: Adam's second) of
    one parameter, as the fp32 values its step computes with."""
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_blockwise(state[f"state{i}"], absmax=state[f"absmax{i}"], code=state[f"qmap{i}"], blocksize=BLOCK)


def realign(state: dict[str, Any], shape: torch.Size, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Applies ``move`` (survivors kept, new positions zero; lowmem.techniques.sparsity's DSR) to the per-element
    state of one parameter of ``shape``, in place of ``state``. bitsandbytes' block-wise 8-bit state is dequantized,
    moved and quantized again with new block maxima, since a code means nothing outside its block."""
    for i in (1, 2):
        if f"absmax{i}" in state and state[f"state{i}"].dtype == torch.uint8:
            import bitsandbytes.functional as bnbf

            codes, qs = bnbf.quantize_blockwise(move(dequantized(state, i)), code=state[f"qmap{i}"], blocksize=BLOCK)
            state[f"state{i}"], state[f"absmax{i}"] = codes, qs.absmax
    for key, s in list(state.items()):
        if isinstance(s, torch.Tensor) and s.shape == shape and s.dtype != torch.uint8:
            state[key] = move(s)
