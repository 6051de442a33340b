"""The ``lowmem`` command (pyproject's console script): ``lowmem profile`` and ``lowmem plan``.

    lowmem profile torchvision:resnet50 --batch 64 --input 3x224x224 --optimizer adamw
    lowmem plan torchvision:resnet50 --batch 256 --input 3x224x224 --optimizer sgd-momentum --budget 4GiB [--explain 1]
    lowmem plan torchvision:resnet50 --batch 256 --input 3x224x224 --budget t4 --check        # exit 0 fits, 1 not
    lowmem plan torchvision:resnet50 --input 3x224x224 --budget 4GiB --max-batch --levers mixed-bf16+checkpoint-block
    lowmem profile hf:gpt2 --batch 8 --input 1024 --optimizer adamw [--lora-r 8 --lora-targets c_attn]
    lowmem plan hf:llama --config num_hidden_layers=4 --batch 4 --input 512 --optimizer adamw --budget 2GiB

Bad input (an unknown model, an unparsable shape, an unknown optimizer or device, a budget nothing meets, a row
--explain does not have) gives one line on stderr that says what is allowed, and exit status 2; a step that does
not fit (--check, --max-batch) exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time

from lowmem.cli import device_bytes, fits, hf, models, plan_output
from lowmem.cli import plan as planner
from lowmem.cli.models import SpecError, shape
from lowmem.cli.profile import OPTIMIZERS, STEPS, Request, account, gap_notes, measure
from lowmem.cpu import cpu_class
from lowmem.memory import devices
from lowmem.memory.accounting import MIB
from lowmem.techniques import registry, sharding
from lowmem.techniques.step import Techniques


def _model(args: argparse.Namespace) -> str:
    """The model spec, with the hf: options (lowmem.cli.hf) written into it: one string names the model everywhere."""
    extra = [*args.config, *(f"{k}={v}" for k, v in (("head", args.head), ("lora_r", args.lora_r), ("lora_alpha", args.lora_alpha),
                                                         ("lora_targets", args.lora_targets)) if v is not None)]
    if extra and not args.model.startswith("hf:"):
        raise SpecError("--config, --head and --lora-* are options of an hf: model (e.g. hf:llama --config num_hidden_layers=4)")
    return ",".join([args.model, *extra])


def _request(args: argparse.Namespace) -> Request:
    # plan's --step lists the steps it combines; its Request is the plain one
    return Request(_model(args), args.batch, shape(args.input) if args.input else (), args.optimizer, args.vocab, args.tokens,
                   args.devices, args.shard, args.step if isinstance(args.step, str) else "plain")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="torchvision:NAME, wrn:wrn-28-2, fairseq:ARCH, hf:TYPE or hf:path/to/config.json "
                   "(transformers, built from its config: nothing is downloaded), or MODULE:FACTORY")
    p.add_argument("--batch", type=int, default=1, help="examples per step (fairseq: sentences)")
    p.add_argument("--input", help="one example's shape, e.g. 3x224x224; for token ids a length, with --vocab (hf: the length alone)")
    p.add_argument("--vocab", type=int, help="token models: ids are drawn below this (fairseq: both dictionaries' size)")
    p.add_argument("--tokens", type=int, help="fairseq: tokens per batch (--max-tokens); default batch x length")
    p.add_argument("--optimizer", default="sgd-momentum",
                   help=f"one of {', '.join([*OPTIMIZERS, *registry.optimizers()[1:]])} (fairseq: sgd, sgd-momentum, adam, adafactor)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="hf: a config key overridden, e.g. num_hidden_layers=4 (repeat for more)")
    p.add_argument("--head", choices=list(hf.HEADS), help="hf: the head and its loss (default: seq2seq-lm for an "
                   "encoder-decoder, masked-lm for an encoder, else causal-lm)")
    p.add_argument("--lora-r", type=int, help="hf: LoRA adapters of this rank (peft); the base weights are frozen")
    p.add_argument("--lora-alpha", type=float, help="hf: LoRA's alpha (default 2 x rank; changes no bytes)")
    p.add_argument("--lora-targets", help="hf: the linear layers LoRA adapts, by name, joined by + (e.g. q_proj+v_proj; "
                   "default: peft's for the model type)")
    p.add_argument("--devices", type=int, default=1, help="data-parallel devices the batch is split over; memory is per device")
    p.add_argument("--shard", default="replicate", choices=list(sharding.MODES),
                   help="what the devices shard: " + "; ".join(f"{k} = {v}" for k, v in sharding.MODES.items()))


def profile_cmd(args: argparse.Namespace) -> int:
    req = _request(args)
    t0 = time.perf_counter()
    if args.measure:
        report, with_workspace = measure(req)
    else:
        report, with_workspace = account(req), None
    seconds = time.perf_counter() - t0
    device = None if args.tensors_only or args.measure or req.spec.kind == "fairseq" else _device_bytes(req, report.peak)
    notes = [] if req.spec.kind == "fairseq" else gap_notes(models.build(req.spec, "meta"))
    if args.json:
        print(json.dumps({**report.to_dict(), "model": req.model, "batch": req.batch, "optimizer": req.optimizer,
                          "step": req.step, "accounted_with_cpu_workspace_bytes": with_workspace, "known_gaps": notes,
                          "device": device, "seconds": round(seconds, 2)}, indent=2))
        return 0
    where = "fairseq's update" if req.spec.kind == "fairseq" else "tensors without values (fake CPU tensors)"
    per = f" split over {req.devices} devices ({sharding.MODES[req.shard]}), peak per device" if req.devices > 1 else ""
    print(f"{req.model}, batch {req.batch}{per}, input {'x'.join(map(str, req.input))}, {req.optimizer}{' (stepped inside backward)' if req.step == 'fused' else ''}: one training step "
          f"accounted at full size on {where} in {seconds:.1f} s; peak {report.peak / MIB:.1f} MiB in the "
          f"{report.peak_phase} phase.\n")
    print(report.table())
    if with_workspace is not None:
        gap = 100 * (with_workspace - report.measured_peak) / report.measured_peak
        print(f"| accounted + CPU op workspace | {with_workspace / MIB:.2f} | gap {gap:+.2f}% |")
    if device is not None:
        print(f"\nWhat this CPU holds at the step's peak ({device['cpu']}):\n")
        print("| line | MiB | how it is known |\n|---|---:|---|")
        print(f"| tensors | {device['tensors_bytes'] / MIB:.2f} | accounted (the table above) |")
        print(f"| op workspace | {device['op_workspace_bytes'] / MIB:.2f} | measured on this machine: {device['calls']} distinct "
              f"op calls run once each at these shapes ({device['measured_now']} now, the rest from {device['cache']}), "
              f"{device['seconds']:.1f} s |")
        print("| library memory | not measured | held between ops; on a GPU, cuBLAS's workspace (docs/gpu-check.md) |")
        print(f"| **device peak** | **{device['peak_bytes'] / MIB:.2f}** | tensors and op workspace at the step's peak |")
    elif req.spec.kind == "fairseq" and not args.measure:
        print("\nop workspace: not measured for fairseq's update (--measure runs it and gives its real peak)")
    for note in notes:
        print(f"\nwarning: {note}")
    return 0


def _device_bytes(req: Request, tensors: int) -> dict:
    """The step's peak with each op's CPU scratch (``lowmem.cli.device_bytes``), beside the tensors' peak."""
    t0 = time.perf_counter()
    ws = device_bytes.DiskWorkspace()
    peak = account(req, workspace=ws).peak
    ws.save()
    return {"cpu": cpu_class(), "tensors_bytes": tensors, "op_workspace_bytes": peak - tensors, "peak_bytes": peak,
            "calls": len(ws.cache), "measured_now": ws.new, "cache": str(ws.path), "seconds": time.perf_counter() - t0}


def _say(text: str) -> None:
    print(textwrap.fill(text, plan_output.WIDTH, break_long_words=False, break_on_hyphens=False))


def plan_cmd(args: argparse.Namespace) -> int:
    req = _request(args)
    budget, notes = fits.budget(args.budget)
    if args.check or args.max_batch:
        if args.explain is not None or args.json:
            raise SpecError("--check and --max-batch print one answer: leave out --explain and --json")
        return check_cmd(args, req, budget, notes) if args.check else max_batch_cmd(args, req, budget, notes)
    levers = planner.Levers(optimizer_state=tuple(dict.fromkeys(args.optimizer_state)), step=tuple(dict.fromkeys(args.step)))
    p = planner.make_plan(req, budget, time_steps=args.time, exact_only=args.exact_only, max_loss=args.max_loss,
                          levers=levers, progress=not (args.json or args.explain))
    if args.json:
        print(plan_output.as_json(p.fitting, req, budget))
        return 0
    if args.explain is not None:
        try:
            print(plan_output.explain(p.fitting, args.explain, req, budget))
        except ValueError as e:
            raise SpecError(str(e)) from None
        return 0
    fitting = int(p.rows.get("largest_fitting", p.rows.peak_bytes < 0).fillna(False).astype(bool).sum())
    per = f" split over {req.devices} devices ({sharding.MODES[req.shard]}), peaks per device" if req.devices > 1 else ""
    _say(f"{req.model}, batch {req.batch}{per}, {req.optimizer}: {len(p.rows)} configurations accounted; {fitting} "
         f"settings of the other levers fit {args.budget} ({budget / 2**30:.3f} GiB) at some microbatch (the largest "
         "that fits is kept). The Pareto set over peak, time and quality risk:")
    for note in notes:
        _say(f"budget: {note}")
    print()
    print(plan_output.table(p.fitting))
    print()
    _say("time: " + ("measured seconds per step over the plain step's, on this machine." if p.timed else
                     "estimated, the FLOP ratio to the plain step (recompute only; --time measures)."))
    _say("risk: 'exact' = proven equal to the plain step by test; 'lossy X' = X is the low end of the summed 95% "
         "intervals of the lossy levers' effects measured in this project (accuracy points or BLEU), never on your "
         "model; 'unmeasured' = a lossy lever not measured here. `--explain N` prints row N in full with the Python that applies it; `--json` prints every row.")
    if req.devices > 1 and req.spec.kind != "fairseq":
        fp32 = sum(p.numel() * 4 for p in models.build(req.spec, "meta").parameters())
        traffic = sharding.traffic_bytes(fp32, req.sharding)
        _say(f"communication: each device sends {traffic / MIB:.1f} MiB per step with fp32 weights (half that with "
             "16-bit weights), ring collectives (lowmem.techniques.sharding.traffic_bytes); not in time, which is one "
             "device's compute.")
    return 0


def check_cmd(args: argparse.Namespace, req: Request, budget: int, notes: tuple[str, ...]) -> int:
    """Exit 0 when the request's plain step fits the budget, 1 when it does not (for CI)."""
    peak = fits.peak(req)
    ok = peak <= budget
    _say(f"{'fits' if ok else 'does not fit'}: {req.model}, batch {req.batch}, {req.optimizer}, plain step: peak "
         f"{peak / MIB:,.1f} MiB against {args.budget} ({budget / MIB:,.1f} MiB).")
    for note in notes:
        _say(f"budget: {note}")
    return 0 if ok else 1


def max_batch_cmd(args: argparse.Namespace, req: Request, budget: int, notes: tuple[str, ...]) -> int:
    """The largest batch that fits, under the plain step or ``--levers``; exit 1 when even the smallest does not."""
    tech = fits.parse_levers(args.levers)
    r = fits.max_batch(req, budget, tech)
    under = "the plain step" if tech == Techniques() else args.levers
    if r.batch == 0:
        _say(f"does not fit: even batch {req.devices} of {req.model} under {under} peaks at {r.peak / MIB:,.1f} MiB, "
             f"over {args.budget} ({budget / MIB:,.1f} MiB).")
        code = 1
    else:
        most = f"at least {r.batch} (the search stops at {fits.MAX_BATCH_CAP})" if r.capped else str(r.batch)
        _say(f"largest batch: {most}, {req.model}, {req.optimizer}, under {under}: peak {r.peak / MIB:,.1f} MiB against "
             f"{args.budget} ({budget / MIB:,.1f} MiB).")
        code = 0
    for note in notes:
        _say(f"budget: {note}")
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lowmem", description="How much memory does training this model take, and "
                                 "which levers fit a budget (accounted on the meta device at full size).")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="the peak memory of one training step, by category")
    _common(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    p.add_argument("--measure", action="store_true", help="also run the step for real on the CPU and print the gap")
    p.add_argument("--tensors-only", action="store_true",
                   help="only the tensors: skip this CPU's op workspace (measured once per op call, then read from a cache)")
    p.add_argument("--step", choices=STEPS, default="plain",
                   help="the optimizer's step after backward (plain), or each parameter's inside backward (fused; one device, "
                        "no microbatches, fp32)")
    p.set_defaults(run=profile_cmd)
    q = sub.add_parser("plan", help="the combinations of levers that fit a memory budget")
    _common(q)
    q.add_argument("--budget", required=True,
                   help="e.g. 4GiB, 512MiB, 1.5GB (KiB/MiB/GiB: powers of 2; KB/MB/GB: of 10), or a GPU: "
                        f"{', '.join(devices.names())} (its memory less what was measured of its libraries)")
    q.add_argument("--json", action="store_true", help="print every row of the Pareto set as JSON")
    q.add_argument("--explain", type=int, metavar="N", help="print row N of the table in full, with the Python that applies it")
    q.add_argument("--check", action="store_true", help="only account the plain step: exit 0 if it fits, 1 if not (2: bad input)")
    q.add_argument("--max-batch", action="store_true",
                   help=f"the largest batch that fits, under the plain step or --levers (searched up to {fits.MAX_BATCH_CAP})")
    q.add_argument("--levers", default="plain", help="with --max-batch: e.g. mixed-bf16+microbatch-8+checkpoint-block+activations-8")
    q.add_argument("--time", action="store_true", help="measure each fitting configuration's step time on the CPU")
    q.add_argument("--exact-only", action="store_true", help="only levers proven exact")
    q.add_argument("--optimizer-state", nargs="+", choices=planner.OPTIMIZER_STATE, default=list(planner.OPTIMIZER_STATE),
                   help="the optimizer's own state (given), its 8-bit counterpart, Kahan's SGD under half-bf16 (for "
                        "lightconv_iwslt_de_en: the plugin's Kahan AdamW under --precision half-bf16) (default: all; "
                        "each costs the plan as much time again)")
    q.add_argument("--step", nargs="+", choices=STEPS, default=list(STEPS),
                   help="the optimizer's step after backward (plain) and/or fused into backward (fused: the whole batch in "
                        "fp32 on one device; no clipping by the global norm) (default: both)")
    q.add_argument("--max-loss", type=float, help="drop configurations whose measured quality loss, at the low end of its 95%% interval, exceeds this (points or BLEU)")
    q.set_defaults(run=plan_cmd)
    args = ap.parse_args(argv)
    try:
        return args.run(args)
    except SpecError as e:
        print(f"lowmem {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as e:  # raised by the model's own step: the input does not suit it
        print(f"lowmem {args.command}: error: the training step fails on this model and input ({type(e).__name__}: "
              f"{str(e).splitlines()[0]}); check --input, --batch and --vocab", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
