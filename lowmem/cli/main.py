"""The ``lowmem`` command (pyproject's console script): ``lowmem profile`` and ``lowmem plan``.

    lowmem profile torchvision:resnet50 --batch 64 --input 3x224x224 --optimizer adamw
    lowmem plan torchvision:resnet50 --batch 256 --input 3x224x224 --optimizer sgd-momentum --budget 4GiB

Bad input (an unknown model, an unparsable shape, an unknown optimizer, a budget nothing meets) gives one line on
stderr that says what is allowed, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from lowmem.cli import plan as planner
from lowmem.cli import models
from lowmem.cli.models import SpecError, shape
from lowmem.cli.profile import OPTIMIZERS, STEPS, Request, account, gap_notes, measure
from lowmem.memory.accounting import MIB
from lowmem.techniques import optimizers, sharding


def _request(args: argparse.Namespace) -> Request:
    # plan's --step lists the steps it combines; its Request is the plain one
    return Request(args.model, args.batch, shape(args.input) if args.input else (), args.optimizer, args.vocab, args.tokens,
                   args.devices, args.shard, args.step if isinstance(args.step, str) else "plain")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="torchvision:NAME, wrn:wrn-28-2, fairseq:ARCH (profile only), or MODULE:FACTORY")
    p.add_argument("--batch", type=int, default=1, help="examples per step (fairseq: sentences)")
    p.add_argument("--input", help="one example's shape, e.g. 3x224x224; for token ids a length, with --vocab")
    p.add_argument("--vocab", type=int, help="token models: ids are drawn below this (fairseq: both dictionaries' size)")
    p.add_argument("--tokens", type=int, help="fairseq: tokens per batch (--max-tokens); default batch x length")
    p.add_argument("--optimizer", default="sgd-momentum",
                   help=f"one of {', '.join([*OPTIMIZERS, *optimizers.OPTIMIZERS[1:]])} (fairseq: sgd, sgd-momentum, adam, adafactor)")
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
    notes = [] if req.spec.kind == "fairseq" else gap_notes(models.build(req.spec, "meta"))
    if args.json:
        print(json.dumps({**report.to_dict(), "model": req.model, "batch": req.batch, "optimizer": req.optimizer,
                          "step": req.step, "accounted_with_cpu_workspace_bytes": with_workspace, "known_gaps": notes,
                          "seconds": round(seconds, 2)}, indent=2))
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
    for note in notes:
        print(f"\nwarning: {note}")
    return 0


def plan_cmd(args: argparse.Namespace) -> int:
    req = _request(args)
    budget = planner.budget_bytes(args.budget)
    levers = planner.Levers(optimizer_state=tuple(dict.fromkeys(args.optimizer_state)), step=tuple(dict.fromkeys(args.step)))
    p = planner.make_plan(req, budget, time_steps=args.time, exact_only=args.exact_only, max_loss=args.max_loss,
                          levers=levers)
    fitting = int(p.rows.get("largest_fitting", p.rows.peak_bytes < 0).fillna(False).astype(bool).sum())
    per = f" split over {req.devices} devices ({sharding.MODES[req.shard]}), peaks per device" if req.devices > 1 else ""
    print(f"{req.model}, batch {req.batch}{per}, {req.optimizer}: {len(p.rows)} configurations accounted; {fitting} settings "
          f"of the other levers fit {args.budget} at some microbatch (the largest that fits is kept); the Pareto set "
          "over peak, time and quality risk:\n")
    print(planner.table(p))
    print("\nrecompute: forward FLOPs run again, over the plain step's. time: " +
          ("measured seconds per step over the plain step's, on this machine." if p.timed else
           "estimated, the step's FLOP ratio (microbatching's smaller kernels and packing's passes are not in it; "
           "--time measures)."))
    print("quality risk: 'exact' = proven equal to the plain step by test; otherwise each lossy lever's effect as "
          "measured in this project, on the task and profile named, never on your model.")
    if req.devices > 1 and req.spec.kind != "fairseq":
        fp32 = sum(p.numel() * 4 for p in models.build(req.spec, "meta").parameters())
        traffic = sharding.traffic_bytes(fp32, req.sharding)
        print(f"communication: each device sends {traffic / MIB:.1f} MiB per step with fp32 weights (half that with "
              "16-bit weights), ring collectives (lowmem.techniques.sharding.traffic_bytes); not in time, which is one "
              "device's compute.")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lowmem", description="How much memory does training this model take, and "
                                 "which levers fit a budget (accounted on the meta device at full size).")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="the peak memory of one training step, by category")
    _common(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    p.add_argument("--measure", action="store_true", help="also run the step for real on the CPU and print the gap")
    p.add_argument("--step", choices=STEPS, default="plain",
                   help="the optimizer's step after backward (plain), or each parameter's inside backward (fused; one device, "
                        "no microbatches, fp32)")
    p.set_defaults(run=profile_cmd)
    q = sub.add_parser("plan", help="the combinations of levers that fit a memory budget")
    _common(q)
    q.add_argument("--budget", required=True, help="e.g. 4GiB, 512MiB, 1.5GB (KiB/MiB/GiB: powers of 2; KB/MB/GB: of 10)")
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
