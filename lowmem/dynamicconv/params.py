"""The parameters of the translation track's stages (notebooks 07 and 08), resolved by ``lowmem.config``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowmem.config import DEVICES, PROFILES, ParamError, check_choice, check_positive, stage
from lowmem.dynamicconv.corpus import CORPORA


def _check_args(name: str, value: Any) -> None:
    if not isinstance(value, list) or not all(isinstance(a, (str, int, float)) for a in value):
        raise ParamError(f"{name} must be a list of fairseq command-line words, got {value!r}")


@stage("translation_data")
@dataclass
class TranslationDataParams:
    """Stages ``translation_prepare`` and ``translation_binarize``: raw corpus → BPE → fairseq binaries."""

    profile: str = "smoke"
    seed: int = 0  # shuffles the gettext and synthetic corpora before their test split
    corpus: str = "synthetic"  # iwslt14 (paper) | gettext (cpu, offline) | synthetic (smoke)
    iwslt14_archive: str = "data/raw/de-en.tgz"  # path or http(s) address of IWSLT'14's de-en.tgz
    gettext_packages: list[str] = field(default_factory=list)  # Debian packages whose German catalogs are read
    test_size: int = 2000  # pairs held out for test (gettext, synthetic); IWSLT'14 has its own test sets
    synthetic_pairs: int = 600  # training pairs of the synthetic corpus
    bpe_merges: int = 10000  # joint BPE merges (the recipe's 10,000)
    max_len: int = 175  # tokens per side kept in training (clean-corpus-n.perl's 1..175)
    length_ratio: float = 1.5  # longest side over shortest, at most (clean-corpus-n.perl -ratio)
    valid_every: int = 23  # every n-th cleaned training pair is validation (prepare-iwslt14.sh)
    workers: int = 1  # fairseq-preprocess processes

    def __post_init__(self) -> None:
        check_choice("profile", self.profile, PROFILES)
        check_choice("corpus", self.corpus, CORPORA)
        check_positive(test_size=self.test_size, synthetic_pairs=self.synthetic_pairs, bpe_merges=self.bpe_merges,
                        max_len=self.max_len, valid_every=self.valid_every, workers=self.workers)
        if self.corpus == "gettext" and not self.gettext_packages:
            raise ParamError("corpus=gettext needs gettext_packages, the Debian packages whose catalogs form the corpus")
        if not self.length_ratio >= 1:
            raise ParamError(f"length_ratio must be at least 1, got {self.length_ratio!r}")


@stage("translation_train")
@dataclass
class TranslationTrainParams:
    """Stage ``translation_train``: ``fairseq-train`` with the recipe, scaled by profile."""

    profile: str = "smoke"
    seed: int = 0
    recipe_args: list[str] = field(default_factory=list)  # the recipe's fairseq-train options (paper notes), verbatim
    scale_args: list[str] = field(default_factory=list)  # appended; a later option overrides the recipe's
    max_tokens: int = 4000  # tokens per batch (the recipe's --max-tokens)
    max_update: int = 50000  # updates (the recipe's --max-update)
    warmup_updates: int = 4000  # inverse-sqrt warm-up (the recipe's)
    lr: float = 0.0005  # peak learning rate (the recipe's)
    keep_last_epochs: int = 1  # epoch checkpoints kept for averaging; 1 = only checkpoint_last/best
    device: str = "auto"  # cuda when available, else cpu (fairseq's --cpu)

    def __post_init__(self) -> None:
        check_choice("profile", self.profile, PROFILES)
        check_choice("device", self.device, DEVICES)
        _check_args("recipe_args", self.recipe_args)
        _check_args("scale_args", self.scale_args)
        if "--arch" not in self.recipe_args:
            raise ParamError("recipe_args must name the model with --arch (the recipe's lightconv_iwslt_de_en)")
        check_positive(max_tokens=self.max_tokens, max_update=self.max_update, warmup_updates=self.warmup_updates,
                        keep_last_epochs=self.keep_last_epochs)
        if not self.lr > 0:
            raise ParamError(f"lr must be positive, got {self.lr!r}")


@stage("translation_evaluate")
@dataclass
class TranslationEvaluateParams:
    """Stage ``translation_evaluate``: checkpoint averaging, then ``fairseq-generate`` on the test split."""

    profile: str = "smoke"
    average_last: int = 1  # epoch checkpoints averaged (the recipe's 10); 1 = checkpoint_last.pt as it is
    beam: int = 4
    lenpen: float = 1.0
    batch_size: int = 128  # sentences per generation batch; does not change the output
    device: str = "auto"

    def __post_init__(self) -> None:
        check_choice("profile", self.profile, PROFILES)
        check_choice("device", self.device, DEVICES)
        check_positive(average_last=self.average_last, beam=self.beam, batch_size=self.batch_size)


@stage("translation_memory")
@dataclass
class TranslationMemoryParams:
    """Stage ``translation``: the memory of one fairseq training step of the full-size model (notebook 07)."""

    profile: str = "smoke"
    seed: int = 0
    recipe_args: list[str] = field(default_factory=list)  # from translation_train: the full-size model
    src_vocab: int = 8848  # dictionary sizes of the standard IWSLT'14 preparation (paper notes)
    tgt_vocab: int = 6632
    max_tokens: int = 4000  # the recipe's batch
    sentence_lengths: list[int] = field(default_factory=lambda: [32])  # tokens per sentence; batch = max_tokens // length
    reference_length: int = 32  # the length whose breakdown goes into the metrics
    measured: list[list[int]] = field(default_factory=lambda: [[256, 16]])  # [tokens, length] steps run for real on CPU

    FROM = {"recipe_args": "translation_train"}

    def __post_init__(self) -> None:
        check_choice("profile", self.profile, PROFILES)
        _check_args("recipe_args", self.recipe_args)
        check_positive(src_vocab=self.src_vocab, tgt_vocab=self.tgt_vocab, max_tokens=self.max_tokens)
        if not self.sentence_lengths or not all(isinstance(n, int) and 0 < n <= self.max_tokens for n in self.sentence_lengths):
            raise ParamError(f"sentence_lengths must be positive integers up to max_tokens, got {self.sentence_lengths!r}")
        if self.reference_length not in self.sentence_lengths:
            raise ParamError(f"reference_length={self.reference_length!r} must be one of sentence_lengths {self.sentence_lengths}")
        if not all(isinstance(m, list) and len(m) == 2 and all(isinstance(v, int) and v > 0 for v in m) and m[1] <= m[0] for m in self.measured):
            raise ParamError(f"measured must be [tokens, length] pairs with length <= tokens, got {self.measured!r}")


@stage("translation_techniques")
@dataclass
class TranslationTechniquesParams:
    """Stages ``translation_techniques_train`` and ``translation_techniques``: each technique alone on DynamicConv,
    as fairseq-train options through lowmem's plugin (notebook 08)."""

    profile: str = "smoke"
    seed: int = 0
    device: str = "auto"
    recipe_args: list[str] = field(default_factory=list)  # from translation_train
    scale_args: list[str] = field(default_factory=list)  # from translation_train: the profile's model size
    max_tokens: int = 4000  # from translation_train: tokens per update
    lr: float = 0.0005  # from translation_train
    src_vocab: int = 8848  # from translation_memory: the full-size model that is accounted
    tgt_vocab: int = 6632
    reference_length: int = 32  # from translation_memory: tokens per sentence in the accounted batch
    techniques: dict[str, list[str]] = field(default_factory=lambda: {"baseline": []})  # name -> fairseq-train options
    trained: list[str] = field(default_factory=lambda: ["baseline"])  # trained and scored at this profile
    timed: list[str] = field(default_factory=lambda: ["baseline"])  # step time measured side by side
    max_update: int = 20  # updates of each trained run (all runs alike)
    warmup_updates: int = 5
    dsr_periods: list[int] = field(default_factory=lambda: [100, 200, 400, 800])  # DSR rewiring periods, in updates
    timing_updates: int = 10  # updates per timing run (the first two, warm-up, are not timed)
    timing_repeats: int = 2  # timing runs per technique, interleaved with the others
    noise_seeds: list[int] = field(default_factory=lambda: [0, 1])  # the baseline's seeds for BLEU's seed spread (lowmem.studies.bleu_noise)
    noise_updates: list[int] = field(default_factory=lambda: [20])  # where each noise seed is decoded; includes max_update

    FROM = {"recipe_args": "translation_train", "scale_args": "translation_train", "max_tokens": "translation_train",
            "lr": "translation_train", "src_vocab": "translation_memory", "tgt_vocab": "translation_memory",
            "reference_length": "translation_memory"}

    def __post_init__(self) -> None:
        check_choice("profile", self.profile, PROFILES)
        check_choice("device", self.device, DEVICES)
        _check_args("recipe_args", self.recipe_args)
        _check_args("scale_args", self.scale_args)
        check_positive(max_tokens=self.max_tokens, max_update=self.max_update, warmup_updates=self.warmup_updates,
                        timing_updates=self.timing_updates, timing_repeats=self.timing_repeats, reference_length=self.reference_length)
        if self.techniques.get("baseline") != []:
            raise ParamError("techniques must include 'baseline: []', the run every technique is compared with")
        for name, args in self.techniques.items():
            _check_args(f"techniques.{name}", args)
            if "--update-freq" in args:
                k = int(args[args.index("--update-freq") + 1])
                tokens = int(args[args.index("--max-tokens") + 1]) if "--max-tokens" in args else self.max_tokens
                if k * tokens != self.max_tokens:
                    raise ParamError(f"techniques.{name}: --update-freq {k} needs --max-tokens {self.max_tokens // k} "
                                     f"(the baseline's {self.max_tokens} tokens per update in {k} batches), got {tokens}")
        for key in ("trained", "timed"):
            unknown = sorted(set(getattr(self, key)) - set(self.techniques))
            if unknown or "baseline" not in getattr(self, key):
                raise ParamError(f"{key} must name 'baseline' and techniques from {sorted(self.techniques)}; unknown: {unknown}")
        if not self.noise_updates or sorted(set(self.noise_updates)) != self.noise_updates or min(self.noise_updates) < 1 \
                or self.max_update not in self.noise_updates:
            raise ParamError(f"noise_updates must be increasing update counts >= 1 that include max_update "
                             f"({self.max_update}, the techniques' run length), got {self.noise_updates!r}")
        if len(self.dsr_periods) != 4 or min(self.dsr_periods) < 1:
            raise ParamError(f"dsr_periods must be four periods >= 1 (updates), got {self.dsr_periods!r}")
        if self.timing_updates < 3:
            raise ParamError("timing_updates must be at least 3 (two warm-up updates are not timed)")
