"""The models ``lowmem profile`` and ``lowmem plan`` take, by spec string, and the batch of one training step.

- ``torchvision:NAME``: any classification model of ``torchvision.models`` (``resnet50``, ``vit_b_16``,
  ``mobilenet_v3_large``, ...), untrained;
- ``wrn:wrn-28-2``: this project's WideResNet (``lowmem.wrn.models``);
- ``fairseq:ARCH``: a fairseq translation architecture (``lightconv_iwslt_de_en``, ``transformer_iwslt_de_en``,
  ...), accounted by the DynamicConv track's fairseq step (``lowmem.dynamicconv.memory``);
- ``hf:NAME``: a transformers model built from its config class (``gpt2``, ``llama``, a local ``config.json``),
  with its head's loss and optionally LoRA (``lowmem.cli.hf``);
- ``MODULE:FACTORY``: any importable callable that returns an ``nn.Module`` (``mypkg.models:build``).

A model that is not fairseq's trains with cross-entropy on its output: logits with the classes last, as
``nn.Linear`` heads give them (``(B, C)``, or ``(B, T, C)`` for a sequence, whose classes are moved to dim 1 as
``F.cross_entropy`` wants). Its input is a float batch of ``--input`` (C x H x W, say), or token ids below
``--vocab`` when given.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lowmem.cli import hf
from lowmem.wrn.models import build_model

KINDS = ("torchvision", "wrn", "fairseq", "hf", "MODULE")


class SpecError(ValueError):
    """A model, shape or option that cannot be used; the message says what is allowed."""


@dataclass(frozen=True)
class Spec:
    kind: str  # torchvision, wrn, fairseq, hf, or module
    name: str


def parse(spec: str) -> Spec:
    """'torchvision:resnet50' -> Spec('torchvision', 'resnet50'); 'pkg.mod:factory' -> Spec('module', 'pkg.mod:factory')."""
    kind, sep, name = spec.partition(":")
    if not sep or not kind or not name:
        raise SpecError(f"model {spec!r}: write KIND:NAME with KIND one of torchvision, wrn, fairseq, hf, or a Python "
                        "module path (e.g. torchvision:resnet50, wrn:wrn-28-2, fairseq:lightconv_iwslt_de_en, hf:gpt2, "
                        "mypkg.models:build)")
    if kind in ("torchvision", "wrn", "fairseq", "hf"):
        return Spec(kind, name)
    return Spec("module", spec)


def shape(text: str) -> tuple[int, ...]:
    """'3x224x224' -> (3, 224, 224)."""
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise SpecError(f"input shape {text!r} is not positive integers joined by x (e.g. 3x224x224, or 128 for tokens)")
    return dims


class _ClassesAtDim1(nn.Module):
    """The model, with a sequence's logits (B, T, C) moved to (B, C, T) for ``F.cross_entropy``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        aux = _aux_outputs()
        if aux and isinstance(out, aux):
            # GoogLeNet and Inception v3 train with auxiliary heads. Their logits join the loss with weight 0: the
            # heads then hold activations, gradients and optimizer state as under auxiliary losses, whose weights
            # change no bytes (short of the auxiliary cross-entropies' own few bytes, B x classes each).
            out = out.logits + sum(0.0 * a for a in out[1:] if a is not None)
        if not isinstance(out, torch.Tensor):
            raise SpecError(f"the model returned {type(out).__name__}, not a tensor of logits: wrap it so that forward "
                            "returns the logits (classes last)")
        return out.movedim(-1, 1) if out.dim() > 2 else out


def _aux_outputs() -> tuple[type, ...]:
    """torchvision's outputs with auxiliary heads; none while torchvision is not imported, as then no model returns
    them (importing it here would cost every command seconds, torch._dynamo included)."""
    tv = sys.modules.get("torchvision.models")
    return (tv.GoogLeNetOutputs, tv.InceptionOutputs) if tv is not None else ()


def factory(spec: Spec) -> Callable[[], nn.Module]:
    """A function that builds the model (on the current default device) for a torchvision, wrn or module spec."""
    if spec.kind == "torchvision":
        import torchvision

        names = torchvision.models.list_models(module=torchvision.models)
        if spec.name not in names:
            raise SpecError(f"torchvision has no classification model {spec.name!r}; e.g. {', '.join(sorted(names)[:8])}, ... "
                            "(torchvision.models.list_models())")
        return lambda: torchvision.models.get_model(spec.name, weights=None)
    if spec.kind == "wrn":
        try:
            build_model(spec.name)  # checks the name before anything is built at full size
        except ValueError as e:
            raise SpecError(str(e)) from None
        return lambda: build_model(spec.name)
    if spec.kind == "hf":
        try:
            return hf.factory(spec.name)
        except hf.HFError as e:
            raise SpecError(str(e)) from None
    if spec.kind == "module":
        module_name, _, attr = spec.name.rpartition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise SpecError(f"model {spec.name!r}: cannot import {attr!r} from {module_name!r} ({e})") from None
        if not callable(fn):
            raise SpecError(f"model {spec.name!r}: {attr!r} is not callable; give a function or class that returns an nn.Module")
        return fn
    raise SpecError(f"{spec.kind}: models are built by the fairseq step, not here")


def build(spec: Spec, device: torch.device | str, seed: int = 0) -> nn.Module:
    """The model on ``device`` (meta: shapes only, no memory), ready for cross-entropy on its output."""
    torch.manual_seed(seed)
    make = factory(spec)
    try:
        with torch.device(device):
            model = make()
    except hf.HFError as e:
        raise SpecError(str(e)) from None
    except NotImplementedError:
        if torch.device(device).type != "meta":
            raise
        # A model that computes its layout with tensors (torchvision's RegNets: widths by torch.arange, then
        # .tolist()) cannot be built on meta: built on the CPU, then moved. Its weights exist meanwhile.
        torch.manual_seed(seed)
        model = make().to("meta")
    if not isinstance(model, nn.Module):
        raise SpecError(f"{spec.name!r} returned {type(model).__name__}, not an nn.Module")
    return _ClassesAtDim1(model)


def to_empty(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model.to_empty(device=device)``, its shared parameters still shared. Moving off the meta device,
    ``Module.to_empty`` gives every module a new Parameter of its own, which unties tied weights (a language model's
    embedding and output layer: the account would hold them twice)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for (first, first_name), *rest in (v for v in places.values() if len(v) > 1):
        for module, name in rest:
            module._parameters[name] = first._parameters[first_name]
    return model


def batch(model: nn.Module, batch_size: int, input_shape: tuple[int, ...], vocab: int | None, device: torch.device | str,
          seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch and its targets: class ids below the number of classes the model outputs, found by one
    forward pass on one example (in eval mode and without autograd, so BatchNorm's statistics do not move)."""
    g = torch.Generator().manual_seed(seed)
    if vocab:
        x = torch.randint(0, vocab, (batch_size, *input_shape), generator=g).to(device)
    else:
        x = torch.randn((batch_size, *input_shape), generator=g).to(device, dtype)
    was_training, fastpath = model.training, torch.backends.mha.get_fastpath_enabled()
    model.eval()
    # Eval mode would send nn.TransformerEncoder down its inference fast path, whose fake-tensor kernel mixes fake
    # modes; the training step never takes it.
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            out_shape = model(x[:1]).shape
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise SpecError(f"the model does not run on an input of shape {tuple(x.shape[1:])} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0]}); check --input (and --vocab for token ids)") from None
    finally:
        model.train(was_training)
        torch.backends.mha.set_fastpath_enabled(fastpath)
    y = torch.randint(0, out_shape[1], (batch_size, *out_shape[2:]), generator=g).to(device)
    return x, y
