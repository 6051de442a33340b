"""``hf:NAME`` model specs: a transformers model built from its config class, with no weights and no download.

    hf:gpt2                                   the model type's default config (transformers' config class)
    hf:llama,num_hidden_layers=4              ... with config keys overridden (``--config key=value`` in the CLI)
    hf:path/to/config.json,head=sequence-classification
                                              a local config.json, with another head (``--head``)
    hf:llama,lora_r=8,lora_targets=q_proj+v_proj
                                              LoRA adapters through peft (``--lora-r``, ``--lora-targets``)

The head decides the largest tensor of a language model's step (its logits: batch x tokens x vocabulary), so each
model has a stated default: the sequence-to-sequence LM for an encoder-decoder, the masked LM for a model type
transformers has a masked-LM head for (the encoders), else the causal LM. The head's own loss is what the step
takes: for a causal LM, cross-entropy of each position's logits against the next token (the last position has no
next token, so its logits leave the loss), as transformers' ``ForCausalLMLoss`` computes it; for the others,
cross-entropy over every position (masked LM, sequence-to-sequence LM with the decoder fed the targets) or over the
classes (sequence classification). The targets are random ids, like every other spec's: bytes do not depend on them.

A hub id is refused whether or not this machine is online: the config a hub would send is a local ``config.json``
away, and lowmem never downloads. transformers and peft are imported only for an ``hf:`` spec.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowmem.cli.scalars import HostScalars, has_values

HEADS = {  # --head: transformers' auto class of each head
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
}
LORA_KEYS = {"lora_r": int, "lora_alpha": float, "lora_targets": str}  # peft's LoraConfig: r, lora_alpha, target_modules
# transformers' gradient checkpointing as lowmem turns it on, and as a plan tells a reader to.
CHECKPOINT_KWARGS = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
CHECKPOINT_CALL = "model.gradient_checkpointing_enable(" + ", ".join(f"{k}={v!r}" for k, v in CHECKPOINT_KWARGS.items()) + ")"
SPEC_KEYS = ("head", *LORA_KEYS)  # the keys of an hf: spec that are not config keys


class HFError(ValueError):
    """An hf: spec that cannot be built; ``lowmem.cli.models`` turns it into its SpecError."""


def split(name: str) -> tuple[str, dict[str, str]]:
    """'llama,num_hidden_layers=4' -> ('llama', {'num_hidden_layers': '4'})."""
    base, *pairs = name.split(",")
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise HFError(f"hf:{name}: {pair!r} is not key=value (e.g. hf:llama,num_hidden_layers=4)")
        options[key.strip()] = value.strip()
    return base, options


def _value(text: str, like: Any) -> Any:
    """``text`` as the type of the config's current value (JSON where that is a list, dict or None)."""
    if isinstance(like, bool):
        if text.lower() not in ("true", "false"):
            raise HFError(f"{text!r} is not true or false")
        return text.lower() == "true"
    if isinstance(like, (int, float, str)):
        try:
            return type(like)(text)
        except ValueError:
            raise HFError(f"{text!r} is not a {type(like).__name__}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def config(name: str) -> tuple[Any, dict[str, str]]:
    """(the transformers config of ``name``, its spec keys: head and LoRA). ``name`` is a model type, or a path to
    a local config.json (or the folder holding one), with ``,key=value`` overrides."""
    from transformers import CONFIG_MAPPING, AutoConfig

    base, options = split(name)
    path = Path(base)
    if base.endswith(".json") or path.is_dir():
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise HFError(f"hf:{base}: no such file {file}")
        raw = json.loads(file.read_text())
        if raw.get("model_type") not in CONFIG_MAPPING:
            raise HFError(f"hf:{base}: its model_type {raw.get('model_type')!r} is not one transformers knows")
        cfg = AutoConfig.for_model(**raw)
    elif base in CONFIG_MAPPING:
        cfg = AutoConfig.for_model(base)
    else:
        hub = "/" in base
        raise HFError(f"hf:{base}: {'a hub id' if hub else 'not a model type of transformers'}; lowmem never downloads: "
                      "save the model's config.json and pass its path (hf:path/to/config.json)"
                      + ("" if hub else f", or use a model type, e.g. {', '.join(['bert', 'gpt2', 'llama', 'qwen2', 't5'])} "
                         f"({len(CONFIG_MAPPING)} known: transformers.CONFIG_MAPPING)"))
    spec_keys = {k: options.pop(k) for k in SPEC_KEYS if k in options}
    for key, text in options.items():
        if not hasattr(cfg, key):
            raise HFError(f"hf:{base}: {type(cfg).__name__} has no config key {key!r}")
        try:
            setattr(cfg, key, _value(text, getattr(cfg, key)))
        except HFError as e:
            raise HFError(f"hf:{base}: config key {key}: {e}") from None
    cfg.use_cache = False  # a training step keeps no key-value cache
    return cfg, spec_keys


def default_head(cfg: Any) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if cfg.is_encoder_decoder:
        return "seq2seq-lm"
    if cfg.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "masked-lm"
    if cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal-lm"
    raise HFError(f"{cfg.model_type} has no language-model head in transformers: choose one with --head ({', '.join(HEADS)})")


def max_length(cfg: Any) -> int | None:
    """The longest sequence the model's position embeddings take, or None (relative positions: T5)."""
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(cfg, key, None), int):
            return getattr(cfg, key)
    return None


class Head(nn.Module):
    """The transformers model called on token ids, returning the logits its head's loss takes (classes last)."""

    def __init__(self, model: nn.Module, head: str) -> None:
        super().__init__()
        self.model, self.head = model, head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with _the_real_steps_masks(ids):
            if self.head == "seq2seq-lm":  # the decoder fed the targets (teacher forcing); here the same ids
                return self.model(input_ids=ids, decoder_input_ids=ids).logits
            logits = self.model(input_ids=ids).logits
        return logits[:, :-1] if self.head == "causal-lm" else logits


def _head(model: nn.Module) -> Head | None:
    """The Head inside ``model`` as ``lowmem.cli.models.build`` wraps it, or None."""
    return next((m for m in model.modules() if isinstance(m, Head)), None)


def is_hf(model: nn.Module) -> bool:
    return _head(model) is not None


def checkpoint_layers(model: nn.Module) -> None:
    """transformers' own gradient checkpointing, each layer a segment: transformers calls its layers in a loop with
    masks and position embeddings beside the hidden states, which no chain of blocks can wrap. Non-reentrant, as
    transformers recommends, so that the frozen base weights of LoRA need no inputs that require gradients."""
    head = _head(model)
    if head is None or not head.model.supports_gradient_checkpointing:
        raise HFError("this model has no gradient checkpointing in transformers")
    head.model.gradient_checkpointing_enable(**CHECKPOINT_KWARGS)


@contextmanager
def _the_real_steps_masks(ids: torch.Tensor) -> Iterator[None]:
    """transformers takes a FakeTensor for a traced graph and builds the explicit attention mask a graph needs, where
    the real step, whose padding mask is all ones, leaves the mask to SDPA's ``is_causal`` (and Llama's grouped
    key-value heads unexpanded): the account would hold what the real step never allocates. On the accountant's fake
    tensors the mask checks read the values through ``lowmem.cli.scalars.HostScalars`` (all ones), as on real ones."""
    if has_values(ids):
        yield
        return
    from transformers import masking_utils
    from transformers.utils import import_utils

    traced = masking_utils.is_tracing
    masking_utils.is_tracing = lambda tensor=None: import_utils.is_tracing() or import_utils.is_torch_fx_proxy(tensor)
    try:
        with HostScalars():
            yield
    finally:
        masking_utils.is_tracing = traced


def factory(name: str) -> Callable[[], nn.Module]:
    """A function building the model with its head, and LoRA where the spec asks."""
    import transformers

    cfg, keys = config(name)
    head = keys.get("head") or default_head(cfg)
    if head not in HEADS:
        raise HFError(f"head {head!r} is not one of {', '.join(HEADS)}")
    if head == "sequence-classification" and cfg.pad_token_id is None:
        # A decoder's classifier reads each row's last token before padding and refuses batches without a pad id;
        # which id it is changes no bytes.
        cfg.pad_token_id = 0
    try:
        lora = {k: LORA_KEYS[k](keys[k]) for k in LORA_KEYS if k in keys}
    except ValueError:
        raise HFError(f"LoRA's rank and alpha are numbers: {', '.join(f'{k}={keys[k]}' for k in LORA_KEYS if k in keys)}") from None
    if lora and "lora_r" not in lora:
        raise HFError("LoRA needs its rank: lora_r=R (--lora-r)")

    def make() -> nn.Module:
        try:
            model = getattr(transformers, HEADS[head]).from_config(cfg)
        except ValueError as e:
            raise HFError(f"{cfg.model_type} has no {head} head in transformers ({str(e).splitlines()[0]})") from None
        if lora:
            model = _lora(model, lora)
        return Head(model, head)

    return make


def _lora(model: nn.Module, lora: dict[str, Any]) -> nn.Module:
    import peft

    targets = lora["lora_targets"].split("+") if "lora_targets" in lora else None
    if targets:
        # Leaf modules with weights: nn.Linear, and transformers' Conv1D in GPT-2, which peft adapts too.
        leaves = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                  if n and not any(True for _ in m.children()) and getattr(m, "weight", None) is not None}
        missing = [t for t in targets if t not in leaves]
        if missing:
            raise HFError(f"LoRA targets {missing} match no layer with weights; the model's are {', '.join(sorted(leaves))}")
    cfg = peft.LoraConfig(r=lora["lora_r"], lora_alpha=lora.get("lora_alpha", 2 * lora["lora_r"]), target_modules=targets,
                          lora_dropout=0.0)
    try:
        return peft.get_peft_model(model, cfg)
    except ValueError as e:  # peft has no default targets for this model type
        raise HFError(f"LoRA: {str(e).splitlines()[0]}; name them with lora_targets=a+b (--lora-targets)") from None
