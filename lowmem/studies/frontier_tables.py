"""Notebook 09's tables, from the frontier's rows (``lowmem.studies.frontier``): ``study`` reads the sweeps, the
trained runs and the budgets into a ``Study``; ``budget_table``, ``paper_comparison`` (ours beside the paper's
headline, ``comparison``), ``predicted_table`` and ``effects_table`` are what the notebook shows, and ``metrics``
what it writes to metrics/combinations.json. The report (notebook 00) writes its headline table into the README
between ``README_BEGIN`` and ``README_END`` (``write_readme_block``).

The captions and the figure are ``frontier_captions``'s, which imports this module: the words need the numbers, not
the other way round.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from lowmem.studies import known
from lowmem.studies.frontier import (LEVERS_BEYOND, LEVERS_PAPER, LEVERS_STAGES_DYNAMICCONV, best_within, beyond_rows,
                                     beyond_rows_dynamicconv, dc_seed_noise, paper_reference, results,
                                     widen_by_seed_noise)
from lowmem.studies.quality_model import EXACT, techniques_config


MEMORY_AT = {"wrn": "WRN-28-2 at batch 128 (full size, accounted)",
             "dynamicconv": "DynamicConv lightconv_iwslt_de_en at 4000 tokens (full size, accounted)"}
QUALITY = {"wrn": "accuracy change (points)", "dynamicconv": "BLEU change"}
METRIC_FIELDS = ("config", "reduction", "quality_change", "quality_low", "quality_high", "quality_n", "time_ratio", "total_mib")
RULES = ("mean", "interval")  # the decision rules of every budget table (quality.RULES)


@dataclass
class Study:
    """What notebook 09 reads: per task (in params.yaml's order of the ``combinations_<task>`` blocks) the accounted
    and trained combinations (``results``), the quality budgets of params.yaml, the ``best_within`` table of each
    budget, and what the trained runs were (``trained_on``: profile, model, data, schedule)."""

    results: dict[str, pd.DataFrame]  # the paper's levers alone
    budgets: dict[str, list[float]]
    best: dict[str, pd.DataFrame]
    trained_on: dict[str, str]
    reference: dict[str, Any]
    beyond: dict[str, pd.DataFrame]  # per task, configurations with a lever beyond the paper (``beyond_rows``)
    best_beyond: dict[str, pd.DataFrame]  # ``best_within`` over the paper's combinations and those, together
    accounted: dict[str, int]  # per task, every combination of the sweep, levers beyond the paper included
    seed_noise: dict[str, Any] | None = None  # what widened DynamicConv's one-seed intervals (``dc_seed_noise``)
    grid: dict[str, pd.DataFrame] = dataclasses.field(default_factory=dict)  # per task, ``results``' whole table

    @property
    def profile(self) -> dict[str, str]:
        """The profile each task's quality and time come from."""
        return {t: r.profile.iloc[0] for t, r in self.results.items()}


def study(sweep_dir: str | Path, metrics_dir: str | Path, params_path: str | Path) -> Study:
    """Reads the sweeps (``sweep_dir``), the trained runs (``metrics_dir``: combinations/, stage 08's
    translation_techniques_train.json and translation.json) and the budgets of ``params_path``."""
    sweep_dir, metrics_dir = Path(sweep_dir), Path(metrics_dir)
    params = yaml.safe_load(Path(params_path).read_text())
    budgets = {k.removeprefix("combinations_"): v["budgets"] for k, v in params.items()
               if k.startswith("combinations_")}
    grid = {task: results(task, sweep_dir, metrics_dir) for task in budgets}
    res = {task: g[~g.beyond].reset_index(drop=True) for task, g in grid.items()}
    wrn_files = sorted((metrics_dir / "combinations").glob("wrn-*.json"))
    if not wrn_files:
        raise FileNotFoundError(f"no trained WRN combination in {metrics_dir / 'combinations'}: "
                                "run `dvc repro combination_wrn`")
    wrn_run = json.loads(wrn_files[0].read_text())  # every slot trains the same model, data and schedule
    dc_run = json.loads((metrics_dir / "translation_techniques_train.json").read_text())
    corpus = json.loads((metrics_dir / "translation.json").read_text())["corpus"]
    profile = {t: r.profile.iloc[0] for t, r in res.items()}
    noise = dc_seed_noise(metrics_dir, profile["dynamicconv"], dc_run["max_update"])
    res["dynamicconv"] = widen_by_seed_noise(res["dynamicconv"], noise)
    if noise is None:
        dc_intervals = ("intervals: paired bootstrap of the test set only, which leaves out training's seed-to-seed "
                        "noise: stage bleu_noise_train has not measured it at this profile and length")
    else:
        dc_intervals = (f"intervals: paired bootstrap of the test set widened by the baseline's seed sd at "
                        f"{noise['updates']} updates, {noise['sd']:.2f} BLEU over {noise['seeds']} seeds "
                        f"(stage bleu_noise_train, on {noise['machine']}), as if both runs of a pair were independent seeds")
    trained_on = {
        "wrn": f"profile `{profile['wrn']}`: {wrn_run['model']} on {wrn_run['data']}, {wrn_run['epochs']} epochs at "
               f"batch {wrn_run['batch_size']}, seeds {wrn_run['seeds']} (each paired with the baseline's)",
        "dynamicconv": f"profile `{profile['dynamicconv']}`: the profile's DynamicConv on {corpus}, "
                       f"{dc_run['max_update']} updates, seed {dc_run['seed']} (sacreBLEU; {dc_intervals})",
    }
    best = {task: pd.concat([best_within(r, budgets[task], rule=rule) for rule in RULES], ignore_index=True)
            for task, r in res.items()}
    # WRN: the grid's own combinations with a lever beyond the paper, each with the study its quality comes from
    # (the combination study's, or a levers stage's arm that the search took the lever's effect from), then the
    # levers studies' arms that the grid does not hold (on top of other levers, or a setting not in the grid).
    wrn_grid = grid["wrn"][grid["wrn"].beyond & grid["wrn"].quality_change.notna()]
    wrn_grid = wrn_grid.assign(**dict(zip(("study", "machine"), _quality_sources_wrn(grid["wrn"], wrn_grid, metrics_dir))))
    # A levers arm the grid trained is the grid's; one it did not train (another setting of the same levers) stays.
    grid_configs = {json.dumps(techniques_config("wrn", json.loads(c)), sort_keys=True) for c in wrn_grid.config}
    beyond = {"wrn": pd.concat([wrn_grid, beyond_rows(metrics_dir, grid_configs)], ignore_index=True),
              "dynamicconv": widen_by_seed_noise(beyond_rows_dynamicconv(sweep_dir, metrics_dir), noise)}
    beyond = {t: b for t, b in beyond.items() if not b.empty}
    for t, b in beyond.items():
        if set(b.profile) != {profile[t]}:
            raise ValueError(f"{t}: the levers beyond the paper trained at profile {sorted(set(b.profile))}, the combinations at "
                             f"{profile[t]!r}: rerun both at one profile")
    for stage in LEVERS_STAGES_DYNAMICCONV:
        levers_dc = metrics_dir / f"{stage}.json"
        if levers_dc.exists() and (n := json.loads(levers_dc.read_text())["max_update"]) != dc_run["max_update"]:
            raise ValueError(f"stage {stage} trained {n} updates but stage 08's baseline "
                             f"{dc_run['max_update']}: rerun both at one length")
    best_beyond = {t: pd.concat([best_within(pd.concat([res[t], b], ignore_index=True), budgets[t], rule=rule)
                                 for rule in RULES], ignore_index=True) for t, b in beyond.items()}
    return Study(results=res, budgets=budgets, best=best, trained_on=trained_on, reference=paper_reference(),
                 beyond=beyond, best_beyond=best_beyond,
                 accounted={task: len(pd.read_csv(sweep_dir / f"{task}_sweep.csv")) for task in budgets},
                 seed_noise=noise, grid=grid)


def _quality_sources_wrn(grid: pd.DataFrame, rows: pd.DataFrame, metrics_dir: Path) -> tuple[list[str], list[str]]:
    """(study, machine) of each WRN row's quality: a levers stage's, where the search took the lever's effect from
    its arm (``results``), or the twin's that an exact row carries; else the combination study's."""
    source = grid.set_index("name").quality_from
    studies = []
    for q in rows.quality_from:
        twin = known.twin_of(q)
        q = source.get(twin, q) if twin else q
        stage = re.match(r"stage (levers\w*), against its own baseline", q)
        studies.append(stage.group(1) if stage else "combination_wrn")
    machines = {s: _machine(metrics_dir, "wrn") if s == "combination_wrn"
                else json.loads((Path(metrics_dir) / f"{s}.json").read_text()).get("machine", "not recorded")
                for s in set(studies)}  # each study's files read once, not once a row
    return studies, [machines[s] for s in studies]


def _machine(metrics_dir: Path, task: str) -> str:
    """The CPU that ran ``task``'s combination slots (one, or all of them named): each slot's metrics record the
    machine of the command that wrote them, which reused any run the store already had."""
    found = {json.loads(f.read_text()).get("machine", "not recorded")
             for f in sorted((Path(metrics_dir) / "combinations").glob(f"{task}-*.json"))}
    return ", ".join(sorted(found))


def comparison(best: dict[str, pd.DataFrame], reference: dict[str, Any], label: dict[str, str],
               levers: str = LEVERS_PAPER) -> pd.DataFrame:
    """Ours beside the paper's: for each task and each rule of ``best``'s tables, our best reduction within the
    paper's own quality budget (the budget is the paper's loss, read from ``reference``). ``best`` maps a task to a
    ``best_within`` table that has that budget; ``label`` says what our numbers are (profile, model, data), since
    they are not the paper's setting. ``levers`` says which levers the rows searched; a task missing from ``best``
    gets a row saying that none of them was trained for it."""
    rows = []
    for task, ref in reference["tasks"].items():
        budget = -ref["quality_change"]
        if task not in best:
            rows.append({"task": task, "levers": levers, "rule": "both", "paper_setting": f"{ref['model']} on {ref['data']}",
                         "budget": f"{budget:g} ({ref['metric']})", "paper_reduction": ref["memory_reduction"],
                         "paper_change": ref["quality_change"], "our_setting": label.get(task, ""),
                         "our_config": "none trained: no lever beyond the paper has quality for this task"})
            continue
        table = best[task]
        rules = table["rule"].unique() if "rule" in table else ["mean"]
        for rule in rules:
            hit = table[((table.budget - budget).abs() < 1e-9) & ((table["rule"] == rule) if "rule" in table else True)]
            if hit.empty:
                raise ValueError(f"{task}: no row for the paper's budget {budget} in our budget table; add it to the budgets")
            ours = hit.iloc[0]
            found = "config" in ours and isinstance(ours.get("config"), str)

            def get(k: str) -> Any:
                return ours.get(k, float("nan")) if found else float("nan")

            rows.append({
                "task": task,
                "levers": levers,
                "rule": rule,
                "paper_setting": f"{ref['model']} on {ref['data']}",
                "budget": f"{budget:g} ({ref['metric']})",
                "paper_reduction": ref["memory_reduction"],
                "paper_change": ref["quality_change"],
                "our_setting": label[task],
                "our_config": ours["config"] if found else "none within the budget",
                "our_reduction": get("reduction"),
                "our_change": get("quality_change"),
                "our_low": get("quality_low"),
                "our_high": get("quality_high"),
                "our_n": get("quality_n"),
                "our_from": get("quality_from"),
                "ours_over_paper": ours["reduction"] / ref["memory_reduction"] if found else float("nan"),
            })
    return pd.DataFrame(rows)


def predicted_table(s: Study) -> pd.DataFrame:
    """WRN's search: every trained combination of two or more lossy levers whose change the singles predict (the
    sum of its levers' effects), beside its measured paired change and interval, and whether the interval holds the
    prediction. (With one lossy lever the prediction is that lever's own measurement.)"""
    r = s.grid["wrn"]  # the search picks among every lever of the grid
    lossy = r.config.map(lambda c: len([d for d in json.loads(c) if d not in EXACT]))
    t = r[r.predicted_change.notna() & r.quality_from.str.startswith("stage") & (lossy > 1)]
    out = t[["name", "role", "reduction", "predicted_change", "quality_change", "quality_low", "quality_high", "quality_n"]].copy()
    out["measured_minus_predicted"] = out.quality_change - out.predicted_change
    out["interval_holds_prediction"] = (out.quality_low <= out.predicted_change) & (out.predicted_change <= out.quality_high)
    return out.sort_values("reduction").reset_index(drop=True)



def effects_table(s: Study) -> pd.DataFrame:
    """Each lossy lever's effect alone, as the search used it (empty before the search has run)."""
    r = s.grid["wrn"]
    singles = r[(r.techniques == 1) & r.quality_from.str.startswith("stage")]
    return singles[["name", "reduction", "quality_change", "quality_low", "quality_high", "quality_n", "time_ratio"]].reset_index(drop=True)


def budget_table(s: Study, task: str) -> pd.DataFrame:
    """For each budget of ``task``, the trained combination with the largest memory reduction within it, with its
    memory by category and in total (the sweep's ``<category>_mib`` columns, in its order), quality change, spread
    over seeds, time ratio and the stage that trained it."""
    memory = [c for c in s.results[task].columns if c.endswith("_mib")]
    columns = ["rule", "budget", "name", "role", *memory, "reduction", "quality_change", "quality_low", "quality_high",
               "quality_n", "time_ratio", "quality_from"]
    t = s.best[task].reindex(columns=columns)
    return pd.concat([t, known.columns(t, _sources(s, task), _widened(s, task))], axis=1)


def _sources(s: Study, task: str) -> dict[str, str]:
    """Where each configuration's quality comes from, by name: what an exact or carried row names as its twin."""
    rows = [s.results[task], s.beyond.get(task, pd.DataFrame())]
    return {n: q for r in rows if "quality_from" in r for n, q in zip(r.name, r.quality_from) if isinstance(q, str) and q}


def _widened(s: Study, task: str) -> bool:
    """Whether ``task``'s one-seed intervals are widened by a measured seed sd (``widen_by_seed_noise``)."""
    return task == "dynamicconv" and s.seed_noise is not None



def _best_configs(best: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """``best`` with the combination's name as its ``config`` (what ``comparison`` and the metrics read)."""
    return {t: b.drop(columns=["config"], errors="ignore").rename(columns={"name": "config"})
            for t, b in best.items()}


def paper_comparison(s: Study) -> pd.DataFrame:
    """Our best reduction within the paper's own quality budget beside the paper's headline (``comparison``), each
    row labelled with the profile, model and data of our quality and the setting of our memory."""
    label = {t: f"{s.trained_on[t]}; memory: {MEMORY_AT[t]}" for t in s.results}
    df = pd.concat([comparison(_best_configs(s.best), s.reference, label),
                    comparison(_best_configs(s.best_beyond), s.reference, label, LEVERS_BEYOND)], ignore_index=True)
    df["budget_value"] = df.task.map({t: -ref["quality_change"] for t, ref in s.reference["tasks"].items()})
    names = {"quality_from": "our_from", "quality_low": "our_low", "quality_high": "our_high", "quality_n": "our_n",
             "budget": "budget_value"}
    parts = [known.columns(g, _sources(s, t), _widened(s, t), names) for t, g in df.groupby("task", sort=False)]
    k = pd.concat(parts).reindex(df.index).rename(columns=lambda c: f"our_{c}")
    return pd.concat([df.drop(columns="budget_value"), k], axis=1)



def _metric_row(row: pd.Series) -> dict[str, Any]:
    """A budget table's row as JSON: floats rounded to 4 places, missing values as null."""
    def value(k: str) -> Any:
        x = row.get(k)
        if pd.isna(x):
            return None
        return round(float(x), 4) if isinstance(x, (float, np.floating)) else x
    return {k: value(k) for k in METRIC_FIELDS}


def metrics(s: Study) -> dict[str, Any]:
    """metrics/combinations.json: the profile of each task, the paper's headline, and per task how many combinations
    were accounted and trained, the largest accounted reduction and the best combination within each budget."""
    best, best_beyond = _best_configs(s.best), _best_configs(s.best_beyond)
    summary: dict[str, Any] = {
        "profile": s.profile,
        "dynamicconv_seed_noise": s.seed_noise,  # None: DynamicConv's intervals are the bootstrap's alone
        "paper": {t: {"reduction": v["memory_reduction"], "quality_change": v["quality_change"]}
                  for t, v in s.reference["tasks"].items()},
    }
    for task, r in s.results.items():
        g = s.grid.get(task, r)  # the whole grid, levers beyond the paper included
        summary[task] = {
            "accounted": s.accounted[task], "accounted_paper_levers": len(r), "with_quality": int(g.quality_change.notna().sum()),
            "with_quality_paper_levers": int(r.quality_change.notna().sum()),
            "max_accounted_reduction": round(float(g.reduction.max()), 2),
            "max_accounted_reduction_paper_levers": round(float(r.reduction.max()), 2),
            "trained_runs": int(g.quality_from.str.startswith("stage").sum()),
            "exact_by_test": int(g.quality_from.str.startswith("exact").sum()),
            "best_within": {rule: {f"{row.budget:g}": _metric_row(row) for _, row in b.iterrows()}
                            for rule, b in best[task].groupby("rule", sort=False)},
        }
        if task in best_beyond:  # the paper's levers and those beyond it (the levers' own studies), together
            b = s.beyond[task]
            summary[task]["beyond_paper_trained"] = int(b.quality_from.str.startswith("stage").sum())
            summary[task]["beyond_paper_exact_by_test"] = int(b.quality_from.str.startswith("exact").sum())
            summary[task]["best_within_beyond"] = {rule: {f"{row.budget:g}": _metric_row(row) for _, row in b.iterrows()}
                                                   for rule, b in best_beyond[task].groupby("rule", sort=False)}
    return summary


README_BEGIN = "<!-- lowmem:headline:begin (written by notebooks/00_report.ipynb; do not edit) -->"
README_END = "<!-- lowmem:headline:end -->"


def write_readme_block(readme: Path, text: str) -> None:
    """Replaces what lies between the README's headline markers with ``text`` (the report's headline table)."""
    content = readme.read_text()
    if README_BEGIN not in content or README_END not in content:
        raise ValueError(f"{readme} has no headline block: add the lines\n{README_BEGIN}\n{README_END}")
    head, rest = content.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_BEGIN}\n{text.strip()}\n{README_END}{tail}")


def readme_block(readme: Path) -> str:
    """The text between the README's headline markers."""
    return readme.read_text().split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()
