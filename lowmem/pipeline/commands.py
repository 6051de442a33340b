"""Every command that dvc.yaml and the Makefile run, behind one entry point::

    python -m lowmem.pipeline COMMAND [ARGS...]      (python -m lowmem.pipeline --help lists them)

Each command's module declares its options (``add_arguments``) and does its work (``run``), as fairseq's tasks add
their arguments to one parser. Only the named command's module is imported, so a stage pays for its own imports and
no other (fairseq's, for one, take seconds). A module is named here relative to ``lowmem`` (``studies.levers``, not
the full dotted path): ``lowmem.pipeline.stage_deps`` takes a stage's code from the command it names, not from this
table, so that a stage never depends on every command's code. ``lowmem`` (``lowmem.cli.main``) is the user's entry
point; the GPU check and the sharding run that torchrun starts keep their own, since they run without this package's
pipeline (stock PyTorch on a lent GPU; a worker process).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

# command -> (module under lowmem, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "params": ("pipeline.stage_params", "check every block of params.yaml and write each stage's resolved parameters"),
    "times": ("pipeline.stage_times", "run dvc repro (or the command after --) and record each stage's wall time"),
    "deps": ("pipeline.stage_deps", "write or check each dvc.yaml stage's code deps from what its command runs"),
    "docs": ("pipeline.docs", "refresh or check the numbers of README.md and docs/ against the files that hold them"),
    "outputs": ("pipeline.outputs", "clear a notebook stage's staging folder, or publish its outputs once it succeeded"),
    "train": ("pipeline.train_stage", "train one WRN stage's runs through the run store"),
    "runs": ("pipeline.run_index", "index every run the training stages used, once each"),
    "dynamicconv": ("dynamicconv.translation", "DynamicConv's data, training and evaluation steps (fairseq)"),
    "translation": ("studies.translation", "DynamicConv's techniques: memory, training and timing (notebook 08)"),
    "precision": ("studies.precision", "WRN's precision modes: step times and the accounted-vs-measured check"),
    "combinations": ("studies.combinations", "the combination study: sweep, select, search, train one slot"),
    "levers": ("studies.levers", "WRN's levers beyond the paper, each arm on the combination study's seeds"),
    "bleu-noise": ("studies.bleu_noise", "the DynamicConv baseline's seed-to-seed spread of BLEU"),
    "lever-effects": ("studies.lever_effects", "gather what the studies measured of each lossy lever, for lowmem plan"),
    "cpu-check": ("studies.cpu_check", "the headline's WRN configurations measured on this CPU at full size"),
    "crosscheck": ("studies.crosscheck", "the accountant against PyTorch's MemTracker, and the DP planner against SAC's ILP"),
}


def module(command: str) -> ModuleType:
    return importlib.import_module(f"lowmem.{COMMANDS[command][0]}")


def usage() -> str:
    width = max(map(len, COMMANDS))
    return ("usage: python -m lowmem.pipeline COMMAND [ARGS...]  (COMMAND --help for its options)\n\ncommands:\n"
            + "\n".join(f"  {c:<{width}}  {what}" for c, (_, what) in COMMANDS.items()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # What follows `--` is a command line of its own (`times -- dvc repro -s STAGE`), never this parser's.
    own, after = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, None)
    mod = module(command)
    ap = argparse.ArgumentParser(prog=f"python -m lowmem.pipeline {command}", description=COMMANDS[command][1])
    mod.add_arguments(ap)
    args = ap.parse_args(own)
    args.command = after
    return mod.run(args)
