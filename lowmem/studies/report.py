"""The report (notebook 00): the study of Sohoni et al., *Low-Memory Neural Network Training* (2019), in the paper's
order: where a training step's memory goes, each technique alone, the techniques combined, and the headline beside
the paper's. It only gathers what the stages wrote (metrics/*.json, figures/), so every number has one source, and
makes the README's headline table (figures/00_headline.md, between the README's lowmem:headline markers).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from PIL import Image as PILImage  # Pillow: matplotlib's own dependency

from lowmem.studies import frontier, frontier_captions, known

# The stages' figures each section shows, with the Markdown table whose caption (profile, data, method) goes under it.
FIGURES: dict[str, list[tuple[str, str | None]]] = {
    "memory": [("01_memory_breakdown.png", "01_memory_breakdown.md"),
               ("07_translation_memory.png", "07_translation_memory.md")],
    "alone": [("03_sparsity.png", "03_sparsity_accuracy.md"), ("04_precision.png", "04_precision_accuracy.md"),
              ("05_microbatching.png", "05_microbatching_accuracy.md"), ("06_checkpointing.png", "06_checkpointing.md"),
              ("08_translation_techniques_memory.png", None),
              ("08_translation_techniques_bleu_time.png", "08_translation_techniques.md")],
    "combined": [("09_frontier.png", None)],
}
ALONE_CAPTION = "Accounted at full size (notebooks 03–06 and 08); each technique against its task's baseline."
# The headline table: the comparison's columns (figures/09_paper_comparison.csv) under the README's names.
HEADLINE = {"task": "task", "levers": "levers", "rule": "rule", "paper_setting": "paper's setting", "budget": "quality budget",
            "paper_reduction": "paper: memory reduction", "our_reduction": "ours: memory reduction",
            "our_change": "ours: quality change", "our_low": "ours: 95% low", "our_high": "ours: 95% high",
            "our_n": "ours: seeds", "our_config": "our configuration", "our_setting": "our setting (profile, model, data)"}


@dataclass
class Report:
    """The results the report reads: ``root`` (the checkout, with metrics/ and figures/), every metrics/*.json by
    file stem, and the paper's headline figures (``frontier.paper_reference``)."""

    root: Path
    metrics: dict[str, Any]
    reference: dict[str, Any]


def load(root: str | Path) -> Report:
    """Reads every stage's metrics under ``root``/metrics and the paper's reference."""
    root = Path(root)
    metrics = {f.stem: json.loads(f.read_text()) for f in (root / "metrics").glob("*.json")}
    return Report(root=root, metrics=metrics, reference=frontier.paper_reference())


def profiles(r: Report) -> str:
    """Which profile(s) the checkout's results come from, and what that means for memory and quality (Markdown)."""
    found = sorted({v["profile"] for v in r.metrics.values()
                    if isinstance(v, dict) and "profile" in v and isinstance(v["profile"], str)})
    return (f"Results in this checkout come from profile(s): **{', '.join(found)}**. Memory is accounted at full "
            "size in every profile; accuracy and BLEU come from the profile's model and data (see each caption).")


# The report shows each stage's figure at this width at most: it embeds every figure, and the stages' PNGs (up to
# 2,658 px wide) would make its committed reader's copy over 2 MB, for images a reader sees at about 900 px.
REPORT_WIDTH_PX = 1400


def shown_png(path: Path, max_width: int = REPORT_WIDTH_PX) -> bytes:
    """The PNG at ``path``, scaled down (Lanczos, aspect kept) to at most ``max_width`` pixels wide, in a 256-colour
    palette: a chart has few colours, and the smoothed edges of a resize made an RGBA PNG larger than the original."""
    with PILImage.open(path) as im:
        if im.width > max_width:
            im = im.resize((max_width, round(im.height * max_width / im.width)), PILImage.LANCZOS)
        buf = io.BytesIO()
        im.convert("RGB").quantize(256).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def figures(r: Report, section: str) -> list[tuple[bytes, str]]:
    """The stage figures of ``section`` (a key of FIGURES): (the image as shown, ``shown_png``; its caption in
    italics, or "" where the figure has no table)."""
    if section not in FIGURES:
        raise ValueError(f"section={section!r} is not one of {', '.join(FIGURES)}")
    out = []
    for image, table in FIGURES[section]:
        caption = "*" + (r.root / "figures" / table).read_text().split("\n\n")[0] + "*" if table else ""
        out.append((shown_png(r.root / "figures" / image), caption))
    return out


def memory_summary(r: Report) -> str:
    """Where the memory of one step goes, for WRN-28-2 (stage memory_profile) and DynamicConv (stage translation)."""
    mp, tr = r.metrics["memory_profile"], r.metrics["translation"]
    peak = mp["at_peak_mib"]
    return (
        f"- **WRN-28-2** ({mp['parameters']:,} parameters) at batch {mp['reference_batch_size']}: "
        f"{peak['total']:.1f} MiB at the step's peak, of which activations are {100 * mp['activation_share']:.1f}%; "
        f"weights, gradients and momentum together {peak['model'] + peak['gradients'] + peak['optimizer']:.1f} MiB. "
        f"The accountant is within {mp['measured']['max_abs_gap_pct']:.1f}% of PyTorch's measured peak.\n"
        f"- **DynamicConv** ({tr['parameters']:,} parameters) at {tr['max_tokens']} tokens: "
        f"{tr['at_peak_mib']['total']:.1f} MiB, "
        f"activations {100 * tr['activation_share']:.1f}%, and Adam's fixed part (weights, gradients, two moments) "
        f"{tr['fixed_mib']:.1f} MiB, which no activation technique touches.")


def alone(r: Report) -> pd.DataFrame:
    """Each technique's memory reduction alone against its task's baseline, accounted at full size (stages 03-06
    for WRN, 08 for DynamicConv)."""
    sp, pr, mb, ck = (r.metrics[k] for k in ("sparsity", "precision", "microbatching", "checkpointing"))
    tt = r.metrics["translation_techniques"]
    b_min = min(int(k[1:]) for k in mb["peak_mib_batchnorm"])  # the smallest microbatch the profile accounts
    return pd.DataFrame([
        {"task": "wrn", "technique": "sparsity (best accounted level and CSR format)",
         "reduction": max(v["peak_reduction"] for v in sp["memory"].values())},
        {"task": "wrn", "technique": "half precision (bf16)", "reduction": pr["reduction_vs_fp32"]["half-bf16_b128"]},
        {"task": "wrn", "technique": f"microbatch b = {b_min}",
         "reduction": mb["peak_mib_batchnorm"][f"b{mb['memory_batch_size']}"] / mb["peak_mib_batchnorm"][f"b{b_min}"]},
        {"task": "wrn", "technique": "checkpointing (best strategy)",
         "reduction": ck["strategies"]["none"]["peak_mib"] / min(s["peak_mib"] for s in ck["strategies"].values())},
        *[{"task": "dynamicconv", "technique": k, "reduction": v["reduction"]}
          for k, v in tt["memory_mib"].items() if k != "baseline"],
    ])


def alone_reading(table: pd.DataFrame) -> str:
    """What the table of ``alone`` says: the largest single saving of each task (Markdown)."""
    top = table.loc[table.groupby("task").reduction.idxmax()]
    return ("Alone, the largest saving is "
            + "; ".join(f"**{t.technique}** for {t.task} ({t.reduction:.2f}x)" for t in top.itertuples())
            + ": on both models the activations dominate, so the levers that shrink them save the most, and no single "
            "technique comes near the paper's combined numbers.")


def budget_tables(r: Report) -> list[str]:
    """Stage combinations' budget tables (figures/09_<task>_budgets.md), caption included, per task."""
    return [(r.root / "figures" / f"09_{task}_budgets.md").read_text() for task in r.metrics["combinations"]["profile"]]


def comparison(r: Report) -> pd.DataFrame:
    """Stage combinations' comparison with the paper (figures/09_paper_comparison.csv)."""
    return pd.read_csv(r.root / "figures" / "09_paper_comparison.csv")


def headline_full(r: Report) -> pd.DataFrame:
    """Every column of the headline: per task the paper's reduction within its quality budget beside our best one,
    how its quality is known, what its interval resolves, and the reduction a GPU measured for it."""
    c = comparison(r)
    gpu = gpu_measured(r)
    full = c[list(HEADLINE)].rename(columns=HEADLINE)
    full["how known"] = c.get("our_known_detail", "")
    full["resolution"] = c.get("our_resolution", "")
    full["verdict"] = c.get("our_verdict", "")
    full["on a GPU"] = [gpu_cell(t, cfg, gpu) for t, cfg in zip(c.task, c.our_config)]
    cpu = cpu_measured(r)
    full["on this CPU"] = [cpu_cell(t, cfg, cpu) for t, cfg in zip(c.task, c.our_config)]
    return full


def headline(r: Report) -> pd.DataFrame:
    """The headline as the README shows it, in eight columns; ``headline_caption`` holds each task's setting."""
    c = comparison(r)
    gpu, cpu = gpu_measured(r), cpu_measured(r)
    rows = []
    for row in c.itertuples():
        found = isinstance(row.our_config, str) and not pd.isna(row.our_reduction)
        change = (f"{row.our_change:+.2f}" if row.our_change else "0") if found else ""
        if found and getattr(row, "our_resolution", "") == "exact":
            quality = "0 (exact)"
        elif found and not pd.isna(row.our_low):
            quality = f"{change} [{row.our_low:+.2f}, {row.our_high:+.2f}] {row.our_resolution}"
        else:
            quality = change
        if found and getattr(row, "our_verdict", "").endswith("not resolved"):
            quality += ": not resolved"
        how = {"measured": f"measured, {int(row.our_n)} seed{'s' if row.our_n > 1 else ''}",
                 "carried": f"carried from {known.twin_of(row.our_from)}'s run", "exact by test": "exact by test",
                 known.DROPOUT: known.DROPOUT}.get(getattr(row, "our_how_known", ""), "") if found else ""
        rows.append({"task": TASK_NAMES.get(row.task, row.task), "levers": LEVER_NAMES.get(row.levers, row.levers),
                     "rule": row.rule, "paper": f"{row.paper_reduction:g}x at {row.paper_change:g}",
                     "ours": f"{row.our_reduction:.2f}x: {row.our_config}" if found else row.our_config,
                     "quality change [95%]": quality, "how known": how,
                     "measured reduction": measured_cell(row.task, row.our_config, gpu, cpu)})
    return pd.DataFrame(rows)


TASK_NAMES = {"wrn": "WRN", "dynamicconv": "DynamicConv"}
LEVER_NAMES = {frontier.LEVERS_PAPER: "paper's", frontier.LEVERS_BEYOND: "+ beyond"}
GPU_CHECK = Path("metrics/gpu/gpu_check.json")


def gpu_measured(r: Report) -> dict[str, tuple[float, str]]:
    """What the GPU check measured (``metrics/gpu/gpu_check.json``, committed from a lent GPU): configuration ->
    (the baseline's measured peak over the configuration's, the GPU's name). Empty where it has not run."""
    path = r.root / GPU_CHECK
    if not path.exists():
        return {}
    g = json.loads(path.read_text())
    if g.get("dry"):
        return {}
    mem = {m["configuration"]: m["measured_mib"] for m in g["memory"]}
    return {k: (mem["baseline"] / v, g["device"]) for k, v in mem.items()} if "baseline" in mem else {}


CPU_CHECK = Path("metrics/cpu_check.json")


def cpu_measured(r: Report) -> dict[str, tuple[float, str]]:
    """What stage cpu_check measured on the pipeline's CPU (``metrics/cpu_check.json``): configuration -> (the
    baseline's measured peak over the configuration's, the CPU's name). Empty where it has not run."""
    path = r.root / CPU_CHECK
    if not path.exists():
        return {}
    c = json.loads(path.read_text())
    return {m["configuration"]: (m["measured_reduction"], c["cpu"]) for m in c["rows"]}


def cpu_cell(task: str, config: str, cpu: dict[str, tuple[float, str]]) -> str:
    """The full headline's CPU column: the measured reduction and the CPU, or why there is none."""
    if task == "dynamicconv":
        return "not measured (stage cpu_check measures WRN's configurations)"
    return f"{cpu[config][0]:.2f}x measured ({cpu[config][1]})" if config in cpu else "not measured"


def measured_cell(task: str, config: str, gpu: dict[str, tuple[float, str]], cpu: dict[str, tuple[float, str]]) -> str:
    """The headline's measured column: the reduction measured on the GPU and on this CPU, each with its device."""
    if task == "dynamicconv":
        return "not measured (no fairseq on the GPU check)"
    parts = [f"{d[config][0]:.2f}x on {d[config][1]}" for d in (gpu, cpu) if config in d]
    return "; ".join(parts) or "not measured"


def gpu_cell(task: str, config: str, gpu: dict[str, tuple[float, str]]) -> str:
    """The headline's GPU column: the measured reduction and the GPU, or why there is none."""
    if task == "dynamicconv":
        return "not measurable (no fairseq on the GPU check)"
    if config in gpu:
        return f"{gpu[config][0]:.2f}x measured ({gpu[config][1]})"
    return "not measured"


def headline_caption(r: Report) -> str:
    """The caption of ``headline``: where the paper's numbers and ours come from, each task's setting, the tests that
    make a row exact, and what update-freq is."""
    c = comparison(r)
    settings = "; ".join(f"**{TASK_NAMES.get(t, t)}**: {g.our_setting.iloc[0]}" for t, g in c.groupby("task", sort=False))
    tests = sorted({known.tests_of(q) for q in c.get("our_from", []) if known.tests_of(q)})
    batching = confirming(r, c) + (" **update-freq-k** is fairseq's `--update-freq k` at `--max-tokens` / k: a different batching of the "
                "corpus (other sentences and tokens per update), not microbatching of the baseline's batches; its "
                "quality change is that batching's." if c.our_config.astype(str).str.contains("update-freq").any() else "")
    return (f"Paper: {r.reference['citation']} (lowmem/studies/paper_reference.yaml). Ours: memory reduction "
            "accounted at the paper's full size; quality change paired against the baseline at the profile below, "
            "with its 95% interval and its half-width (±), or exact. How known: **measured** (the row's own runs), "
            "**exact by test** (it differs from the baseline only by checkpointing, bit-equal by test, so it is the "
            "baseline compared with itself), **equal up to dropout draws** (it differs from the baseline only by exact "
            "microbatching, whose gradient equals the whole batch's with dropout off, by test: zero, with two seeds' "
            "noise as its interval), or **carried** (it takes the named run's quality, the levers that differ being "
            f"exact or equal up to dropout draws by test). Tests: {'; '.join(tests) or 'none'}. **not resolved**: within budget by the mean "
            "rule, but the interval is wider than twice the budget. Measured reduction: the baseline's measured peak over "
            f"the configuration's, at the same full size, on a GPU by the GPU check (`{GPU_CHECK}`) and on this CPU by "
            f"stage cpu_check (`{CPU_CHECK}`, the CPU allocator's peak, op workspace included).{batching} Settings: {settings}. "
            f"{frontier_captions.rules_text()} Every column: figures/00_headline_full.md.")


MICROBATCH_RUN = Path("metrics/translation_microbatch_train.json")


def confirming(r: Report, c: pd.DataFrame) -> str:
    """Where a DynamicConv row carries its quality through exact microbatching: what the confirming run (stage
    translation_microbatch_train) measured for it against its own baseline, beside the carried value."""
    path = r.root / MICROBATCH_RUN
    carries = any(str(q).startswith(known.DROPOUT) for q in c.get("our_from", []))  # the baseline's, or a carried twin's
    if not carries or not path.exists():
        return ""
    res = json.loads(path.read_text())
    arms = [t for t in res["trained"] if t["technique"] != "baseline"]
    measured = "; ".join(f"{t['technique']} {t['sacrebleu_change']:+.2f} [{t['sacrebleu_change_low']:+.2f}, "
                         f"{t['sacrebleu_change_high']:+.2f}] sacreBLEU" for t in arms)
    return (f" **Confirming run** of exact microbatching (stage translation_microbatch_train, {res['max_update']} updates, "
            f"seed {res['seed']}, paired bootstrap of the test set only): {measured} against its own baseline, beside "
            "the quality the rows carry.")


def reading(r: Report) -> str:
    """What the headline says, per task, and how far the grid went (Markdown)."""
    lines = []
    for row in comparison(r).itertuples():
        who = f"**{row.task}**, {row.levers} levers, {'both rules' if row.rule == 'both' else f'{row.rule} rule'}"
        if row.our_config.startswith("none trained"):
            lines.append(f"- {who}: {row.our_config}.")
            continue
        if pd.isna(row.our_reduction):
            lines.append(f"- {who}: no combination stays within {row.budget}.")
            continue
        side = "beyond" if row.our_reduction > row.paper_reduction else "short of"
        interval = ("no interval" if pd.isna(row.our_low) else f"95% interval {row.our_low:+.2f} to {row.our_high:+.2f}")
        lines.append(f"- {who}: within the paper's budget of {row.budget}, the best combination "
                     f"is `{row.our_config}` at {row.our_reduction:.1f}x ({row.our_change:+.2f}, {interval}), {side} the "
                     f"paper's {row.paper_reduction:g}x ({row.ours_over_paper:.2f} of it). Its quality comes from "
                     f"{row.our_setting.split('; memory: ')[0]}.")
    cb = r.metrics["combinations"]
    for task in cb["profile"]:
        lines.append(f"- {task}: the grid's largest accounted reduction is {cb[task]['max_accounted_reduction']:.1f}x "
                     f"over {cb[task]['accounted']} combinations; {cb[task]['trained_runs']} were trained at profile "
                     f"`{cb['profile'][task]}`, and {cb[task]['exact_by_test']} more take a trained one's quality "
                     "because they differ from it only by an exact lever.")
    return ("**Reading.**\n" + "\n".join(lines) + "\n\nMemory ratios are exact for the paper's models and batch; "
            "the quality changes are only as good as the profile's runs: at the cpu profile they are a smaller model "
            "on offline data over a short schedule, so they rank the combinations but do not reproduce the paper's "
            "accuracy or BLEU.")


def tables(r: Report) -> dict[str, tuple[pd.DataFrame, str]]:
    """The tables the report writes under figures/, by file name (no suffix): (rounded table, caption)."""
    return {"00_headline": (headline(r), headline_caption(r)),
            "00_headline_full": (headline_full(r).round(2), headline_caption(r))}
