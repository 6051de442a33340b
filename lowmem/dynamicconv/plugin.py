"""The four techniques on DynamicConv (Sohoni et al. 2019, the translation benchmark), as a fairseq ``--user-dir``
plugin rather than a fork: ``fairseq-train --user-dir lowmem/fairseq_user_dir/lowmem_fairseq --task lowmem_translation
--arch lowmem_lightconv_iwslt_de_en ...``.

fairseq already has two of the levers, and they are used as they are:

- low precision: ``--fp16`` (fp16 weights and activations, fp32 master weights in the optimizer; CUDA only in
  fairseq 0.12), ``--memory-efficient-fp16`` (no fp32 copy; fairseq's Adam keeps its state in fp32), ``--amp``
  (torch's CUDA autocast; a no-op on CPU). fairseq 0.12's ``--bf16`` means TPU and does not run elsewhere;
- gradient accumulation: ``--update-freq k`` (k batches per update). With ``--max-tokens T/k`` it is not an exact
  microbatching of the baseline's update: fairseq forms other, smaller batches, with other sentences, padding and
  tokens per update. The task's ``--microbatches k`` (below) is the exact lever.

fairseq 0.12 has no 16-bit training on the CPU: ``--fp16`` builds its fp32 copy on CUDA, ``--memory-efficient-fp16``
calls ``.cuda()`` at the first overflow, and ``--bf16`` turns on ``--tpu``. So the plugin adds bf16 as a model
option, with the WRN track's names (``lowmem.techniques.precision``), which needs no loss scaling (bf16 has fp32's
exponent range):

- ``--precision mixed-bf16``: the forward pass under ``torch.autocast`` (bf16 activations); weights, gradients and
  Adam's state stay fp32. Works with fairseq's own Adam.
- ``--precision half-bf16``: the model cast to bf16, so weights and gradients are bf16. fairseq's Adam always keeps
  fp32 state (it upcasts each parameter), which gives "bf16 weights, fp32 Adam state"; ``--optimizer lowmem_adamw``
  (below) keeps the state in the parameters' dtype, which makes everything 16-bit.

The plugin adds the other two techniques, as options of the model:

- ``--checkpoint-activations``, named as the transformer's: each encoder and decoder layer wrapped in fairseq's
  own ``checkpoint_wrapper``, which lightconv does not offer;
- ``--sparsity S`` with ``--sparse-method dsr|static``: the linear maps inside the encoder and decoder layers (the
  layers' in/out projections, the FFN, DynamicConv's kernel-predicting linear and the encoder-decoder attention's
  projections) stored as ``lowmem.techniques.sparse_linear.SparseLinear`` and trained with ``lowmem.techniques.sparsity.DSR``. The two
  embedding tables and the output projection stay dense: each of their rows is one word's vector, so a sparse
  pattern would cut words rather than connections (the WRN recipe keeps its stem and classifier dense likewise).

Beyond the paper, ``--activation-bits 2|4|8|16`` stores what autograd saves for the backward pass in fewer bits
(``lowmem.techniques.compress``, ActNN's method, the WRN track's lever): the model's forward pass and the criterion's
log-softmax run inside its ``saved_tensors_hooks``. The forward pass is unchanged; the gradients are those computed
from the rounded activations. With ``--checkpoint-activations`` the layers' inputs, which fairseq's checkpoint saves,
are packed, and what a layer recomputes in the backward pass is kept as it is; so checkpointing is no longer exact.

Also beyond the paper, ``--optimizer lowmem_adamw_kahan`` (torch-optimi's AdamW) keeps, under ``--precision
half-bf16``, a bf16 Kahan compensation per weight, so that updates smaller than bf16's spacing are not rounded away:
all-bf16 without the rounding loss, at one more bf16 copy of the weights.

Microbatching, exactly: ``--microbatches k`` splits each batch that ``--max-tokens`` forms into sub-batches of its
own sentences, each at most max-tokens/k tokens with its padding, and accumulates them into the same update.
DynamicConv normalizes with LayerNorm, which has no batch statistics, so with dropout off the gradient is the whole
batch's up to the order of the sums; with dropout on, the masks are other draws from the same distribution.

DSR rewires after optimizer steps, which a model cannot see, so ``lowmem_translation`` is fairseq's translation
task with ``optimizer_step`` extended by one call. DSR's state (threshold, step, random stream) travels in the
model's state dict, so fairseq's own checkpoints resume it.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
from collections.abc import Collection
from dataclasses import dataclass, field, make_dataclass
from typing import Any

import numpy as np
import torch
from fairseq.logging import metrics
from fairseq.models import register_model, register_model_architecture
from fairseq.models.lightconv import LightConvModel, lightconv_iwslt_de_en
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.optim import FairseqOptimizer, register_optimizer
from fairseq.optim.adam import FairseqAdamConfig
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from lowmem.dynamicconv.microbatch import part_sizes, split_batch
from lowmem.techniques import compress, optimizers, sparse_linear, sparsity

ARCH = "lowmem_lightconv_iwslt_de_en"
TASK = "lowmem_translation"
OPTIMIZER = "lowmem_adamw"
OPTIMIZER_8BIT = "lowmem_adamw8bit"
OPTIMIZER_KAHAN = "lowmem_adamw_kahan"
PRECISIONS = ("fp32", "mixed-bf16", "half-bf16")


def default_reallocate_fraction() -> float:
    """The recipe's 20,000 moved weights as a fraction of WRN-28-2's sparse-layer weights, so that a model of
    another size moves the same share of its sparse weights."""
    return sparsity.RECIPE_REALLOCATE / sparsity.RECIPE_SPARSE_WEIGHTS


def sparse_candidates(model: torch.nn.Module) -> list[str]:
    """The ``nn.Linear`` modules inside the encoder and decoder layers (embeddings and output projection excluded)."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(("encoder.layers.", "decoder.layers."))]


def _periods(text: str) -> tuple[int, ...]:
    try:
        periods = tuple(int(v) for v in json.loads(text))
    except (ValueError, TypeError) as e:
        raise ValueError(f"--dsr-periods must be a list of four update counts such as '[100,200,400,800]', got {text!r}") from e
    if len(periods) != 4 or min(periods) < 1:
        raise ValueError(f"--dsr-periods needs four periods >= 1 (from 0, 12.5, 40 and 70% of --max-update), got {text!r}")
    return periods


def _autocast_forward(module: torch.nn.Module) -> None:
    """Runs ``module``'s forward under bf16 autocast. Applied to each layer before ``checkpoint_wrapper``, so that
    the recomputation in the backward pass, which fairseq's checkpoint runs outside the model's forward and without
    restoring autocast, recomputes the same bf16 activations.

    Without autocast's cast cache: the cache holds one bf16 copy of each leaf tensor that needs a gradient, and the
    recomputation's inputs are such leaves (checkpoint detaches them). A decoder layer would then cast the encoder
    output once for its key and value projections and sum their gradients in bf16, where the plain step casts it
    twice and sums in fp32; without the cache both casts twice, and the gradients are the plain step's bit for bit
    (tests/test_translation_techniques.py). Each weight is used once per layer, so the cache saved no cast there."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        device = next(module.parameters()).device.type
        with torch.autocast(device, dtype=torch.bfloat16, cache_enabled=False):
            return inner(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


@register_model("lowmem_lightconv")
class LowmemLightConvModel(LightConvModel):
    """fairseq's LightConvModel with optional sparse layers and per-layer activation checkpointing."""

    dsr: sparsity.DSR | None = None
    precision: str = "fp32"  # --precision, set by build_model
    activation_bits: int = 0  # --activation-bits, set by build_model; 0: saved tensors kept as they are

    @staticmethod
    def add_args(parser: Any) -> None:
        LightConvModel.add_args(parser)
        parser.add_argument("--checkpoint-activations", action="store_true",
                            help="recompute each encoder and decoder layer in the backward pass (fairseq's checkpoint_wrapper): "
                                 "keeps only each layer's input, for about one more forward pass of compute")
        parser.add_argument("--sparsity", type=float, metavar="S",
                            help="fraction of zero weights in the layers' linear maps, 0 <= S < 1 (0: dense); stored compressed, "
                                 "so weights, gradients and Adam state shrink, at the cost of the dense weight rebuilt in each pass")
        parser.add_argument("--sparse-method", choices=sparsity.METHODS,
                            help="dsr: random initial pattern rewired by DSR during training; static: the largest weights at "
                                 "initialization, never moved (cheaper, usually less accurate)")
        parser.add_argument("--dsr-reallocate", type=float, metavar="F",
                            help="weights moved per DSR rewiring, as a fraction of the sparse layers' dense weight count "
                                 "(default: the WRN recipe's 20,000 scaled by size); more moves explore faster but disturb training more")
        parser.add_argument("--dsr-periods", type=str, metavar="LIST",
                            help="DSR rewiring periods in updates from 0, 12.5, 40 and 70%% of --max-update, e.g. '[100,200,400,800]' "
                                 "(none after 95%%); shorter periods adapt more and cost more rewirings")
        parser.add_argument("--precision", choices=PRECISIONS,
                            help="bf16 training that runs on the CPU: mixed-bf16 runs the forward pass under autocast (bf16 "
                                 "activations, fp32 weights, gradients and Adam state); half-bf16 casts the model (bf16 weights "
                                 "and gradients; add --optimizer lowmem_adamw for bf16 Adam state too). Less memory, at the cost "
                                 "of rounding in every op; for CUDA fp16 use --fp16")
        parser.add_argument("--activation-bits", type=int, choices=(0, *compress.BITS), metavar="BITS",
                            help="beyond the paper: store what autograd saves for the backward pass (each layer's activations, "
                                 "the loss's log-probabilities; with --checkpoint-activations, the layers' inputs) in "
                                 f"{', '.join(map(str, compress.BITS))} bits, per group of {compress.GROUP} values a minimum and a "
                                 "step (ActNN's method), instead of 32 (0: off, the default). Less activation memory, at the cost "
                                 "of gradients computed from rounded activations and a pack and unpack of each saved tensor")

    @classmethod
    def build_model(cls, args: Any, task: Any) -> LowmemLightConvModel:
        if not 0.0 <= args.sparsity < 1.0:
            raise ValueError(f"--sparsity must be in [0, 1), got {args.sparsity}")
        periods = _periods(args.dsr_periods)
        dsr = args.sparsity > 0 and args.sparse_method == "dsr"
        if dsr and getattr(args, "fp16", False) and not getattr(args, "memory_efficient_fp16", False):
            # FP16Optimizer flattens the fp32 copy at fixed per-layer sizes; DSR moves nonzeros between layers.
            raise ValueError("--sparsity with --sparse-method dsr cannot run with --fp16; use --memory-efficient-fp16")
        if args.precision != "fp32" and (getattr(args, "fp16", False) or getattr(args, "bf16", False)):
            raise ValueError(f"--precision {args.precision} is the plugin's bf16 and cannot be combined with fairseq's "
                             "--fp16/--memory-efficient-fp16/--bf16; use one of them")
        base = LightConvModel.build_model(args, task)
        model = cls(base.encoder, base.decoder)
        model.precision = args.precision
        model.activation_bits = args.activation_bits
        if args.sparsity > 0:
            layers = sparse_linear.sparsify(model, sparse_candidates(model), args.sparsity, args.sparse_method, seed=getattr(args, "seed", 1))
            total = getattr(args, "max_update", 0)
            if dsr and total > 0:
                dense = sum(layer.shape.numel() for layer in layers.values())
                model.dsr = sparsity.DSR(layers, total_steps=total, reallocate=max(1, round(args.dsr_reallocate * dense)),  # type: ignore[arg-type]
                                         periods=periods, seed=getattr(args, "seed", 1))
        for layer in [*model.encoder.layers, *model.decoder.layers]:
            if args.precision == "mixed-bf16":
                _autocast_forward(layer)
            if args.checkpoint_activations:
                checkpoint_wrapper(layer)
        if args.precision == "half-bf16":
            model.to(torch.bfloat16)  # after sparsify: the sparse layers' values become bf16 too, indices stay int
        return model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Autocast around the whole model (embeddings and the output projection, the largest matmul, included);
        # the layers carry their own for checkpointing's recomputation. Generation calls encoder and decoder
        # directly, so a mixed-bf16 model translates in fp32. The compressing hooks are entered here, not around
        # the backward pass: checkpointing's recomputation then saves its tensors as they are, as on the WRN track.
        with compress.compressing(self.activation_bits):
            if self.precision != "mixed-bf16":
                return super().forward(*args, **kwargs)  # autocast refuses the meta device even when disabled
            with torch.autocast(next(self.parameters()).device.type, dtype=torch.bfloat16):
                return super().forward(*args, **kwargs)

    def get_normalized_probs(self, net_output: Any, log_probs: bool, sample: Any = None) -> Any:
        # The criterion takes the log-softmax outside forward; its output, saved for backward, is the update's
        # largest activation (tokens x target vocabulary).
        with compress.compressing(self.activation_bits):
            return super().get_normalized_probs(net_output, log_probs, sample)

    def get_extra_state(self) -> dict[str, Any]:
        return self.dsr.state_dict() if self.dsr is not None else {}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if self.dsr is not None and state:
            self.dsr.load_state_dict(state)

    def load_state_dict(self, state_dict: Any, strict: bool = True, model_cfg: Any = None, args: Any = None) -> Any:
        sparsity.resize_to(self, state_dict)  # DSR moved nonzeros between layers
        for layer in sparse_linear.sparse_linears(self).values():
            layer.indices = layer.indices.to(layer.values.device)  # fairseq loads checkpoints to the CPU first
        return super().load_state_dict(state_dict, strict, model_cfg, args)


@register_model_architecture("lowmem_lightconv", ARCH)
def lowmem_lightconv_iwslt_de_en(args: Any) -> None:
    args.checkpoint_activations = getattr(args, "checkpoint_activations", False)
    args.sparsity = getattr(args, "sparsity", 0.0)
    args.sparse_method = getattr(args, "sparse_method", "dsr")
    args.dsr_reallocate = getattr(args, "dsr_reallocate", default_reallocate_fraction())
    args.dsr_periods = getattr(args, "dsr_periods", "[100,200,400,800]")  # the WRN recipe's (paper notes)
    args.precision = getattr(args, "precision", None) or "fp32"
    args.activation_bits = getattr(args, "activation_bits", None) or 0
    lightconv_iwslt_de_en(args)


def _whole_number_at_least_1(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return k


# make_dataclass, not a class statement: fairseq builds the parser from the fields' types, which this module's
# postponed annotations would leave as strings.
LowmemTranslationConfig = make_dataclass("LowmemTranslationConfig", [("microbatches", int, field(default=1, metadata={"help": (
    "exact microbatching: each batch that --max-tokens forms runs forward and backward as sub-batches of whole "
    "sentences, each of at most max-tokens/k tokens with its padding, accumulated into the same update: the "
    "baseline's sentences and tokens, with one sub-batch's activations at a time, at the cost of k smaller "
    "passes. Not --update-freq, which forms other batches from the corpus")}))], bases=(TranslationConfig,))


@register_task(TASK, dataclass=LowmemTranslationConfig)
class LowmemTranslationTask(TranslationTask):
    """fairseq's translation task with exact microbatching (``--microbatches k``); after each optimizer step, the
    model's DSR rewires when its schedule says so."""

    max_tokens: int | None = None  # the batches' --max-tokens, as get_batch_iterator receives it

    @classmethod
    def add_args(cls, parser: Any) -> None:
        super().add_args(parser)
        for action in parser._actions:  # the dataclass makes --microbatches an int; argparse also refuses k < 1
            if action.dest == "microbatches":
                action.type = _whole_number_at_least_1

    def get_batch_iterator(self, dataset: Any, max_tokens: int | None = None, *args: Any, **kwargs: Any) -> Any:
        k = self.cfg.microbatches
        if k > 1 and dataset is self.datasets.get(self.cfg.train_subset):
            if max_tokens is None:
                raise ValueError("--microbatches splits batches of --max-tokens tokens: give --max-tokens")
            # Refused before training, not at the batch that holds it.
            longest = int(max(dataset.num_tokens_vec(np.arange(len(dataset)))))
            part_sizes([longest], max_tokens // k, 1)
            self.max_tokens = max_tokens
        return super().get_batch_iterator(dataset, max_tokens, *args, **kwargs)

    def train_step(self, sample: Any, model: Any, criterion: Any, optimizer: Any, update_num: int, ignore_grad: bool = False) -> Any:
        k = self.cfg.microbatches
        if k == 1 or not sample or self.max_tokens is None:
            return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)
        parts = split_batch(sample, self.max_tokens // k, k, self.source_dictionary.pad(),
                            self.cfg.left_pad_source, self.cfg.left_pad_target)
        total, size, log = 0.0, 0, {"microbatch_short": int(sample["nsentences"] < k)}
        for part in parts:  # one sub-batch's activations at a time; fairseq divides the summed gradients once
            loss, n, out = super().train_step(part, model, criterion, optimizer, update_num, ignore_grad)
            total, size = total + loss.detach(), size + n
            for key, v in out.items():
                log[key] = log.get(key, 0) + v
        return total, size, log

    def reduce_metrics(self, logging_outputs: Any, criterion: Any) -> None:
        super().reduce_metrics(logging_outputs, criterion)
        if self.cfg.microbatches > 1:  # batches with fewer sentences than k, split one sentence at a time
            metrics.log_scalar_sum("microbatch_short", sum(out.get("microbatch_short", 0) for out in logging_outputs))

    def optimizer_step(self, optimizer: Any, model: Any, update_num: int) -> None:
        super().optimizer_step(optimizer, model, update_num)
        dsr = getattr(model, "dsr", None)
        if dsr is not None:
            dsr.after_step(optimizer.optimizer)  # the torch optimizer, whose state DSR realigns


@dataclass
class LowmemAdamWConfig(FairseqAdamConfig):
    pass


@register_optimizer(OPTIMIZER, dataclass=LowmemAdamWConfig)
class LowmemAdamW(FairseqOptimizer):
    """fairseq's Adam as ``torch.optim.AdamW``, whose state takes each parameter's dtype (bf16 under ``--precision
    half-bf16``). fairseq's own Adam is the same update (decoupled weight decay, the same options) but upcasts every
    parameter and keeps fp32 state, and its 16-bit wrappers are CUDA- or TPU-only in fairseq 0.12."""

    def __init__(self, cfg: LowmemAdamWConfig, params: Any) -> None:
        super().__init__(cfg)
        self._optimizer = torch.optim.AdamW(params, **self.optimizer_config)

    @property
    def optimizer_config(self) -> dict[str, Any]:
        """As fairseq's Adam reads its options (a checkpoint's optimizer is rebuilt with these)."""
        betas = self.cfg.adam_betas
        return {"lr": self.cfg.lr[0] if isinstance(self.cfg.lr, Collection) else self.cfg.lr,
                "betas": tuple(ast.literal_eval(betas) if isinstance(betas, str) else betas),
                "eps": self.cfg.adam_eps, "weight_decay": self.cfg.weight_decay}

    @property
    def supports_flat_params(self) -> bool:
        return True


@dataclass
class LowmemAdamW8bitConfig(FairseqAdamConfig):
    pass


@register_optimizer(OPTIMIZER_8BIT, dataclass=LowmemAdamW8bitConfig)
class LowmemAdamW8bit(LowmemAdamW):
    """A lever beyond the paper: ``lowmem_adamw``'s update with both Adam moments stored block-wise in 8 bits,
    bitsandbytes' ``AdamW8bit`` (Dettmers et al. 2022): per parameter of at least 4096 elements, a uint8 code per
    element and an fp32 maximum per block of 256 for each moment; two shared 256-entry fp32 code books; smaller
    parameters keep fp32 moments. Each step dequantizes a parameter's moments, updates them in fp32 and quantizes them
    back. bitsandbytes' CPU kernel is plain torch ops; torchao's AdamW8bit compiles its step with torch.compile, which
    the accountant's dispatch mode cannot follow. Used as the others: ``--optimizer lowmem_adamw8bit``."""

    def __init__(self, cfg: LowmemAdamW8bitConfig, params: Any) -> None:
        FairseqOptimizer.__init__(self, cfg)
        self._optimizer = optimizers.adamw8bit(params, **self.optimizer_config)


@dataclass
class LowmemAdamWKahanConfig(FairseqAdamConfig):
    pass


@register_optimizer(OPTIMIZER_KAHAN, dataclass=LowmemAdamWKahanConfig)
class LowmemAdamWKahan(LowmemAdamW):
    """A lever beyond the paper: ``lowmem_adamw``'s update by torch-optimi's AdamW, which under ``--precision
    half-bf16`` keeps per weight the part of each update that bf16 rounding dropped (a bf16 compensation buffer,
    Kahan summation) and adds it back at the next step. The moments stay in the parameters' dtype, as
    ``lowmem_adamw``'s. In fp32 optimi adds no buffer and is torch's AdamW to rounding, so the lever is meant for
    ``--precision half-bf16``. Used as the others: ``--optimizer lowmem_adamw_kahan``."""

    def __init__(self, cfg: LowmemAdamWKahanConfig, params: Any) -> None:
        FairseqOptimizer.__init__(self, cfg)
        self._optimizer = optimizers.adamw_kahan(params, **self.optimizer_config)
