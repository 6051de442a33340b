"""``lowmem plan`` for a fairseq architecture: the levers as fairseq-train flags, each configuration accounted on
fairseq's own update (``lowmem.dynamicconv.memory``).

- **microbatching**: ``--update-freq k`` with ``--max-tokens T/k``;
- **checkpointing**: ``--checkpoint-activations``, where the architecture has it (fairseq's transformer does; for
  ``lightconv_iwslt_de_en`` lowmem's ``--user-dir`` plugin adds it);
- **precision**: lowmem's plugin's ``--precision mixed-bf16|half-bf16`` for lightconv (fairseq 0.12 has no 16-bit
  training on the CPU), fairseq's own ``--fp16`` (CUDA only) for other architectures;
- **optimizer state**: for ``--optimizer adam``, lowmem's plugin's ``--optimizer lowmem_adamw8bit`` (bitsandbytes'
  AdamW8bit: both moments in block-wise 8 bits); and for lightconv under ``--precision half-bf16``, the plugin's
  ``--optimizer lowmem_adamw_kahan`` (torch-optimi's AdamW with Kahan summation: a bf16 compensation beside the bf16
  moments, so that small updates are not lost to rounding).

Recompute is counted by ``torch.utils.flop_counter`` on the accounted update itself (with checkpointing, the FLOPs
beyond the plain update's). Quality risk: checkpointing is exact; the others are the DynamicConv study's measured
sacreBLEU changes (figures/08_translation_techniques.csv; 8-bit Adam: metrics/translation_levers_train.json; Kahan:
metrics/translation_kahan_train.json, measured with the bf16 weights it compensates, so one effect for the two) where
that exact option was trained, else unmeasured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from lowmem.cli import plan_output
from lowmem.cli.models import SpecError
from lowmem.cli.plan_rules import combine, first_fitting, read_effects
from lowmem.cli.profile import FAIRSEQ_OPTIMIZERS, Request
from lowmem.cli.scalars import HostScalars

PLUGIN_ARCH = "lightconv_iwslt_de_en"  # the architecture lowmem's plugin extends (as lowmem_lightconv_iwslt_de_en)
UPDATE_FREQS = 6  # --update-freq 1, 2, 4, ... at most this many


def base_args(req: Request) -> list[str]:
    """The command line without levers: lowmem's plugin for the architecture it extends, fairseq's own otherwise."""
    from lowmem.dynamicconv.translation import PLUGIN_DIR

    arch = ["--user-dir", str(PLUGIN_DIR), "--arch", f"lowmem_{PLUGIN_ARCH}"] if req.spec.name == PLUGIN_ARCH else ["--arch", req.spec.name]
    return [*arch, "--task", "translation", "--criterion", "label_smoothed_cross_entropy",
            "--optimizer", FAIRSEQ_OPTIMIZERS[req.optimizer], "--lr", "0.0005"]


def options(req: Request) -> dict[str, Any]:
    """Each lever's settings as flags, for this architecture: a list per lever, and for the optimizer state a dict
    by setting name."""
    from lowmem.dynamicconv.memory import model_args

    tokens = req.tokens or req.batch * req.input[0]
    freqs = [k for k in (2**i for i in range(UPDATE_FREQS)) if tokens // k // req.input[0] >= 1]
    try:
        has_ckpt = hasattr(model_args([*base_args(req), "--max-tokens", str(tokens)]), "checkpoint_activations")
    except SystemExit:  # fairseq's parser exits on an unknown architecture
        raise SpecError(f"fairseq has no architecture {req.spec.name!r} (fairseq-train --arch)") from None
    plugin = req.spec.name == PLUGIN_ARCH
    from lowmem.dynamicconv.translation import PLUGIN_DIR

    eight_bit = [*([] if plugin else ["--user-dir", str(PLUGIN_DIR)]), "--optimizer", "lowmem_adamw8bit"]
    # The optimizer-state settings by name (lowmem.cli.plan.OPTIMIZER_STATE). Kahan compensates bf16 weights, which
    # only the plugin's --precision half-bf16 keeps here (``rows`` pairs it with that alone).
    state = {"given": [], **({"8-bit": eight_bit} if req.optimizer == "adam" else {}),
             **({"kahan": ["--optimizer", "lowmem_adamw_kahan"]} if req.optimizer == "adam" and plugin else {})}
    return {"optimizer": state,
            "precision": [[], *([["--precision", "mixed-bf16"], ["--precision", "half-bf16"]] if plugin else [["--fp16"]])],
            "checkpoint": [[], *([["--checkpoint-activations"]] if has_ckpt else [])],
            "microbatch": [["--max-tokens", str(tokens)] if k == 1 else ["--update-freq", str(k), "--max-tokens", str(tokens // k)]
                           for k in freqs]}


def measured(root: Path) -> dict[str, dict[str, Any]]:
    """Options -> the DynamicConv study's sacreBLEU change and interval, for the options it trained
    (``lowmem.studies.lever_effects``)."""
    return {e["options"]: {k: v for k, v in e.items() if k != "options"} for e in read_effects(root)["fairseq"]}


def risk(flags: dict[str, list[str]], effects: dict[str, dict[str, Any]]) -> tuple[float, float, str]:
    optimizer = " ".join(flags.get("optimizer", [])[-2:])
    if optimizer == "--optimizer lowmem_adamw_kahan":  # one effect with the precision it compensates (``LEVERS``)
        lossy = [" ".join([*flags["precision"], optimizer])]
    else:
        lossy = [" ".join(flags["precision"])] if flags["precision"] else []
        if optimizer:
            lossy.append(optimizer)
    if "--update-freq" in flags["microbatch"]:  # fairseq batches sentences anew at T/k tokens: not the same sum
        lossy.append(" ".join(flags["microbatch"][:2]))
    return combine([(opt, effects.get(opt)) for opt in lossy])


def rows(req: Request, budget: int, progress: bool, root: Path, states: tuple[str, ...] = ("given", "8-bit")
         ) -> list[dict[str, Any]]:
    """Per setting of precision and checkpointing, the least ``--update-freq`` that fits, found by bisection (the
    peak falls as k grows), every accounted configuration with its recompute (FLOPs over the plain update's) and
    quality risk; the least that fits is marked ``largest_fitting`` (its batches are the largest). ``states``: the
    optimizer-state settings (``lowmem.cli.plan.OPTIMIZER_STATE``) to combine."""
    from lowmem.dynamicconv import memory as fairseq_memory

    opts, effects = options(req), measured(root)
    tokens, length = req.tokens or req.batch * req.input[0], req.input[0]

    def flops(args: list[str]) -> int:
        step, *_ = fairseq_memory.fairseq_step(args, req.vocab, req.vocab, tokens, length)
        with FlopCounterMode(display=False) as counter, HostScalars():  # fairseq reads the loss as a number
            step(lambda _: None)
        return counter.get_total_flops()

    plain = flops([*base_args(req), *opts["microbatch"][0]])
    recompute = {tuple(c): (flops([*base_args(req), *c, *opts["microbatch"][0]]) - plain) / plain if c else 0.0
                 for c in opts["checkpoint"]}
    out: list[dict[str, Any]] = []

    def row(p: list[str], c: list[str], m: list[str], o: list[str]) -> dict[str, Any]:
        args = [*p, *c, *m, *o]
        r = fairseq_memory.account([*base_args(req), *args], req.vocab, req.vocab, tokens, length)
        change, low, label = risk({"precision": p, "checkpoint": c, "microbatch": m, "optimizer": o}, effects)
        out.append({"precision": " ".join(p) or "fp32", "checkpoint": " ".join(c) or "none",
                    "optimizer": o[-1] if o else FAIRSEQ_OPTIMIZERS[req.optimizer],
                    "microbatch": " ".join(m), "activation_bits": 16 if p else 32, "peak_bytes": r.peak,
                    "peak_phase": r.peak_phase, "recompute": recompute[tuple(c)], "time": 1 + recompute[tuple(c)],
                    "time_source": "estimated (FLOP ratio)", "predicted_change": change, "predicted_low": low, "quality_risk": label,
                    "how_to_apply": "fairseq-train " + " ".join([*base_args(req), *args]) + " (plus your data and recipe)"
                                    + (" (--fp16: CUDA only)" if "--fp16" in p else ""),
                    "tech": None, "segments": None, "largest_fitting": False,
                    "levers": plan_output.fairseq_levers(p, c, m, o)})
        return out[-1]

    # Kahan only beside the bf16 weights it compensates: with fp32 weights optimi adds no buffer and is AdamW itself.
    half = ["--precision", "half-bf16"]
    settings = [(p, c, o) for p in opts["precision"] for c in opts["checkpoint"]
                for s, o in opts["optimizer"].items() if s in states and (s != "kahan" or p == half)]
    if not settings:
        raise SpecError(f"--optimizer-state {' '.join(states)} has no setting for this fairseq model with --optimizer "
                        f"{req.optimizer}: only 'given', '8-bit' with --optimizer adam (the plugin's lowmem_adamw8bit), "
                        f"and 'kahan' with --optimizer adam on {PLUGIN_ARCH} under --precision half-bf16 (the plugin's "
                        "lowmem_adamw_kahan)")
    ms = opts["microbatch"]
    for p, c, o in tqdm(settings, desc="accounting the levers", disable=None if progress else True, mininterval=5):
        seen: dict[int, dict[str, Any]] = {}

        def fits(i: int) -> bool:
            if i not in seen:
                seen[i] = row(p, c, ms[i], o)
            return seen[i]["peak_bytes"] <= budget

        first = first_fitting(len(ms), fits)
        if first is not None:
            seen[first]["largest_fitting"] = True
    return out
