"""DynamicConv on German→English, the paper's second benchmark (Sohoni et al. 2019, the translation benchmark): the
BLEU of the track's trained model and the memory of one training step of the full-size model by category, what
notebook 07 shows.

The track's stages (translation_prepare → translation_binarize → translation_train → translation_evaluate) write
the corpus summary, the run's fairseq log and its BLEU; ``track`` reads them, and runs the track at the notebook's
profile when they are missing (a notebook opened before ``dvc repro``). The memory is accounted on the meta device
at full size (``lowmem.dynamicconv.memory``), so it is the same in every profile. This module imports no plugin:
it is fairseq's own model with no technique.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import yaml
from matplotlib.figure import Figure

from lowmem import runs
from lowmem.config import PARAMS_YAML
from lowmem.dynamicconv import memory as translation_memory
from lowmem.dynamicconv import translation
from lowmem.dynamicconv.params import TranslationMemoryParams
from lowmem.memory.accounting import CATEGORIES

MIB_COLUMNS = [f"{c}_mib" for c in CATEGORIES]


@dataclasses.dataclass
class Track:
    """What the translation stages recorded: the BLEU of the trained run, its fairseq log, the corpus summary."""

    bleu: dict[str, Any]  # translation_evaluate's metrics
    records: list[dict[str, Any]]  # translation_train's parsed fairseq log
    corpus: dict[str, Any]  # translation_binarize's bin/corpus.json


def track(p: TranslationMemoryParams, data_dir: str | Path, bleu_path: str | Path, train_path: str | Path) -> Track:
    """The track's results; when ``bleu_path`` is missing, runs prepare → binarize → train → evaluate here at
    ``p.profile`` and ``p.seed`` (this checkout's params.yaml), writing ``train_path`` and ``bleu_path``."""
    data, bleu_file, train_file = Path(data_dir), Path(bleu_path), Path(train_path)
    if not bleu_file.exists():
        params = yaml.safe_load(PARAMS_YAML.read_text())
        params["base"].update(profile=p.profile, seed=p.seed)
        runs.write_json(bleu_file, translation.run_track(params, data, train_file))
    if not train_file.exists():
        raise FileNotFoundError(f"{train_file} is missing though {bleu_file} exists; run dvc repro translation_train")
    return Track(bleu=json.loads(bleu_file.read_text()), records=json.loads(train_file.read_text())["records"],
                 corpus=json.loads((data / "bin" / "corpus.json").read_text()))


def source(p: TranslationMemoryParams, t: Track) -> str:
    return f"profile `{p.profile}`, corpus: {t.corpus['source']}"


# --- the corpus and the BLEU --------------------------------------------------------------------------------------


def bleu_table(p: TranslationMemoryParams, t: Track) -> pd.DataFrame:
    """One row: the corpus (sizes, overlap, BPE, dictionaries, digest) and the test-split scores."""
    c, b = t.corpus, t.bleu
    return pd.DataFrame([{
        "corpus": c["source"], "raw training pairs": c["raw_train_pairs"], "train pairs (cleaned)": c["train_pairs"],
        "valid pairs": c["valid_pairs"], "test pairs": c["test_pairs"],
        "test German sides also in training": c["test_de_seen_in_train"], "BPE merges": c["bpe_merges_learned"],
        "German types": c["dict_de_types"], "English types": c["dict_en_types"], "raw sha256": c["raw_sha256"][:16],
        "profile": p.profile, "test sentences": b["test_sentences"], "checkpoint": b["checkpoint"], "beam": b["beam"],
        "BLEU (tokenized, fairseq)": b["bleu_tokenized"], "sacreBLEU": b["sacrebleu"], "sacreBLEU signature": b["sacrebleu_signature"],
    }])


def bleu_caption(p: TranslationMemoryParams, t: Track) -> str:
    return f"DynamicConv BLEU on the test split; {source(p, t)}. Only the paper profile is IWSLT'14 with the paper's model."


def overlap_reading(t: Track) -> str:
    """How many test sentences the training split holds too (their German side), which the BLEU includes."""
    c = t.corpus
    return (f"{c['test_de_seen_in_train']} of {c['test_pairs']} test sentences ({c['test_de_seen_in_train'] / c['test_pairs']:.1%}) "
            "have their German side, tokenized, among the training sentences too; the BLEU above includes them.")


def curves(t: Track) -> pd.DataFrame:
    """One row per epoch: training and validation loss."""
    return pd.DataFrame(translation.history(t.records))


def curves_figure(p: TranslationMemoryParams, t: Track, history: pd.DataFrame) -> Figure:
    """Training and validation loss per epoch."""
    long = history.melt(id_vars="epoch", value_vars=["train_loss", "valid_loss"], var_name="split", value_name="loss")
    long["split"] = long.split.str.removesuffix("_loss")
    sns.set_theme(style="whitegrid")
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(long, x="epoch", y="loss", hue="split", marker="o", ax=ax)
    ax.set(ylabel="label-smoothed cross entropy (bits per token)", title=f"fairseq-train loss per epoch · profile: {p.profile}")
    fig.text(0.5, -0.08, f"{source(p, t)}; {len(history)} epochs", ha="center", wrap=True, fontsize=8)
    return fig


# --- memory of one training step of the full-size model -------------------------------------------------------------


@dataclasses.dataclass
class Memory:
    """The breakdown (``translation_memory.breakdown``: accounted rows, then measured ones) and its summary."""

    table: pd.DataFrame
    summary: dict[str, Any]

    @property
    def accounted(self) -> pd.DataFrame:
        return self.table[self.table.source == "accounted"]

    @property
    def measured(self) -> pd.DataFrame:
        return self.table[self.table.source == "measured"]


def memory(p: TranslationMemoryParams) -> Memory:
    """Accounted at full size for each of ``p.sentence_lengths``, measured on CPU for each of ``p.measured``."""
    df = translation_memory.breakdown(p)
    return Memory(df, translation_memory.summary(p, df))


def memory_caption(p: TranslationMemoryParams, m: Memory) -> str:
    real = m.measured
    return (
        f"lightconv_iwslt_de_en (full size, {m.summary['parameters']:,} parameters, vocabularies {p.src_vocab}/{p.tgt_vocab}), fp32, "
        f"fairseq's label-smoothed cross entropy and Adam, one step at {p.max_tokens} tokens; random tokens (memory depends only "
        f"on shapes), the same in every profile. Accounted: lowmem accountant on the meta device. Measured: "
        f"{real.method.iloc[0] if len(real) else 'none'}. MiB = 2^20 bytes."
    )


def accounted_shown(m: Memory) -> pd.DataFrame:
    """The accounted rows as the notebook shows them: the categories at the peak, the total and its phase."""
    return m.accounted[["sentence_length", "sentences", *MIB_COLUMNS, "total_mib", "peak_phase"]]


def measured_shown(m: Memory) -> pd.DataFrame:
    """The measured rows beside their accounted peaks."""
    return m.measured[["tokens", "sentence_length", "total_mib", "measured_mib", "gap_pct"]]


def memory_reading(p: TranslationMemoryParams, m: Memory) -> str:
    """The reference length's breakdown, the fixed part, the activations' share and the accountant's gap, as Markdown."""
    s = m.summary
    ref = s["at_peak_mib"]
    return (
        f"At {p.max_tokens} tokens in sentences of {p.reference_length}, the accounted peak is **{ref['total']:.0f} MiB**: "
        + ", ".join(f"{c} {ref[c]:.0f}" for c in CATEGORIES)
        + f" MiB. Weights, gradients and Adam's two states take **{s['fixed_mib']:.0f} MiB** whatever the batch; "
        f"activations are {s['activation_share']:.0%} of the peak. Accounted and measured peaks differ by at most "
        f"**{s['max_abs_gap_pct']:.2f}%**."
    )


def memory_figure(p: TranslationMemoryParams, m: Memory) -> Figure:
    """Left: the accounted breakdown per sentence length; right: accounted against measured peaks."""
    long = m.accounted.melt(id_vars="sentence_length", value_vars=MIB_COLUMNS, var_name="category", value_name="MiB")
    long["category"] = long.category.str.removesuffix("_mib")
    long["sentence length (tokens)"] = long.sentence_length.astype(str)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"wspace": 0.6})
    sns.histplot(long, x="sentence length (tokens)", hue="category", weights="MiB", multiple="stack", shrink=0.8, ax=ax1,
                 hue_order=list(CATEGORIES), palette="colorblind")
    ax1.set(ylabel="MiB at the step's peak", title=f"Breakdown at {p.max_tokens} tokens per batch (accounted)")
    sns.move_legend(ax1, "upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    cmp = m.measured.melt(id_vars=["tokens", "sentence_length"], value_vars=["total_mib", "measured_mib"], var_name="how", value_name="MiB")
    cmp["step"] = cmp.tokens.astype(str) + " tokens\nsentences of " + cmp.sentence_length.astype(str)
    cmp["how"] = cmp.how.map({"total_mib": "accounted (meta)", "measured_mib": "measured (CPU profiler)"})
    sns.barplot(cmp, x="step", y="MiB", hue="how", ax=ax2, palette="colorblind")
    ax2.set(xlabel="", ylabel="peak MiB", title="Accounted vs measured peak")
    sns.move_legend(ax2, "lower center", frameon=True)
    fig.suptitle(f"DynamicConv (full size) training memory · profile: {p.profile} · inputs: random tokens (shapes only)", y=1.02)
    fig.text(0.5, -0.1, memory_caption(p, m), ha="center", wrap=True, fontsize=8)
    return fig


# --- what the stage writes ------------------------------------------------------------------------------------------


def tables(p: TranslationMemoryParams, t: Track, m: Memory) -> dict[str, tuple[pd.DataFrame, str]]:
    """The tables written under figures/, by file name (no suffix): (rounded table, caption)."""
    caption = memory_caption(p, m)
    return {
        "07_translation_bleu": (bleu_table(p, t), bleu_caption(p, t)),
        "07_translation_memory": (m.accounted.drop(columns=["measured_mib", "gap_pct", "method", "seconds"], errors="ignore").round(4), caption),
        "07_translation_accounted_vs_measured": (m.measured.drop(columns=["source", "seconds"]).round(4), caption),
    }


def metrics(t: Track, m: Memory, history: pd.DataFrame) -> dict[str, Any]:
    """The stage's metrics JSON (metrics/translation.json): the memory summary, the BLEU and the corpus."""
    c = t.corpus
    return m.summary | {"bleu_tokenized": t.bleu["bleu_tokenized"], "sacrebleu": t.bleu["sacrebleu"], "corpus": c["source"],
                        "corpus_train_pairs": c["train_pairs"], "corpus_test_de_seen_in_train": c["test_de_seen_in_train"],
                        "corpus_sha256": c["raw_sha256"], "epochs": len(history)}
