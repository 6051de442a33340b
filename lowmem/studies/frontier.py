"""The memory-quality frontier of combined techniques (Sohoni et al. 2019, the combination study): which
configurations are Pareto-optimal, the best memory reduction within a quality budget, and how that compares with the
paper's headline numbers.

Plain pandas on a table with one row per configuration, so the same code reads a cpu-profile run or a GPU run.
Quality is a change against the baseline (accuracy points or BLEU; higher is better) and memory a reduction factor
(baseline peak / configuration's peak; higher is better).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

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
    df: pd.DataFrame, budgets: list[float], x: str = "reduction", y: str = "quality_change", cost: str = "time_ratio"
) -> pd.DataFrame:
    """One row per budget b: the configuration with the largest ``x`` among those whose ``y`` is at least -b (the
    quality lost is at most b), ties going to the lower ``cost``. A budget no configuration meets gives a row with
    no configuration."""
    rows = []
    trained = df[df[y].notna()]
    for b in budgets:
        ok = trained[trained[y] >= -b - 1e-12]  # -b itself is within the budget, whatever the float rounding
        if ok.empty:
            rows.append(pd.Series({"budget": b}))
            continue
        order = ok.sort_values([x, cost] if cost in ok else [x], ascending=[False, True] if cost in ok else [False])
        rows.append(pd.Series({"budget": b, **order.iloc[0].to_dict()}))
    return pd.DataFrame(rows).reset_index(drop=True)


def results(task: str, sweep_dir: Path, metrics_dir: Path) -> pd.DataFrame:
    """The sweep's table with what was trained joined in: ``quality_change`` against the baseline (accuracy points
    for WRN, BLEU for DynamicConv), its spread over seeds where there are several, the source of the trained
    numbers, the time ratio, and whether the point is Pareto-optimal in (reduction, quality change)."""
    df = pd.read_csv(sweep_dir / f"{task}_sweep.csv")
    selected = json.loads((sweep_dir / f"{task}_selected.json").read_text())
    runs = [json.loads(f.read_text()) for f in sorted((metrics_dir / "combinations").glob(f"{task}-*.json"))]
    runs = [r for r in runs if r["slot"] < len(selected["selected"]) and r["name"] == selected["selected"][r["slot"]]["name"]]
    role = {c["name"]: c["role"] for c in selected["selected"]}
    df["role"] = df.name.map(role).fillna("")
    df["quality_change"] = float("nan")
    df["quality_spread"] = float("nan")
    df["trained_by"] = ""
    profile = {selected["profile"]}
    if task == "wrn":
        by = {r["name"]: r for r in runs}
        if "baseline" not in by:
            raise FileNotFoundError(f"no trained WRN baseline in {metrics_dir / 'combinations'}: run `dvc repro combination_wrn`")
        base = by["baseline"]["test_acc_mean"]
        for n, r in by.items():
            i = df.index[df.name == n]
            df.loc[i, "quality_change"] = 100 * (r["test_acc_mean"] - base)
            df.loc[i, "quality_spread"] = 100 * r["test_acc_std"]
            df.loc[i, "trained_by"] = f"stage combination_wrn@{r['slot']}"
            profile.add(r["profile"])
    else:
        stage08 = json.loads((metrics_dir / "translation_techniques_train.json").read_text())
        profile.add(stage08["profile"])
        bleu = {r["technique"]: r["bleu_tokenized"] for r in stage08["trained"]}
        base = bleu["baseline"]
        df["time_ratio"] = df.name.map(stage08["time_ratio"])
        for n, b in bleu.items():
            df.loc[df.name == n, ["quality_change", "trained_by"]] = [b - base, "stage translation_techniques_train"]
        for r in runs:
            if r["max_update"] != stage08["max_update"]:
                raise ValueError(f"{r['name']} trained {r['max_update']} updates but stage 08's baseline {stage08['max_update']}: rerun both")
            i = df.index[df.name == r["name"]]
            df.loc[i, ["quality_change", "time_ratio", "trained_by"]] = [r["bleu_tokenized"] - base, r["time_ratio"],
                                                                        f"stage combination_dynamicconv@{r['slot']}"]
            profile.add(r["profile"])
    if len(profile) != 1:
        raise ValueError(f"{task}: the sweep and the trained runs come from different profiles {sorted(profile)}: rerun `dvc repro`")
    df["profile"] = profile.pop()
    df["pareto"] = pareto(df)
    return df


def paper_reference(path: Path = REFERENCE) -> dict[str, Any]:
    """The paper's headline figures and their citation, from the project's one reference file."""
    return yaml.safe_load(path.read_text())


def comparison(best: dict[str, pd.DataFrame], reference: dict[str, Any], label: dict[str, str]) -> pd.DataFrame:
    """Ours beside the paper's: for each task, our best reduction within the paper's own quality budget (the
    budget is the paper's loss, read from ``reference``). ``best`` maps a task to a ``best_within`` table that has
    that budget; ``label`` says what our numbers are (profile, model, data), since they are not the paper's setting."""
    rows = []
    for task, ref in reference["tasks"].items():
        budget = -ref["quality_change"]
        table = best[task]
        hit = table[(table.budget - budget).abs() < 1e-9]
        if hit.empty:
            raise ValueError(f"{task}: no row for the paper's budget {budget} in our budget table; add it to the budgets")
        ours = hit.iloc[0]
        found = "config" in ours and isinstance(ours.get("config"), str)
        rows.append({
            "task": task,
            "paper_setting": f"{ref['model']} on {ref['data']}",
            "budget": f"{budget:g} ({ref['metric']})",
            "paper_reduction": ref["memory_reduction"],
            "paper_change": ref["quality_change"],
            "our_setting": label[task],
            "our_config": ours["config"] if found else "none within the budget",
            "our_reduction": ours["reduction"] if found else float("nan"),
            "our_change": ours["quality_change"] if found else float("nan"),
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
