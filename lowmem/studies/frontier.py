"""The memory-quality frontier of combined techniques (Sohoni et al. 2019, the combination study): which
configurations are Pareto-optimal, the best memory reduction within a quality budget, and how that compares with the
paper's headline numbers.

Plain pandas on a table with one row per configuration, so the same code reads a cpu-profile run or a GPU run.
Quality is a change against the baseline (accuracy points or BLEU; higher is better) and memory a reduction factor
(baseline peak / configuration's peak; higher is better).

The end of the module is notebook 09's: ``study`` reads the sweeps, the trained runs and the budgets; ``figure``,
``budget_table``, ``paper_comparison``, their captions, ``tables`` and ``metrics`` make what the notebook shows and
writes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import yaml
from matplotlib.figure import Figure

from lowmem.studies import known, quality
from lowmem.studies.quality_model import (EQUAL_UP_TO_DROPOUT_DYNAMICCONV, EQUAL_UP_TO_DROPOUT_PRECISIONS, EXACT,
                                          EXACT_DYNAMICCONV, EXACT_DYNAMICCONV_PRECISIONS, EXACT_MICROBATCH_OPTION, LEVERS_STAGES,
                                          OPTIONAL_DIMS, arm_change, beyond_paper, beyond_paper_rows, dims, paired_change,
                                          predict, selection, techniques_config)

REFERENCE = Path(__file__).with_name("paper_reference.yaml")


def pareto(df: pd.DataFrame, x: str = "reduction", y: str = "quality_change") -> pd.Series:
    """True for each row that no other row dominates: none has ``x`` and ``y`` both at least as high, one of them
    higher. Rows with a missing ``y`` (not trained) are never on the frontier."""
    pts = df[[x, y]].to_numpy(dtype=float)
    out = []
    for i, (xi, yi) in enumerate(pts):
        if pd.isna(yi) or pd.isna(xi):
            out.append(False)
            continue
        dominated = any(
            xj >= xi and yj >= yi and (xj > xi or yj > yi) for j, (xj, yj) in enumerate(pts) if j != i and not pd.isna(yj)
        )
        out.append(not dominated)
    return pd.Series(out, index=df.index, name="pareto")


def best_within(
    df: pd.DataFrame, budgets: list[float], x: str = "reduction", y: str = "quality_change", cost: str = "time_ratio",
    rule: str = "mean",
) -> pd.DataFrame:
    """One row per budget b: the configuration with the largest ``x`` among those within b by ``rule``
    (``lowmem.studies.quality.within_budget`` on ``y`` and its interval ``quality_low``/``quality_high`` where the
    table has them), ties going to the lower ``cost``. A budget no configuration meets gives a row with no
    configuration. Every row says its ``rule``."""
    rows = []
    trained = df[df[y].notna()]
    low = trained["quality_low"] if "quality_low" in trained else pd.Series(np.nan, index=trained.index)
    high = trained["quality_high"] if "quality_high" in trained else pd.Series(np.nan, index=trained.index)
    for b in budgets:
        within = [quality.within_budget(quality.Paired(float(m), float(lo), float(hi), 0, np.nan), b, rule)
                  for m, lo, hi in zip(trained[y], low, high)]
        ok = trained[within]
        if ok.empty:
            rows.append(pd.Series({"rule": rule, "budget": b}))
            continue
        order = ok.sort_values([x, cost] if cost in ok else [x], ascending=[False, True] if cost in ok else [False])
        rows.append(pd.Series({"rule": rule, "budget": b, **order.iloc[0].to_dict()}))
    columns = ["rule", "budget", *[c for c in df.columns if c not in ("rule", "budget")]]
    return pd.DataFrame(rows).reindex(columns=columns).reset_index(drop=True)


def _exact_fill(df: pd.DataFrame, task: str, exact: dict[str, str] = EXACT, precisions: tuple[str, ...] | None = None,
                dropout: dict[str, str] | None = None, dropout_precisions: tuple[str, ...] = ()) -> None:
    """Quality for the untrained rows that differ from a trained one only by ``exact`` levers: that run's, with the
    test that makes it exact as its source. ``precisions``: the only precisions the test covers (None: all). With
    compressed activations checkpointing is not exact (what a segment recomputes is kept as computed, the plain
    step's saved tensors packed), so those rows neither give nor take a twin's quality.

    ``dropout``: levers equal up to dropout draws (DynamicConv's exact microbatching), carried the same way on rows
    whose options hold ``EXACT_MICROBATCH_OPTION`` in ``dropout_precisions``; such a row says so ("equal up to dropout
    draws, by test ..."), and where its twin is the baseline its interval is left to ``widen_by_seed_noise``. A
    microbatch setting of another kind (fairseq's --update-freq, another batching) is a lossy lever here."""
    dropout = dropout or {}
    lossy = [d for d in dims(task) if d not in exact and d not in dropout]

    def key(r: pd.Series) -> tuple:
        # Off, or equal up to dropout draws (exact microbatching where the test covers the precision): any setting
        # will do; else the setting and its kind (exact, or fairseq's other batching) must match.
        split = EXACT_MICROBATCH_OPTION in str(r.get("options", ""))
        carried = split and r["precision"] in dropout_precisions
        return tuple(r[d] for d in lossy) + tuple(None if r[d] in (0, 1) or carried else (r[d], split) for d in dropout)

    def levers_on(r: pd.Series) -> int:
        return sum(r[d] not in (0, 1, "none") for d in [*exact, *dropout])

    trained = df[df.quality_change.notna()]
    if precisions is not None:
        trained = trained[trained.precision.isin(precisions)]
    plain = (df.activation_bits == 0) if "activation_bits" in df else pd.Series(True, index=df.index)
    trained = trained[plain[trained.index]]
    measured: dict[tuple, pd.Series] = {}
    for _, r in trained.iterrows():
        k = key(r)
        # With dropout levers, the twin is the plainest run of the key (the baseline before its checkpointed run):
        # a row equal to the baseline up to dropout draws is the baseline's, whichever exact twin was trained too.
        if k not in measured or (dropout and levers_on(r) < levers_on(measured[k])):
            measured[k] = r
    for i, r in df[df.quality_change.isna() & plain].iterrows():
        twin = measured.get(key(r))
        if twin is None:
            continue
        cols = ["quality_change", "quality_low", "quality_high", "quality_n"]
        df.loc[i, cols] = [twin[c] for c in cols]
        if any(r[d] != twin[d] for d in dropout):
            tests = "; ".join([*dropout.values(), *exact.values()])
            df.loc[i, "quality_from"] = f"equal up to dropout draws, by test {tests}: {twin['name']}'s run"
            if twin["name"] == "baseline":  # the baseline against itself, but with other dropout draws: two seeds' noise
                df.loc[i, ["quality_low", "quality_high"]] = [np.nan, np.nan]
        else:
            df.loc[i, "quality_from"] = f"exact, by test {'; '.join(exact.values())}: {twin['name']}'s run{'s' if exact is EXACT else ''}"


def results(task: str, sweep_dir: Path, metrics_dir: Path) -> pd.DataFrame:
    """The sweep's table with what was trained joined in: ``quality_change`` against the baseline (accuracy points
    for WRN, sacreBLEU for DynamicConv) with its 95% interval (``quality_low``, ``quality_high``: WRN's paired over
    ``quality_n`` seeds, DynamicConv's paired bootstrap of one seed's test set where it was computed, which ``study``
    widens by the seed noise, ``widen_by_seed_noise``; DynamicConv's from stage 08, the combination study, then the
    levers stages' arms of the paper's levers, ``paper_arms_dynamicconv``), where the
    quality comes from (``quality_from``), the predicted change of the search (WRN), the time ratio, whether the
    combination uses a lever beyond the paper (``beyond``: ``quality_model.beyond_paper_rows``),
    and whether the point is Pareto-optimal in (reduction, quality change) among the paper's levers alone.
    DynamicConv's rows beyond the paper (its precision settings beyond it, compressed activations) are accounted
    points here, without quality: their runs are ``beyond_rows_dynamicconv``'s."""
    df = pd.read_csv(sweep_dir / f"{task}_sweep.csv")
    for d in set(OPTIONAL_DIMS) & set(dims(task)) - set(df):
        df[d] = OPTIONAL_DIMS[d]  # a table made before the grid had this dimension: its rows have it off
    if missing := [d for d in dims(task) if d not in df]:
        raise ValueError(f"{sweep_dir / f'{task}_sweep.csv'} has no column {missing}: it was made for another grid; "
                         f"rerun the sweep (dvc repro combinations_sweep_{task})")
    df["beyond"] = beyond_paper_rows(task, df)  # DynamicConv's: accounted points here, their runs are beyond_rows_dynamicconv's
    selected = selection(task, sweep_dir)
    chosen = selected["selected"]
    runs = [json.loads(f.read_text()) for f in sorted((metrics_dir / "combinations").glob(f"{task}-*.json"))]
    runs = [r for r in runs if r["slot"] < len(chosen) and r["name"] == chosen[r["slot"]]["name"]]
    role = {c["name"]: c["role"] for c in chosen}
    df["role"] = df.name.map(role).fillna("")
    for col in ("quality_change", "quality_low", "quality_high", "quality_n", "predicted_change"):
        df[col] = float("nan")
    df["quality_from"] = ""
    profile = {selected["profile"]}
    if task == "wrn":
        by = {r["name"]: r for r in runs}
        if "baseline" not in by:
            raise FileNotFoundError(f"no trained WRN baseline in {metrics_dir / 'combinations'}: run `dvc repro combination_wrn`")
        for n, r in by.items():
            c = paired_change(r, by["baseline"])
            i = df.index[df.name == n]
            df.loc[i, ["quality_change", "quality_low", "quality_high", "quality_n"]] = [c.mean, c.low, c.high, c.n]
            df.loc[i, "quality_from"] = f"stage combination_{'search_' if r['role'].startswith('search') else ''}wrn@{r['slot']}"
            profile.add(r["profile"])
        if "effects" in selected:
            effects = {(e["lever"], e["setting"]): quality.Paired(e["change"], e["low"], e["high"], e["n"], np.nan)
                       for e in selected["effects"]}
            df["predicted_change"] = predict(df, effects)
            # A lever's effect the search took from a levers stage (effects_from) is that setting's quality measured
            # alone: its row shows it, the exact twins below carry it, and the headline can pick it like a trained slot.
            for e in selected["effects"]:
                if e.get("from", "").startswith("stage "):
                    i = df.index[(df.config == json.dumps({e["lever"]: e["setting"]})) & df.quality_change.isna()]
                    df.loc[i, ["quality_change", "quality_low", "quality_high", "quality_n"]] = [e["change"], e["low"], e["high"], e["n"]]
                    df.loc[i, "quality_from"] = f"{e['from']}, against its own baseline"
        _exact_fill(df, task)
    else:
        stage08 = json.loads((metrics_dir / "translation_techniques_train.json").read_text())
        profile.add(stage08["profile"])
        base = next(r["sacrebleu"] for r in stage08["trained"] if r["technique"] == "baseline")
        df["time_ratio"] = df.name.map(stage08["time_ratio"])
        for r in stage08["trained"]:
            i = df.index[df.name == r["technique"]]
            df.loc[i, ["quality_change", "quality_low", "quality_high", "quality_n"]] = [
                r["sacrebleu"] - base, r.get("sacrebleu_change_low", np.nan), r.get("sacrebleu_change_high", np.nan), 1]
            df.loc[i, "quality_from"] = "stage translation_techniques_train"
        for r in runs:
            if r["max_update"] != stage08["max_update"]:
                raise ValueError(f"{r['name']} trained {r['max_update']} updates but stage 08's baseline {stage08['max_update']}: rerun both")
            i = df.index[df.name == r["name"]]
            # Runs trained before the paired bootstrap have no interval.
            # The change and its interval from one pair: the run's own bootstrap against the baseline it trained
            # beside (stage 08's command); older runs are against stage 08's recorded score.
            df.loc[i, ["quality_change", "quality_low", "quality_high", "quality_n", "time_ratio", "quality_from"]] = [
                r.get("sacrebleu_change", r["sacrebleu"] - base), r.get("sacrebleu_change_low", np.nan), r.get("sacrebleu_change_high", np.nan), 1,
                r["time_ratio"], f"stage combination_dynamicconv@{r['slot']}"]
            profile.add(r["profile"])
        profile |= paper_arms_dynamicconv(df, metrics_dir, stage08["max_update"])
        _exact_fill(df, task, EXACT_DYNAMICCONV, EXACT_DYNAMICCONV_PRECISIONS, EQUAL_UP_TO_DROPOUT_DYNAMICCONV,
                    EQUAL_UP_TO_DROPOUT_PRECISIONS)
    if len(profile) != 1:
        raise ValueError(f"{task}: the sweep and the trained runs come from different profiles {sorted(profile)}: rerun `dvc repro`")
    df["profile"] = profile.pop()
    df["pareto"] = False
    df.loc[~df.beyond, "pareto"] = pareto(df[~df.beyond])
    return df


LEVERS_PAPER, LEVERS_BEYOND = "the paper's", "the paper's and beyond"  # the headline rows' ``levers``



def beyond_rows(metrics_dir: Path, grid_configs: set[str] = frozenset()) -> pd.DataFrame:
    """WRN's configurations with a lever beyond the paper, from stages levers_train and levers_state_train
    (``metrics/<stage>.json``): each arm's accuracy change paired by seed with the baseline trained beside it in the
    same study, its full-size memory reduction against that baseline, and its time per step against it, from the
    training runs. An arm in both studies is the first one's. An arm whose configuration (JSON, sorted keys) is in
    ``grid_configs`` is the combination grid's, which the grid's own study measures against its own baseline, so it
    is left out here. Empty without either file."""
    rows: list[dict[str, Any]] = []
    for stage in LEVERS_STAGES:
        path = Path(metrics_dir) / f"{stage}.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        arms = res["arms"]
        base = arms["baseline"]
        for name, arm in arms.items():
            if (not beyond_paper(arm["techniques"]) or any(r["name"] == name for r in rows)
                    or json.dumps(arm["techniques"], sort_keys=True) in grid_configs):
                continue
            c = arm_change(res, name, "baseline")
            rows.append({"name": name, "config": json.dumps(arm["techniques"]), "role": "beyond the paper",
                         **{k: v for k, v in arm["memory"].items()},
                         "reduction": base["memory"]["total_mib"] / arm["memory"]["total_mib"],
                         "quality_change": c.mean, "quality_low": c.low, "quality_high": c.high, "quality_n": c.n,
                         "time_ratio": float(np.median(arm["step_s"]) / np.median(base["step_s"])),
                         "quality_from": f"stage {stage}", "profile": res["profile"], "study": stage,
                         "machine": res.get("machine", "not recorded")})
    return pd.DataFrame(rows)


def dc_seed_noise(metrics_dir: Path, profile: str, updates: int) -> dict[str, Any] | None:
    """The DynamicConv baseline's seed sd of sacreBLEU at ``updates``, from stage bleu_noise_train
    (``metrics/bleu_noise_train.json``), when that study ran at ``profile`` and decoded that length; else None, and
    the intervals stay the bootstrap's (``study``'s setting text says so)."""
    path = Path(metrics_dir) / "bleu_noise_train.json"
    if not path.exists():
        return None
    res = json.loads(path.read_text())
    if res.get("profile") != profile or updates not in res.get("updates", []):
        return None
    bleu = quality.seed_scores(res, updates)
    if len(bleu) < 2:
        raise ValueError(f"{path} has {len(bleu)} seed at {updates} updates; a seed sd needs two or more: rerun "
                         "stage bleu_noise_train with more translation_techniques.noise_seeds")
    return {"sd": statistics.stdev(bleu), "seeds": len(bleu), "updates": updates,
            "machine": res.get("machine", "not recorded")}


def widen_by_seed_noise(df: pd.DataFrame, noise: dict[str, Any] | None) -> pd.DataFrame:
    """DynamicConv's one-seed rows with their bootstrap interval widened by ``noise`` (``dc_seed_noise``;
    ``quality.with_seed_noise``, which leaves a missing interval and the baseline's own run as they are); a row equal
    to the baseline up to dropout draws gets two seeds' noise about zero (``quality.dropout_draws``)."""
    df = df.copy()
    if noise is None or df.empty:
        return df
    draws = df.quality_from.map(known.kind) == known.DROPOUT if "quality_from" in df else pd.Series(False, index=df.index)
    for i in df.index[df.quality_n == 1]:
        if draws[i]:  # the baseline with other dropout draws
            c = quality.dropout_draws(noise["sd"], noise["seeds"])
        else:
            c = quality.with_seed_noise(quality.Paired(float(df.at[i, "quality_change"]), float(df.at[i, "quality_low"]),
                                                       float(df.at[i, "quality_high"]), 1, np.nan), noise["sd"], noise["seeds"])
        df.loc[i, ["quality_low", "quality_high"]] = [c.low, c.high]
    return df


LEVERS_STAGES_DYNAMICCONV = ("translation_levers_train", "translation_activations_train", "translation_kahan_train")  # one machine each


def beyond_rows_dynamicconv(sweep_dir: Path, metrics_dir: Path) -> pd.DataFrame:
    """DynamicConv's configurations with a lever beyond the paper, from stages ``LEVERS_STAGES_DYNAMICCONV``
    (``metrics/<stage>.json``): each trained technique's sacreBLEU change against the baseline trained beside it in
    the same study (paired bootstrap of the test set), and its time per update against that baseline. A technique
    the sweep holds (8-bit Adam or Kahan's all-bf16, settings of the grid's precision, or compressed activations)
    takes the sweep's full-size memory, and a combination that differs from it only by checkpointing (exact by
    test, and not with compressed activations) carries its quality; one the sweep does not hold (a bit width
    outside its list) takes the memory its own stage accounted, against that stage's baseline. An arm in two
    studies is the first one's. Empty without any of the files."""
    paths = {st: p for st in LEVERS_STAGES_DYNAMICCONV if (p := Path(metrics_dir) / f"{st}.json").exists()}
    if not paths:
        return pd.DataFrame()
    sweep = pd.read_csv(Path(sweep_dir) / "dynamicconv_sweep.csv")
    in_sweep = set(sweep.name)
    frames: list[pd.DataFrame] = []
    for stage, path in paths.items():
        res = json.loads(path.read_text())
        df = sweep[beyond_paper_rows("dynamicconv", sweep)].reset_index(drop=True)
        mem = res.get("memory", {})
        extra = [r["technique"] for r in res["trained"] if r["technique"] != "baseline" and r["technique"] not in in_sweep]
        if missing := [t for t in [*extra, "baseline"] if extra and t not in mem]:
            raise ValueError(f"{path}: no full-size memory recorded for {missing}, needed for {extra}, which the DynamicConv "
                             f"sweep does not hold: rerun stage {stage}")
        if extra and not np.isclose(mem["baseline"]["total_mib"], sweep.loc[sweep.name == "baseline", "total_mib"].iloc[0]):
            # Reductions against two baselines would not compare: the sweep and the stage account the same command.
            raise ValueError(f"{path}: its baseline's memory differs from the DynamicConv sweep's: rerun stage {stage} "
                             "and the sweep (dvc repro combinations_sweep_dynamicconv) with the same recipe")
        df = pd.concat([df, pd.DataFrame([{"name": t, "config": json.dumps({"options": t}), **mem[t],
                                           "reduction": mem["baseline"]["total_mib"] / mem[t]["total_mib"]} for t in extra])],
                       ignore_index=True)
        for col in ("quality_change", "quality_low", "quality_high", "quality_n", "time_ratio"):
            df[col] = float("nan")
        df["quality_from"] = ""
        for r in res["trained"]:
            i = df.index[df.name == r["technique"]]
            df.loc[i, ["quality_change", "quality_low", "quality_high", "quality_n", "time_ratio"]] = [
                r["sacrebleu_change"], r["sacrebleu_change_low"], r["sacrebleu_change_high"], 1, res["time_ratio"].get(r["technique"], np.nan)]
            df.loc[i, "quality_from"] = f"stage {stage}"
        _exact_fill(df, "dynamicconv", EXACT_DYNAMICCONV, EXACT_DYNAMICCONV_PRECISIONS, EQUAL_UP_TO_DROPOUT_DYNAMICCONV,
                    EQUAL_UP_TO_DROPOUT_PRECISIONS)
        df = df[df.quality_change.notna()].reset_index(drop=True)
        df["role"], df["profile"], df["study"] = "beyond the paper", res["profile"], stage
        df["machine"] = res.get("machine", "not recorded")
        frames.append(df)
    out = pd.concat(frames, ignore_index=True)
    return out[~out.name.duplicated()].reset_index(drop=True)


def paper_arms_dynamicconv(df: pd.DataFrame, metrics_dir: Path, updates: int) -> set[str]:
    """Fills in ``df`` (DynamicConv's combinations of the paper's levers, ``results``) the quality and time of the
    rows that neither stage 08 nor the combination study trained but a levers stage (``LEVERS_STAGES_DYNAMICCONV``)
    did, as a control beside its levers (update-freq 16 in stage translation_kahan_train): the arm's sacreBLEU change
    against the baseline trained beside it, as every other row's is against its own. Without this, the rows "the
    paper's" would miss a configuration of the paper's own levers that was trained and scored. An arm in two stages
    is the first one's. ``updates``: stage 08's length, which each stage that gives a row must have trained.
    Returns the profiles of the stages that gave a row."""
    profiles: set[str] = set()
    for stage in LEVERS_STAGES_DYNAMICCONV:
        path = Path(metrics_dir) / f"{stage}.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        for r in res["trained"]:
            i = df.index[(df.name == r["technique"]) & df.quality_change.isna() & ~df.beyond]
            if r["technique"] == "baseline" or i.empty:
                continue
            if res["max_update"] != updates:
                raise ValueError(f"stage {stage} trained {res['max_update']} updates but stage 08's baseline {updates}: "
                                 "rerun both at one length")
            df.loc[i, ["quality_change", "quality_low", "quality_high", "quality_n", "time_ratio", "quality_from"]] = [
                r["sacrebleu_change"], r["sacrebleu_change_low"], r["sacrebleu_change_high"], 1,
                res["time_ratio"].get(r["technique"], np.nan), f"stage {stage}"]
            profiles.add(res["profile"])
    return profiles


def paper_reference(path: Path = REFERENCE) -> dict[str, Any]:
    """The paper's headline figures and their citation, from the project's one reference file."""
    return yaml.safe_load(path.read_text())


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


# --- notebook 09: the frontier, the budget tables and the comparison with the paper, from the stages' results -----

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


def overview(s: Study) -> str:
    """One line per task (Markdown): how many combinations were accounted and trained, and the largest reduction."""
    def line(task: str, r: pd.DataFrame) -> str:
        g = s.grid.get(task, r)
        return (f"**{task}**: {s.accounted[task]} combinations accounted ({len(r)} of the paper's levers alone), "
                f"{int(g.quality_change.notna().sum())} with a quality ({int(r.quality_change.notna().sum())} of the "
                f"paper's levers alone); best accounted reduction {g.reduction.max():.1f}x "
                f"({g.loc[g.reduction.idxmax(), 'name']}), {r.reduction.max():.1f}x with the paper's levers alone.")
    return "\n\n".join(line(task, r) for task, r in s.results.items())


FRONTIER_CAPTION = (
    "Memory: accounted peak of one full-size training step (exact; the same in every profile). Quality: runs at "
    "the stated profile, never the paper's CIFAR-10 or IWSLT'14 unless the profile is `paper`. Error bars: the 95% "
    "interval of the paired change (WRN: over seeds; DynamicConv: one seed's paired bootstrap of the test set, where "
    "computed, widened by the baseline's seed-to-seed sd where measured at that length, as the setting says). Diamonds: combinations that differ from a trained one only by checkpointing, which is exact by test, "
    "or also by DynamicConv's exact microbatching, equal up to dropout draws by test (two seeds' noise as the interval "
    "where the trained one is the baseline), so they carry its quality. White points: time per step not measured at this profile. The black line: the Pareto "
    "frontier of the paper's levers alone. Stars: configurations with a lever beyond the paper. WRN: the grid's "
    "compressed activations, 8-bit momentum and Kahan-compensated bf16, timed by the same sweep; compressed activations "
    "trained alone and in the search's picks beside the same baseline, 8-bit momentum and Kahan alone beside their own "
    "stages' baselines on the same seeds, and those stages' arms on top of other levers, timed by those runs. DynamicConv: 8-bit Adam moments and Kahan-compensated all-bf16 (settings of the grid's precision) and "
    "compressed activations (a dimension of the grid), one seed beside each study's own "
    "baseline, their intervals as the other DynamicConv points', timed by those runs. One machine per study; a white "
    "star is the twin of a trained one.")


def figure(s: Study) -> Figure:
    """Figures/09_frontier.png: per task, memory reduction (log) against quality change (symlog) of every combination
    with a quality (trained, or exact by test), coloured by time per step, with 95% intervals, the Pareto frontier,
    the paper's budget and a rug of every accounted reduction. Labels: the trained points on the frontier and the
    search's picks, staggered so that they do not overlap."""
    sns.set_theme(style="whitegrid")
    fig, axes = plt.subplots(1, len(s.results), figsize=(16, 6.4), gridspec_kw={"wspace": 0.25})
    norm = plt.Normalize(0.5, 2.5)
    cmap = sns.color_palette("flare", as_cmap=True)
    # Before anything is placed: the colour bar takes its width from the axes, which would move the labels' points.
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes,
                 label="time per step / baseline (active profile)", shrink=0.8)
    key_lines = 0
    for ax, (task, r) in zip(axes, s.results.items()):
        t = r[r.quality_change.notna()].sort_values("reduction")
        exact = t.quality_from.str.startswith("exact")
        twin = exact | t.quality_from.str.startswith(known.DROPOUT)  # a trained run's quality, carried
        for mask, marker, size in ((~twin, "o", 70), (twin, "D", 28)):
            timed = mask & t.time_ratio.notna()
            ax.scatter(t.reduction[timed], t.quality_change[timed], c=t.time_ratio[timed], cmap=cmap, norm=norm,
                       s=size, marker=marker, edgecolor="black", linewidth=0.6, zorder=3)
            untimed = mask & t.time_ratio.isna()
            if untimed.any():
                ax.scatter(t.reduction[untimed], t.quality_change[untimed], facecolor="white", edgecolor="black",
                           s=size, marker=marker, zorder=3, label="time not measured" if marker == "o" else None)
        b = s.beyond.get(task, pd.DataFrame())
        if not b.empty:  # apart from the paper's levers: another marker, and out of the paper's Pareto frontier
            timed = b.time_ratio.notna()
            ax.scatter(b.reduction[timed], b.quality_change[timed], c=b.time_ratio[timed], cmap=cmap, norm=norm, s=150,
                       marker="*", edgecolor="black", linewidth=0.6, zorder=4, label="with a lever beyond the paper")
            if (~timed).any():  # exact twins of a trained one (checkpointing added): quality by test, time not measured
                ax.scatter(b.reduction[~timed], b.quality_change[~timed], facecolor="white", s=150, marker="*",
                           edgecolor="black", linewidth=0.6, zorder=4)
            ax.errorbar(b.reduction, b.quality_change, fmt="none", ecolor="tab:green", lw=0.9, capsize=2, zorder=2,
                        yerr=[b.quality_change - b.quality_low, b.quality_high - b.quality_change])
        bars = t[~exact & t.quality_low.notna()]
        if not bars.empty:
            ax.errorbar(bars.reduction, bars.quality_change, fmt="none", ecolor="grey", lw=0.9, capsize=2, zorder=2,
                        yerr=[bars.quality_change - bars.quality_low, bars.quality_high - bars.quality_change])
        front = t[t.pareto].sort_values("reduction")
        ax.plot(front.reduction, front.quality_change, color="black", lw=1.2, zorder=1, label="Pareto frontier")
        # symlog: losses of tenths of a point and a collapsed run of tens of points on one axis
        ax.set_yscale("symlog", linthresh=1)
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo * 1.8 if lo < -1 else lo - 0.8, hi + 1)
        g = s.grid.get(task, r)  # every accounted combination, levers beyond the paper included
        ax.plot(g.reduction, np.full(len(g), ax.get_ylim()[0]), "|", color="grey", alpha=0.4, ms=8)
        ref = s.reference["tasks"][task]
        ax.axhline(ref["quality_change"], color="tab:blue", ls=":", lw=1)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xscale("log")
        ax.text(ax.get_xlim()[1], ref["quality_change"], f"paper's budget ({ref['quality_change']:+g}) ", color="tab:blue",
                fontsize=7, va="top", ha="right")
        # Numbers at the points and the names in a key under the axes: long names at crowded points overlap. Once
        # the scales are set, a number whose box (in points: 5 per digit and 3 apart wide, 8 high) would overlap
        # one already placed goes up a line until it is clear.
        labelled = pd.concat([t[t.pareto | t.role.str.startswith("search")], b])
        key, boxes = [], []
        for k, row in enumerate(labelled.itertuples(), start=1):
            x, y = ax.transData.transform((row.reduction, row.quality_change)) * 72 / fig.dpi
            box = [x + 4, x + 7 + 5 * len(str(k)), y + 4, y + 12]
            while any(box[0] < b1 and b0 < box[1] and box[2] < c1 and c0 < box[3] for b0, b1, c0, c1 in boxes):
                box[2:] = [box[2] + 9, box[3] + 9]
            boxes.append(box)
            ax.annotate(str(k), (row.reduction, row.quality_change), textcoords="offset points",
                        xytext=(4, box[2] - y), fontsize=7, fontweight="bold", zorder=6,  # over the stars (zorder 4)
                        bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.75})
            key.append(f"{k}: {row.name} ({row.reduction:.1f}x, {row.quality_change:+.2f})")
        ax.text(0.0, -0.2, "\n".join(key), transform=ax.transAxes, va="top", ha="left", fontsize=7)
        key_lines = max(key_lines, len(key))
        ax.set(xlabel=f"memory reduction (x, log scale)\n{MEMORY_AT[task]}", ylabel=f"{QUALITY[task]} (symlog)",
               title=f"{task}\n" + textwrap.fill(f"quality: {s.trained_on[task]}", 90))
        ax.title.set_fontsize(8)
        ax.legend(loc="lower left", fontsize=7)
    # Under the longest key: a line of the key at 7 pt is about 0.019 of the figure's 6.4-inch height.
    fig.text(0.5, -0.1 - 0.019 * key_lines, textwrap.fill(FRONTIER_CAPTION, 180), ha="center", va="top", fontsize=8)
    return fig


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


def predicted_caption(s: Study) -> str:
    return (f"WRN, the quality-aware search: a combination's predicted accuracy change (points) is the sum of its "
            f"lossy levers' paired changes alone (checkpointing adds zero: exact by test, and assumed zero with compressed "
            f"activations, where it is not exact); measured: its own paired "
            f"change with the {quality.LEVEL:.0%} interval over the seeds. Quality: {s.trained_on['wrn']}.")


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


def budget_caption(s: Study, task: str) -> str:
    """The caption of ``budget_table``: what memory, quality and time mean for ``task``."""
    return (f"{task}: best memory reduction within each budget of {QUALITY[task]}, by each rule. Memory: "
            f"{MEMORY_AT[task]}, MiB = 2^20 bytes at the step's peak. Quality: {s.trained_on[task]}; low/high: its "
            f"{quality.LEVEL:.0%} interval. Time ratio: per step against the baseline, measured at profile "
            f"`{s.profile[task]}`. {rules_text()}")


def rules_text() -> str:
    """The decision rules, as every table and figure that says "within budget" states them."""
    return "Rules: " + "; ".join(f"**{r}**: {quality.RULES[r]}" for r in RULES) + "."


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


def comparison_caption(s: Study) -> str:
    """The caption of ``paper_comparison``: where the paper's numbers and ours come from."""
    return (f"Paper: {s.reference['citation']}. Ours: memory reduction accounted at full size, quality change from the "
            "stated profile, with its 95% interval (low, high) over n seeds (DynamicConv: one seed, its interval as its "
            "setting says). At the cpu profile the quality is measured "
            "on a smaller model and offline data, not CIFAR-10 or IWSLT'14. The rows \"the paper's and beyond\" add "
            "the configurations with a lever beyond the paper, each paired with the baseline trained beside it in its "
            f"own study, on that study's machine ({', '.join(quality_sources(s))}).{paper_arms_text(s)} {rules_text()}")


def paper_arms_text(s: Study) -> str:
    """What ``paper_arms_dynamicconv`` added to DynamicConv's rows "the paper's", as a sentence (empty if nothing)."""
    r = s.results.get("dynamicconv")
    stages = [] if r is None else sorted({q.removeprefix("stage ") for q in r.quality_from
                                          if q.removeprefix("stage ") in LEVERS_STAGES_DYNAMICCONV})
    if not stages:
        return ""
    return (" DynamicConv's rows \"the paper's\" also take the runs of the paper's levers alone that a levers stage "
            f"trained beside its own baseline (stage {', '.join(stages)}).")


def quality_sources(s: Study) -> list[str]:
    """The studies whose runs give the levers beyond the paper their quality, and the CPU each ran on."""
    b = pd.concat(list(s.beyond.values()), ignore_index=True) if s.beyond else pd.DataFrame(columns=["study", "machine"])
    return [f"stage {st}: {m}" for st, m in b[["study", "machine"]].drop_duplicates().itertuples(index=False)]


def tables(s: Study) -> dict[str, tuple[pd.DataFrame, str]]:
    """The tables notebook 09 writes under figures/, by file name (no suffix): (rounded table, caption)."""
    out = {f"09_{task}_budgets": (budget_table(s, task).round(4), budget_caption(s, task)) for task in s.results}
    out["09_wrn_predicted"] = (predicted_table(s).round(4), predicted_caption(s))
    out["09_wrn_levers"] = (effects_table(s).round(4), "WRN: each lossy lever alone, its paired accuracy change "
                            f"(points) and {quality.LEVEL:.0%} interval. Quality: {s.trained_on['wrn']}.")
    out["09_paper_comparison"] = (paper_comparison(s).round(3), comparison_caption(s))
    return out


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
