"""Exact microbatching on DynamicConv (the plugin's ``--microbatches k``): each batch fairseq forms runs as
sub-batches of its own sentences, at most max-tokens/k tokens each with their padding; the gradients are the whole
batch's with dropout off, and the accountant holds one sub-batch's activations at a time."""

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from lowmem.dynamicconv import memory as translation_memory
from lowmem.dynamicconv.microbatch import part_sizes, split_batch
from lowmem.dynamicconv.plugin import ARCH

sys.path.insert(0, str(Path(__file__).parent))
from test_translation_techniques import FULL, NO_DROPOUT, PLUGIN, TINY, batch, data, trainer  # noqa: E402,F401


def test_sub_batches_keep_the_sentences_in_order_within_the_token_limit() -> None:
    sizes = [12, 12, 11, 9, 9, 7, 5, 3]
    for k in (1, 2, 3, 4, 8):
        limit = 100 // k
        parts = part_sizes(sizes, limit, k) if max(sizes) <= limit else None
        if parts is None:
            continue
        assert [i for p in parts for i in p] == list(range(len(sizes)))
        assert all(len(p) * max(sizes[i] for i in p) <= limit for p in parts)
        assert len(parts) >= min(k, len(sizes))
    assert part_sizes(sizes, 100, 1) == [list(range(8))]
    # Fewer sentences than k: one sentence a sub-batch, however small they are.
    assert part_sizes([3, 2, 1], 100, 8) == [[0], [1], [2]]


def test_a_sentence_longer_than_a_sub_batch_is_refused_with_its_length_and_the_limit() -> None:
    with pytest.raises(ValueError, match="a sentence pair of 12 tokens is longer than a sub-batch's 10 tokens"):
        part_sizes([12, 3], 10, 4)


def test_split_batch_trims_each_part_to_its_own_padding_and_keeps_every_token(data: Path) -> None:
    _, task = trainer(data, [])
    b = batch(task, list(range(24)))
    pad = task.source_dictionary.pad()
    parts = split_batch(b, 60, 4, pad)
    assert torch.equal(torch.cat([p["id"] for p in parts]), b["id"])
    assert sum(p["ntokens"] for p in parts) == b["ntokens"] and sum(p["nsentences"] for p in parts) == 24
    for p in parts:
        src, tgt = p["net_input"]["src_tokens"], p["target"]
        assert src.size(1) == int(p["net_input"]["src_lengths"].max()) and tgt.size(1) == int(tgt.ne(pad).sum(1).max())
        assert p["nsentences"] * max(src.size(1), tgt.size(1)) <= 60
        assert p["net_input"]["prev_output_tokens"].shape == tgt.shape
        rows = [int((b["id"] == i).nonzero()) for i in p["id"]]  # the part's sentences, as the batch held them
        assert torch.equal(b["target"][rows][:, :tgt.size(1)], tgt) and b["target"][rows][:, tgt.size(1):].eq(pad).all()


# The settings the frontier carries a twin's quality to microbatching in (lowmem.studies.quality_model.
# EQUAL_UP_TO_DROPOUT_DYNAMICCONV): fp32 weights and gradients, dense or sparse, with fairseq's Adam or 8-bit moments
# (the optimizer sees the same gradient). Not bf16 gradients, which sub-batches would accumulate in bf16.
SETTINGS = {"fp32": [], "sparsity": ["--sparsity", "0.9"], "adamw-8bit": ["--optimizer", "lowmem_adamw8bit"]}


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS)
def test_microbatches_give_the_gradients_of_the_whole_batch_with_dropout_off(data: Path, setting: str) -> None:
    """The same sentences and tokens in one update: LayerNorm has no batch statistics, so only the order of the
    sums differs."""
    one, task = trainer(data, [*NO_DROPOUT, *SETTINGS[setting], "--max-tokens", "4000"])
    four, task4 = trainer(data, [*NO_DROPOUT, *SETTINGS[setting], "--max-tokens", "4000", "--microbatches", "4"])
    task4.get_batch_iterator(task4.dataset("train"), max_tokens=4000)  # what fairseq-train does before training
    sample = batch(task, list(range(24)))
    one.train_step([sample])
    four.train_step([sample])
    assert task4.max_tokens == 4000 and len(split_batch(sample, 1000, 4, task4.source_dictionary.pad())) >= 4  # it split
    pairs = list(zip(one.model.named_parameters(), four.model.named_parameters()))
    assert sum(p.grad is not None for (_, p), _ in pairs) > 10
    for (name, a), (_, b) in pairs:
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_training_sentence_over_the_limit_is_refused_before_training(data: Path) -> None:
    _, task = trainer(data, ["--max-tokens", "4000", "--microbatches", "1000"])
    with pytest.raises(ValueError, match=r"a sentence pair of \d+ tokens is longer than a sub-batch's 4 tokens"):
        task.get_batch_iterator(task.dataset("train"), max_tokens=4000)


@pytest.mark.parametrize("k", ["0", "-2", "1.5", "two"])
def test_microbatches_below_1_or_not_whole_are_refused_by_argparse(data: Path, k: str, capsys: pytest.CaptureFixture[str]) -> None:
    from fairseq import options

    with pytest.raises(SystemExit) as exit_:
        options.parse_args_and_arch(options.get_training_parser(), [str(data / "bin"), *PLUGIN, "--arch", ARCH,
                                                                      "--microbatches", k, "--max-tokens", "1000", "--cpu"])
    assert exit_.value.code == 2 and f"argument --microbatches: must be a whole number >= 1, got '{k}'" in capsys.readouterr().err


def test_the_accountant_holds_the_largest_sub_batch_of_activations_at_a_time() -> None:
    """1,000 tokens of 32-token sentences: 31 sentences; sub-batches of at most 1000 // 4 = 250 tokens hold 7
    sentences (224 tokens), so four of 7 and one of 3. Every saved tensor of this model scales with the sentences,
    so the peak's activations are the whole batch's times 7/31, to the byte."""
    plugin = [*FULL, *PLUGIN, "--arch", ARCH]
    whole = translation_memory.account(plugin, 8848, 6632, tokens=1000, length=32)
    micro = translation_memory.account([*plugin, "--microbatches", "4"], 8848, 6632, tokens=1000, length=32)
    assert [len(p) for p in part_sizes([32] * 31, 250, 4)] == [7, 7, 7, 7, 3]
    assert micro.at_peak["activations"] * 31 == whole.at_peak["activations"] * 7
    assert micro.category_max["gradients"] == whole.category_max["gradients"]
    assert micro.category_max["optimizer"] == whole.category_max["optimizer"]


@pytest.mark.parametrize("options", [["--microbatches", "4"], ["--microbatches", "8", "--checkpoint-activations"],
                                     ["--update-freq", "3", "--microbatches", "2"], ["--update-freq", "4"],
                                     ["--microbatches", "4", "--sparsity", "0.5", "--precision", "half-bf16"]])
def test_accounting_repeated_batches_once_gives_every_byte_of_passing_them_all(options: list[str]) -> None:
    """The accountant passes the first two of a run of equal sub-batches (or --update-freq batches): the rest find the
    same tensors alive and leave them so. Equal to the byte: the peak, what each category holds there and at most."""
    args = [*TINY, *PLUGIN, *options]
    skipped = translation_memory.account(args, 64, 64, tokens=256, length=8)
    every = translation_memory.account(args, 64, 64, tokens=256, length=8, skip_repeats=False)
    assert (skipped.peak, skipped.at_peak, skipped.category_max) == (every.peak, every.at_peak, every.category_max)


def test_the_technique_accounting_is_the_same_on_two_processes_as_on_one() -> None:
    """The combination sweep accounts DynamicConv's grid on ``combinations_dynamicconv.workers`` processes; no
    number depends on how many."""
    from lowmem.dynamicconv.params import TranslationTechniquesParams
    from lowmem.studies import translation as study

    p = TranslationTechniquesParams(recipe_args=TINY[:TINY.index("--optimizer")], max_tokens=256, src_vocab=64, tgt_vocab=64,
                                    reference_length=8, techniques={"baseline": [], "mb4": ["--microbatches", "4"],
                                                                    "ckpt": ["--checkpoint-activations"]},
                                    trained=["baseline"], timed=["baseline"])
    one, two = study.memory(p), study.memory(p, workers=2)
    pd.testing.assert_frame_equal(one, two)
    assert one.technique.tolist() == ["baseline", "mb4", "ckpt"] and one.total_mib.nunique() == 3
