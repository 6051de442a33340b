"""What of the combination grid trains. The chosen subset, from memory alone so that it does not move with timing
noise: the baseline and the single techniques named in params.yaml, then for each memory level the combination that
reaches it with the fewest and mildest techniques (see ``select``). Each one is a slot of a DVC ``matrix`` stage.

The quality-aware search (WRN, ``search: true``): the singles are lossy levers trained alone on the same seeds as
the baseline; each one's paired change is its effect, a combination's predicted change is the sum of its levers'
effects (exact levers, ``EXACT``, add zero), and at each memory level the combination with the smallest predicted
loss is trained, then the largest reduction that can be predicted; with ``search_paper``, the same again among the
paper's levers alone. A setting that no single trains can take its effect from a levers stage's arm that trained it
alone (``effects_from``). Predicted against measured is notebook 09's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from lowmem.config import ParamError
from lowmem.studies import quality
from lowmem.studies.combination_grid import CombinationsParams, name, trainable
from lowmem.studies.quality_model import (EXACT, arm_change, beyond_paper_rows, dims, grid_config, paired_change,
                                          predict, selection)
from lowmem.wrn.params import BaselineParams


def select(p: CombinationsParams, memory: pd.DataFrame) -> list[dict[str, Any]]:
    """The combinations to train, in slot order: the baseline, ``p.singles``, then for each level in ``p.levels``
    the not yet chosen combination that reaches it with the fewest techniques, then the mildest settings (ties: the
    larger reduction). DynamicConv leaves out what stage 08 trains (``p.trained_elsewhere``) and, on the CPU, the
    16-bit options that fairseq cannot train there, and the levers beyond the paper (its precision settings beyond
    it, and compressed activations). Each entry is {slot, name, role}."""
    names = set(memory.name)
    chosen: list[dict[str, Any]] = []
    first = [("baseline", "baseline"), *[(name(p, s), "single technique") for s in p.singles]]
    for n, role in first:
        if n not in names:
            raise ParamError(f"combinations_{p.task}.singles: {n} is not in the grid")
        chosen.append({"name": n, "role": role})
    pool = memory[~memory.name.isin([c["name"] for c in chosen])]
    if p.task == "dynamicconv":
        # The levels are the paper's levers': levers beyond it train in stages translation_levers_train,
        # translation_activations_train and translation_kahan_train.
        pool = pool[pool.precision.map(lambda m: trainable(p, m)) & ~beyond_paper_rows(p.task, pool)]
    for level in ([] if p.search else p.levels):  # the search picks its levels after the singles have trained
        reach = pool[pool.reduction >= level]
        if reach.empty:
            raise ParamError(f"combinations_{p.task}.levels: no combination of the grid reaches {level}x (max "
                             f"{memory.reduction.max():.1f}x); lower the level or widen the grid")
        order = sorted(reach.itertuples(), key=lambda r: (r.techniques, r.mildness, -r.reduction))
        chosen.append({"name": order[0].name, "role": f"level {level:g}x"})
        pool = pool[pool.name != order[0].name]
    chosen = [c for c in chosen if c["name"] not in p.trained_elsewhere]
    if len(chosen) + search_slots(p) != p.slots:
        n = len(chosen) + search_slots(p)
        raise ParamError(f"combinations_{p.task}: {n} combinations are chosen but slots={p.slots}; set slots to {n} "
                         f"and list 0..{n - 1} in the matrix of dvc.yaml's stage combination_{p.task}"
                         f"{' and combination_search_wrn' if p.search else ''}")
    configs = memory.set_index("name").config
    return [{"slot": i, **c, "config": json.loads(configs[c["name"]])} for i, c in enumerate(chosen)]


def search_slots(p: CombinationsParams) -> int:
    """Slots the quality-aware search fills after the singles: one per level and the maximum, twice with
    ``search_paper`` (among every lever, then among the paper's alone)."""
    return (len(p.levels) + int(p.search_max)) * (1 + int(p.search_paper)) if p.search else 0


def lever_effects(p: CombinationsParams, trained: list[dict[str, Any]],
                  levers_dir: Path = Path("metrics")) -> dict[tuple[str, Any], tuple[quality.Paired, str]]:
    """Each lossy lever's effect alone, (dimension, setting) → (its paired change, where it was trained), from the
    trained singles (``trained``: the metrics of the slots, the baseline among them), then from the arms of
    ``p.effects_from``'s stages (``levers_dir/<stage>.json``) that set one setting of the grid alone and that no
    single trains, each paired with its own study's baseline."""
    by_name = {r["name"]: r for r in trained}
    if "baseline" not in by_name:
        raise FileNotFoundError("the search needs the trained baseline (slot 0): run `dvc repro combination_wrn`")
    effects = {}
    for single in p.singles:
        (dim, value), = single.items()
        n = name(p, single)
        if n not in by_name:
            raise FileNotFoundError(f"the search needs the trained single {n}: run `dvc repro combination_wrn`")
        effects[(dim, value)] = (paired_change(by_name[n], by_name["baseline"]), f"slot {by_name[n]['slot']}")
    for stage in p.effects_from:
        path = Path(levers_dir) / f"{stage}.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: the search takes lever effects from stage {stage} "
                                    f"(combinations_wrn.effects_from); run `dvc repro {stage}`")
        res = json.loads(path.read_text())
        base = BaselineParams(**p.train)
        theirs = (res["profile"], res["seeds"], res["model"], res["epochs"], res["batch_size"])
        ours = (p.profile, p.train_seeds, base.model, base.epochs, base.batch_size)
        if theirs != ours:
            raise FileNotFoundError(f"{path} trained (profile, seeds, model, epochs, batch) {theirs}, not {ours}: "
                                    f"rerun stage {stage} (dvc repro {stage})")
        for arm in res["arms"]:
            cfg = grid_config(p.task, res["arms"][arm]["techniques"])
            if len(cfg) != 1:
                continue
            (dim, value), = cfg.items()
            if dim in dims(p.task) and dim not in EXACT and value in getattr(p, dim) and (dim, value) not in effects:
                effects[(dim, value)] = (arm_change(res, arm, "baseline"), f"stage {stage}")
    return effects


def search(p: CombinationsParams, memory: pd.DataFrame, effects: dict[tuple[str, Any], quality.Paired],
           chosen: list[str]) -> list[dict[str, Any]]:
    """The levels' combinations: at each level, among the combinations not yet ``chosen`` that reach it and whose
    change can be predicted, the one with the smallest predicted loss; ties (combinations that differ by exact
    levers) go to the lower time ratio, then the smaller reduction. With ``p.search_max``, then the largest
    reduction that can be predicted. With ``p.search_paper``, then the same again among the combinations of the
    paper's levers alone that are not picked yet. Each entry is {name, role, config, predicted_change}."""
    pool = memory.assign(predicted_change=predict(memory, effects))
    pool = pool[pool.predicted_change.notna() & ~pool.name.isin(chosen)]
    picks = _search_levels(p, pool, "")
    if p.search_paper:
        paper = pool[~beyond_paper_rows(p.task, pool) & ~pool.name.isin([c["name"] for c in picks])]
        picks += _search_levels(p, paper, " (the paper's levers)")
    return picks


def _search_levels(p: CombinationsParams, pool: pd.DataFrame, among: str) -> list[dict[str, Any]]:
    """``search``'s picks from ``pool`` (predicted, not yet chosen); ``among`` ends each role."""
    picks = []
    for level in p.levels:
        reach = pool[pool.reduction >= level]
        if reach.empty:
            raise ParamError(f"combinations_{p.task}.levels: no combination whose quality can be predicted reaches "
                             f"{level:g}x{among} (max {pool.reduction.max():.1f}x); lower the level or train more singles")
        best = reach.sort_values(["predicted_change", "time_ratio", "reduction"], ascending=[False, True, True]).iloc[0]
        picks.append({"name": best["name"], "role": f"search {level:g}x{among}", "config": json.loads(best.config),
                      "predicted_change": round(float(best.predicted_change), 4)})
        pool = pool[pool.name != best["name"]]
    if p.search_max:
        best = pool.sort_values(["reduction", "predicted_change"], ascending=[False, False]).iloc[0]
        picks.append({"name": best["name"], "role": f"search maximum{among}", "config": json.loads(best.config),
                      "predicted_change": round(float(best.predicted_change), 4)})
    return picks


def search_step(p: CombinationsParams, sweep_dir: Path, metrics_dir: Path, levers_dir: Path = Path("metrics")) -> dict[str, Any]:
    """The search's output (``data/combinations/wrn_search.json``): each lever's effect alone and the levels' picks,
    slots numbered after the sweep's selection."""
    selected = json.loads((sweep_dir / f"{p.task}_selected.json").read_text())["selected"]
    trained = []
    for c in selected:
        f = metrics_dir / f"{p.task}-{c['slot']}.json"
        if not f.exists():
            raise FileNotFoundError(f"{f} is missing: train the singles first (dvc repro combination_{p.task})")
        r = json.loads(f.read_text())
        if r["name"] != c["name"] or r["seeds"] != p.train_seeds:
            raise FileNotFoundError(f"{f} holds {r['name']} on seeds {r['seeds']}, not {c['name']} on {p.train_seeds}: "
                                    f"retrain it (dvc repro combination_{p.task})")
        trained.append(r)
    effects = lever_effects(p, trained, levers_dir)
    memory = pd.read_csv(sweep_dir / f"{p.task}_sweep.csv")
    picks = search(p, memory, {k: e for k, (e, _) in effects.items()}, [c["name"] for c in selected])
    return {"profile": p.profile, "seeds": p.train_seeds,
            "effects": [{"lever": d, "setting": v, "change": e.mean, "low": e.low, "high": e.high, "n": e.n, "from": src}
                        for (d, v), (e, src) in effects.items()],
            "selected": [{"slot": len(selected) + i, **c} for i, c in enumerate(picks)]}


def chosen_slots(p: CombinationsParams, sweep_dir: Path) -> list[dict[str, Any]]:
    """Every slot to train: the sweep's selection, then the search's picks where the search is on and has run."""
    chosen = selection(p.task, sweep_dir)["selected"]
    return chosen if p.search else [c for c in chosen if not c["role"].startswith("search")]

