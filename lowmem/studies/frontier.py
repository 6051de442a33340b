"""The memory-quality frontier of combined techniques (Sohoni et al. 2019, the combination study): the rows the
headline is made of. Each task's configurations with the quality of what was trained (``results``; those with a lever
beyond the paper, ``beyond_rows`` and ``beyond_rows_dynamicconv``), which of them are Pareto-optimal, the best memory
reduction within a quality budget (``best_within``), and the paper's headline numbers (``paper_reference``).

Plain pandas on a table with one row per configuration, so the same code reads a cpu-profile run or a GPU run.
Quality is a change against the baseline (accuracy points or BLEU; higher is better) and memory a reduction factor
(baseline peak / configuration's peak; higher is better).

Notebook 09's tables are ``frontier_tables``'s and its figure and words ``frontier_captions``'s; both build on these
rows, so this module imports neither.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from lowmem.studies import known, quality
from lowmem.studies.quality_model import (EQUAL_UP_TO_DROPOUT_DYNAMICCONV, EQUAL_UP_TO_DROPOUT_PRECISIONS, EXACT,
                                          EXACT_DYNAMICCONV, EXACT_DYNAMICCONV_PRECISIONS, EXACT_MICROBATCH_OPTION, LEVERS_STAGES,
                                          OPTIONAL_DIMS, arm_change, beyond_paper, beyond_paper_rows, dims, paired_change,
                                          predict, selection)

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
