"""``metrics/runs.json``: every distinct training run of the pipeline once, with its key, what it is, the stages
that use it, and which stage trained it.

    python -m lowmem.pipeline runs --results data/results --metrics metrics --out metrics/runs.json
    python -m lowmem.pipeline runs --planned data/params     # the keys the WRN stages would use now, untrained

``--planned`` prints, without training, the key of every run the WRN training stages plan at the resolved
parameters in that folder, and the code digest of the fairseq plugin (the code part of every DynamicConv run's key):
what shows that moving code between modules keeps every key.

It reads what the training stages recorded (each run's key and whether that stage trained it) and each run's
``key.json`` in the run store. A key that two stages of this checkout's pipeline (``data/results``) report as
trained fails the stage, and so does one that two left-out stages' committed metrics report: the store exists so
that this never happens. The stages left out of ``make repro`` keep only their committed metrics, which say what
they trained in the run store where they ran, often another machine's and never a fresh clone's; so a default stage
of a fresh clone that trains one of their runs again, in a store of its own, is listed beside them and is no second
training in one store.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lowmem import runs


def _uses(results: Path, metrics: Path) -> Iterator[tuple[str, str, bool, bool]]:
    """(stage, key, trained by that stage, recorded by this checkout's pipeline) for every run every training stage
    used."""
    for f in sorted(results.glob("*_train.json")):
        data = runs.read_json(f)
        stage = f.stem
        if "runs" in data:  # WRN studies (lowmem.pipeline.train_stage)
            for r in data["runs"]:
                yield stage, r["key"], r["trained"], True
        elif "key" in data:  # translation_train
            yield stage, data["key"], data["trained"], True
    # The stages left out of `make repro` (frozen in dvc.yaml) keep only their committed metrics. Results written
    # before the run store have no keys and are not listed.
    techniques = metrics / "translation_techniques_train.json"
    for r in runs.read_json(techniques)["trained"] if techniques.exists() else []:
        if "key" in r:
            yield "translation_techniques_train", r["key"], r["trained"], False
    for stage in ("microbatching_train", "precision_train", "proxy_noise_train", "bleu_noise_train"):
        noise = metrics / f"{stage}.json"
        for r in runs.read_json(noise)["runs"] if noise.exists() else []:
            yield stage, r["key"], r["trained"], False
    for f in sorted((metrics / "combinations").glob("*.json")):
        data = runs.read_json(f)
        search = "search_" if str(data.get("role", "")).startswith("search") else ""
        for r in data.get("runs", []):
            yield f"combination_{search}{f.stem.replace('-', '@')}", r["key"], r["trained"], False


def _describe(key: str) -> dict[str, Any]:
    path = runs.store() / key / "key.json"
    if not path.exists():
        return {}
    info = runs.read_json(path)
    fields = info["fields"]
    if info["track"] == "wrn":
        tech = {k: v for k, v in fields["techniques"].items() if v not in (0, 0.0, "fp32", "batch", "none")}
        what = f"{fields['model']} {fields['dataset']} seed {fields['seed']}" + "".join(f", {k}={v}" for k, v in tech.items())
    else:
        args = fields["args"]
        what = "fairseq-train " + " ".join(a for a in args[args.index("--max-update"):args.index("--max-update") + 2])
        flags = ("--fp16", "--memory-efficient-fp16", "--checkpoint-activations")
        valued = ("--sparsity", "--update-freq", "--precision")
        extra = [a for a in args if a in flags]
        extra += [f"{a} {v}" for a, v in zip(args, args[1:]) if a in valued or (a == "--optimizer" and v != "adam")]
        seed = args[args.index("--seed") + 1] if "--seed" in args else "?"
        what += f" seed {seed}" + ((" " + " ".join(extra)) if extra else " (no technique)")
    result = runs.read_json(runs.store() / key / "result.json") if (runs.store() / key / "result.json").exists() else {}
    return {"track": info["track"], "run": what, "code_digest": info["code_digest"], "train_seconds": result.get("train_seconds")}


def index(results: Path, metrics: Path) -> dict[str, Any]:
    table: dict[str, dict[str, Any]] = {}
    claims: dict[tuple[str, bool], list[str]] = {}  # (key, recorded by this checkout's pipeline): stages that trained it
    for stage, key, trained, ours in _uses(results, metrics):
        row = table.setdefault(key, {"key": key, "stages": [], "trained_by": []})
        if stage not in row["stages"]:
            row["stages"].append(stage)
        if trained:
            row["trained_by"].append(stage)
            claims.setdefault((key, ours), []).append(stage)
    # Two claims on one side are two trainings in one store: this pipeline's, or the one the left-out stages'
    # committed metrics were written from (they run together, `make repro-all`). A claim on each side is not.
    twice = {k: stages for (k, _), stages in claims.items() if len(stages) > 1}
    if twice:
        raise RuntimeError(f"runs trained by more than one stage of this pipeline or of the left-out stages: {twice}")
    rows = [{**r, **_describe(k)} for k, r in table.items()]
    # trained_by: the stages whose latest run trained it (a left-out stage's in the store where it ran); empty when
    # an earlier run of the pipeline did.
    return {"distinct_runs": len(rows), "trained_by_the_latest_stage_runs": sum(bool(r["trained_by"]) for r in rows),
            "uses": sum(len(r["stages"]) for r in rows), "runs": rows}


def planned(params: Path) -> dict[str, Any]:
    """The keys the WRN training stages plan at ``params`` (resolved stage YAMLs), and the plugin's code digest."""
    import yaml  # only this listing reads the stage YAMLs

    from lowmem.config import STAGES
    from lowmem.dynamicconv import translation
    from lowmem.pipeline import train_stage

    out: dict[str, Any] = {}
    for stage in train_stage.PLANS:
        p = STAGES[stage](**yaml.safe_load((params / f"{stage}.yaml").read_text()))
        out[f"{stage}_train"] = train_stage.keys(stage, p)
    out["fairseq_plugin_code_digest"] = runs.code_digest(translation.PLUGIN_CODE)
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--results", type=Path, default=Path("data/results"))
    ap.add_argument("--metrics", type=Path, default=Path("metrics"))
    ap.add_argument("--out", type=Path, default=Path("metrics/runs.json"))
    ap.add_argument("--planned", type=Path, metavar="PARAMS_DIR", help="print the planned keys (see above) and exit")


def run(args: argparse.Namespace) -> int:
    if args.planned:
        print(json.dumps(planned(args.planned), indent=1))
        return 0
    out = index(args.results, args.metrics)
    runs.write_json(args.out, out)
    print(f"{out['distinct_runs']} distinct runs, used {out['uses']} times; {out['trained_by_the_latest_stage_runs']} trained by the latest run of their stage")
    return 0
