"""The translation track: corpus readers on files in their real on-disk formats, the preparation, fairseq's own CLI
on a few updates, the BLEU parsing, and the accountant on a fairseq step."""

import dataclasses
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from lowmem import runs
from lowmem.config import ParamError, resolve
from lowmem.dynamicconv import commands, corpus, translation
from lowmem.dynamicconv import memory as translation_memory
from lowmem.dynamicconv.params import TranslationDataParams, TranslationEvaluateParams, TranslationTrainParams

ROOT = Path(__file__).parents[1]
TINY_MODEL = ["--arch", "lightconv_iwslt_de_en", "--encoder-glu", "0", "--decoder-glu", "0", "--encoder-embed-dim", "16",
              "--encoder-ffn-embed-dim", "32", "--encoder-layers", "1", "--encoder-kernel-size-list", "[3]",
              "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--decoder-layers", "1",
              "--decoder-kernel-size-list", "[3]", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]


def write_mo(path: Path, entries: dict[str, str]) -> Path:
    """A GNU .mo catalog (the format msgfmt writes): header, then the two string tables."""
    entries = {"": "Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2; plural=(n != 1);\n", **entries}
    keys = sorted(entries)
    ids = [k.encode() for k in keys]
    strs = [entries[k].encode() for k in keys]
    n = len(keys)
    start = 7 * 4 + 16 * n
    blob, id_table, str_table = b"", [], []
    for table, items in ((id_table, ids), (str_table, strs)):
        for s in items:
            table.append((len(s), start + len(blob)))
            blob += s + b"\0"
    head = struct.pack("<7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0)
    body = b"".join(struct.pack("<2I", *e) for e in id_table + str_table)
    path.write_bytes(head + body + blob)
    return path


def test_a_gettext_catalog_gives_its_translated_lines(tmp_path: Path) -> None:
    mo = write_mo(tmp_path / "x.mo", {
        "Open the file": "Datei öffnen",
        "menu\x04Quit": "Beenden",  # with a context
        "%d file\x00%d files": "%d Datei\x00%d Dateien",  # plural: the singular pair is kept
        "Germany": "Germany",  # untranslated: dropped
        "line one\nline two": "Zeile eins\nZeile zwei",  # split into two pairs
        "one\ntwo": "eins zwei",  # lines do not match: dropped
    })
    assert sorted(corpus.read_catalog(mo)) == sorted([
        ("Datei öffnen", "Open the file"), ("Beenden", "Quit"), ("%d Datei", "%d file"),
        ("Zeile eins", "line one"), ("Zeile zwei", "line two"),
    ])


def test_an_uninstalled_package_says_how_to_install_it() -> None:
    with pytest.raises(corpus.CorpusMissing, match="apt-get install no-such-package-lowmem"):
        corpus.catalogs(["no-such-package-lowmem"])


def test_the_iwslt14_reader_undoes_the_archive_format(tmp_path: Path) -> None:
    train = [(f"Satz {i} & mehr", f"Sentence {i} & more") for i in range(120)]
    test = [(f"Test \u2019{i}\u2019", f"Test {i}") for i in range(12)]
    archive = corpus.write_iwslt14_archive(tmp_path / "de-en.tgz", train, test)
    raw = corpus.read_iwslt14(archive)
    assert raw["train"] == train  # talk headers dropped, the title's text kept
    # The five XML sets, in the order prepare-iwslt14.sh concatenates them; typographic apostrophes made plain.
    expected = [(de.replace("\u2019", "'"), en) for j in range(5) for de, en in test[j::5]]
    assert raw["test"] == expected


def test_preparation_tokenizes_cleans_splits_and_bpes(tmp_path: Path) -> None:
    pairs = [(f"Das ist Satz Nummer {i}, nicht wahr?", f"This is sentence number {i}, isn't it?") for i in range(60)]
    pairs.append(("Kurz", "This one is far too long for its German side"))  # ratio > 1.5: cleaned away
    pairs.append((" ".join(["lang"] * 12), " ".join(["long"] * 12)))  # over max_len = 11: cleaned away
    test = [("Ein Test.", "A test.")]
    counts = corpus.prepare({"train": pairs, "test": test}, tmp_path, merges=20, max_len=11, ratio=1.5, valid_every=23)
    # The 60 numbered pairs stay (9 German and 10 English tokens); validation is every 23rd of them.
    assert (counts["train_pairs"], counts["valid_pairs"], counts["raw_train_pairs"]) == (58, 2, 62)
    assert counts["bpe_merges_learned"] == 20
    train_en = (tmp_path / "train.en").read_text().splitlines()
    # Moses escaping and lowercasing, then BPE: removing the "@@ " joints gives the tokenized text back.
    assert train_en[0].replace("@@ ", "") == "this is sentence number 0 , isn &apos;t it ?"
    assert all(len(line.replace("@@ ", "").split()) <= 11 for line in train_en)
    assert (tmp_path / "test.de").read_text().replace("@@ ", "") == "ein test .\n"
    assert (tmp_path / "raw" / "test.en").read_text() == "A test.\n"  # sacreBLEU's reference stays untokenized

    info = corpus.binarize(tmp_path, tmp_path / "bin")
    for lang in corpus.LANGS:
        types = {t for line in (tmp_path / f"train.{lang}").read_text().splitlines() for t in line.split()}
        listed = {line.split()[0] for line in (tmp_path / "bin" / f"dict.{lang}.txt").read_text().splitlines()}
        # fairseq's dictionary is the training side's BPE types, padded with made-up words to a multiple of 8.
        assert {t for t in listed if not t.startswith("madeupword")} == types
        assert info[f"dict_{lang}_types"] == len(listed) + 4  # plus bos, pad, eos, unk, as fairseq reports it
        assert info[f"dict_{lang}_types"] % 8 == 0 and len(listed) - len(types) < 8
        assert (tmp_path / "bin" / f"test.de-en.{lang}.bin").stat().st_size > 0
    # Again into the same folder (fairseq-preprocess alone refuses one that holds dictionaries): rebuilt, not mixed.
    (tmp_path / "bin" / "dict.en.txt").write_text("stale 1\n")
    assert corpus.binarize(tmp_path, tmp_path / "bin") == info


def test_bad_translation_parameters_are_refused_with_the_allowed_values() -> None:
    with pytest.raises(ParamError, match="corpus='wmt' is not allowed; use one of: iwslt14, gettext, synthetic"):
        TranslationDataParams(corpus="wmt")
    with pytest.raises(ParamError, match="--arch"):
        TranslationTrainParams(recipe_args=["--lr", "1"])
    with pytest.raises(ParamError, match="reference_length"):
        resolve("translation_memory", {"base": {"profile": "smoke"}, "translation_memory": {"sentence_lengths": [8], "reference_length": 16}})


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lowmem.pipeline", "dynamicconv", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_missing_iwslt14_archive_gives_the_instruction_not_a_traceback(tmp_path: Path) -> None:
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({"corpus": "iwslt14", "iwslt14_archive": str(tmp_path / "nowhere" / "de-en.tgz")}))
    r = _cli(["prepare", "--params", str(params), "--data-dir", str(tmp_path / "t")], tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "wit3.fbk.eu" in r.stderr and "iwslt14_archive" in r.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], TranslationTrainParams]:
    """The smoke corpus, binarized, and a tiny model trained for 30 updates by fairseq-train."""
    data = tmp_path_factory.mktemp("translation")
    p = TranslationDataParams(corpus="synthetic", synthetic_pairs=600, test_size=40, bpe_merges=50)
    translation.prepare(p, data)
    translation.binarize(p, data)
    t = TranslationTrainParams(recipe_args=[*TINY_MODEL, "--optimizer", "adam", "--lr-scheduler", "inverse_sqrt", "--dropout", "0"],
                               max_tokens=1000, max_update=30, warmup_updates=5, lr=0.005, device="cpu")
    return data, translation.train(t, data), t


@pytest.mark.slow
def test_a_few_fairseq_train_updates_on_cpu_reduce_the_loss(trained: tuple[Path, list[dict], TranslationTrainParams]) -> None:
    data, records, t = trained
    inner = [r for r in records if r["kind"] == "train_inner"]
    assert [int(r["num_updates"]) for r in inner] == [10, 20, 30]
    assert inner[-1]["loss"] < inner[0]["loss"] - 1.0
    run_dir = translation.store_run(t, data).dir
    assert (run_dir / "checkpoint_last.pt").exists()
    assert not list(run_dir.glob("checkpoint[0-9]*.pt"))  # --no-epoch-checkpoints
    epochs = translation.history(records)
    assert [e["epoch"] for e in epochs] == list(range(1, len(epochs) + 1))
    assert all("valid_loss" in e and "train_loss" in e for e in epochs)


@pytest.mark.slow
def test_the_train_step_on_the_command_line_names_the_stores_run(trained: tuple[Path, list[dict], TranslationTrainParams],
                                                                  tmp_path: Path) -> None:
    # What DVC's translation_train stage runs (tests/test_pipeline.py runs the WRN stages only): the run trained
    # above is this command's, read from the store (the same LOWMEM_RUNS), not trained again.
    data, records, t = trained
    params = tmp_path / "translation_train.yaml"
    params.write_text(yaml.safe_dump(dataclasses.asdict(t)))
    r = _cli(["train", "--params", str(params), "--data-dir", str(data), "--metrics", str(tmp_path / "train.json")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "train.json").read_text())
    assert (result["key"], result["trained"], result["records"]) == (translation.store_run(t, data).key, False, records)


@pytest.mark.slow
def test_a_command_forked_from_the_server_trains_as_a_fresh_fairseq_train_process(
        trained: tuple[Path, list[dict], TranslationTrainParams], tmp_path: Path) -> None:
    # lowmem.dynamicconv.commands forks each command from a process that imported fairseq once: the same updates,
    # to the last digit fairseq logs, as `python -m fairseq_cli.train` in an interpreter of its own.
    data, records, t = trained
    args = translation.train_args(t, data / "bin", tmp_path)
    fresh = subprocess.run([sys.executable, "-m", "fairseq_cli.train", *args], capture_output=True, text=True, env=commands.env())
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    timing = {"wps", "ups", "wall", "train_wall", "gb_free"}  # per record kind: train_inner's wps, valid's valid_wps, ...

    def computed(recs: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in timing and k.split("_", 1)[-1] not in timing} for r in recs]

    assert computed(translation.parse_log(fresh.stdout.splitlines())) == computed(records)
    # A failing command's status and message come back as from a process of its own.
    argv = [str(data / "bin"), "--no-such-option"]
    bad = commands.captured("train", argv)
    alone = subprocess.run([sys.executable, "-m", "fairseq_cli.train", *argv], capture_output=True, text=True, env=commands.env())
    assert bad.returncode == alone.returncode != 0
    assert bad.stderr.strip().splitlines()[-1] == alone.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_an_interrupted_caller_leaves_no_command_running(trained: tuple[Path, list[dict], TranslationTrainParams],
                                                        tmp_path: Path) -> None:
    # Ctrl-C in a notebook while fairseq-train runs: the command stops with its caller, not on behind it.
    data, _, t = trained
    log = tmp_path / "train.log"
    args = translation.train_args(dataclasses.replace(t, max_update=100_000), data / "bin", tmp_path)
    args[args.index("--log-interval") + 1] = "1"

    def interrupt_once_training() -> None:
        if log.exists() and "num_updates" in log.read_text():  # updating: the first --log-interval's line is out
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        commands.run("train", args, log, poll=interrupt_once_training)
    size = log.stat().st_size
    time.sleep(3)  # at --log-interval 1 a running fairseq-train logs every few milliseconds
    assert log.stat().st_size == size and "done training" not in log.read_text()
    assert commands.captured("train", [str(data / "bin"), "--no-such-option"]).returncode != 0  # a fresh server serves


@pytest.mark.slow
def test_fairseq_generate_gives_a_bleu_line_the_pipeline_parses(trained: tuple[Path, list[dict], TranslationTrainParams]) -> None:
    data, _, t = trained
    result = translation.evaluate(TranslationEvaluateParams(beam=4, device="cpu"), data, translation.store_run(t, data).dir)
    text = (data / "generate" / "generate.txt").read_text()
    assert result["bleu_tokenized"] == translation.parse_bleu(text)
    assert 0 <= result["bleu_tokenized"] <= 100 and 0 <= result["sacrebleu"] <= 100
    assert result["test_sentences"] == 40 == len(translation.hypotheses(text))  # none dropped by batching
    assert "case:lc" in result["sacrebleu_signature"]


@pytest.mark.slow
def test_a_finished_command_is_not_rerun_and_another_starts_over(trained: tuple[Path, list[dict], TranslationTrainParams]) -> None:
    data, records, t = trained
    run = translation.store_run(t, data)
    before = [e["event"] for e in runs.ledger() if e["key"] == run.key]  # other tests of the module reuse it too
    again = translation.train(t, data)  # finished by this command: read from the store, fairseq is not restarted
    assert again == records
    assert before[0] == "trained" and "trained" not in before[1:]
    assert [e["event"] for e in runs.ledger() if e["key"] == run.key] == before + ["reused"]
    longer = TranslationTrainParams(**{**t.__dict__, "max_update": 40})
    assert translation.store_run(longer, data).key != run.key
    fresh = translation.train(longer, data)  # another command: another run, the old checkpoints are not resumed
    assert [int(r["num_updates"]) for r in fresh if r["kind"] == "train_inner"] == [10, 20, 30, 40]
    # Where it runs and writes is not part of the run: the same run on another device string or worker count.
    assert translation.store_run(TranslationTrainParams(**{**t.__dict__, "device": "auto"}), data).key == run.key


@pytest.mark.slow
def test_a_fairseq_train_that_dies_after_it_finished_keeps_its_run_and_one_that_dies_before_fails(
        trained: tuple[Path, list[dict], TranslationTrainParams], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in for fairseq-train: it prints a finished run's log (or that log less its last line) and aborts, as
    # fairseq-train did once at exit in CI ("terminate called without an active exception").
    data, records, t = trained
    finished = translation.store_run(t, data).dir / "train.log"
    lines = finished.read_text().splitlines(keepends=True)
    assert "done training in" in lines[-1]
    unfinished = tmp_path / "unfinished.log"
    unfinished.write_text("".join(lines[:-1]))

    def dies_after(log: Path) -> None:
        script = f"import os, sys; sys.stdout.write(open({str(log)!r}).read()); sys.stdout.flush(); os.abort()"

        def run(tool: str, argv: list[str], stdout: Path, stderr: Path | None = None, poll: object = None) -> int:
            with open(stdout, "a") as out:
                return subprocess.run([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT).returncode

        monkeypatch.setattr(translation.commands, "run", run)

    dies_after(finished)
    kept = translation.train(TranslationTrainParams(**{**t.__dict__, "max_update": 41}), data)
    assert kept == translation.parse_log(lines)
    dies_after(unfinished)
    with pytest.raises(RuntimeError, match=r"fairseq-train failed \(-6\)"):
        translation.train(TranslationTrainParams(**{**t.__dict__, "max_update": 43}), data)


@pytest.mark.slow
def test_a_longer_runs_interval_checkpoint_is_the_shorter_runs_model(trained: tuple[Path, list[dict], TranslationTrainParams]) -> None:
    # BLEU over updates (lowmem.studies.bleu_noise) decodes one long run's interval checkpoints in place of runs
    # stopped there: fairseq seeds each update from its number, and saving or validating in between draws nothing.
    data, _, t = trained
    # An epoch here is 10 updates, and fairseq saves no interval checkpoint on an epoch's last update: every 5
    # updates gives 5, 15, 25 and 35, and none at 10, 20 or 30.
    longer = TranslationTrainParams(**{**t.__dict__, "max_update": 42, "recipe_args": [*t.recipe_args, "--dropout", "0.3"],
                                       "scale_args": ["--save-interval-updates", "5"]})
    short = TranslationTrainParams(**{**longer.__dict__, "max_update": 15, "scale_args": []})
    translation.train(longer, data)
    translation.train(short, data)
    long_dir, short_dir = translation.store_run(longer, data).dir, translation.store_run(short, data).dir
    saved = sorted(int(f.stem.rsplit("_", 1)[1]) for f in long_dir.glob("checkpoint_*_*.pt"))
    assert saved == [5, 15, 25, 35]
    a = torch.load(translation.update_checkpoint(long_dir, 15, 42), map_location="cpu", weights_only=False)["model"]
    b = torch.load(short_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]
    # fairseq's scriptable DynamicConv allocates conv_bias uninitialized (torch.Tensor) and, without --conv-bias,
    # never initializes, uses or updates it: its bytes are whatever memory held.
    trained = [k for k in a if not k.endswith("conv.conv_bias")]
    assert a.keys() == b.keys() and len(trained) > len(a) // 2
    assert all(torch.equal(a[k], b[k]) for k in trained)
    last = torch.load(translation.update_checkpoint(long_dir, 42, 42), map_location="cpu", weights_only=False)["model"]
    assert not all(torch.equal(a[k], last[k]) for k in trained)  # the last checkpoint is another model
    with pytest.raises(FileNotFoundError, match="off the epoch ends"):
        translation.update_checkpoint(long_dir, 20, 42)  # an epoch's end, a multiple of 5


def test_checkpoint_averaging_is_the_mean_of_the_models(tmp_path: Path) -> None:
    states = [{"model": {"w": torch.full((2, 3), float(i)), "n": torch.tensor([7])}, "args": None} for i in (1, 2, 6)]
    paths = []
    for i, s in enumerate(states):
        paths.append(tmp_path / f"checkpoint{i + 1}.pt")
        torch.save(s, paths[-1])
    out = translation.average_checkpoints(paths, tmp_path / "avg.pt")
    avg = torch.load(out, weights_only=False)["model"]
    assert torch.equal(avg["w"], torch.full((2, 3), 3.0)) and avg["w"].dtype == torch.float32
    assert torch.equal(avg["n"], torch.tensor([7]))  # integer buffers, equal in all three, kept
    # A DSR run's sparse positions move between checkpoints: their values cannot be averaged position by position.
    moved = tmp_path / "checkpoint9.pt"
    torch.save({"model": {"w": torch.zeros(2, 3), "n": torch.tensor([8])}, "args": None}, moved)
    with pytest.raises(ValueError, match="average_last 1"):
        translation.average_checkpoints([paths[0], moved], tmp_path / "bad.pt")
    with pytest.raises(FileNotFoundError, match="keep_last_epochs >= 5"):
        translation.last_epoch_checkpoints(tmp_path, 5)


def test_the_accountant_agrees_with_measurement_on_a_tiny_lightconv() -> None:
    args = (TINY_MODEL, 50, 40)
    meta = translation_memory.account(*args, tokens=64, length=8)
    real = translation_memory.account(*args, tokens=64, length=8, device="cpu")
    assert (meta.peak, meta.at_peak, meta.category_max) == (real.peak, real.at_peak, real.category_max)
    measured, _ = translation_memory.measure(*args, tokens=64, length=8)
    assert abs(meta.peak - measured) / measured < 0.03


def test_the_full_size_step_holds_weights_gradients_and_adam_state_at_four_bytes_each() -> None:
    recipe = ["--arch", "lightconv_iwslt_de_en", "--encoder-glu", "0", "--decoder-glu", "0"]
    n = translation_memory.parameter_count(recipe, 8848, 6632)
    # Which parameters get a gradient, from one real step of the same model on a few tokens. fairseq's scriptable
    # DynamicConv creates a conv_bias that its forward never uses: no gradient, so no Adam state either.
    step, model, _, _ = translation_memory.fairseq_step(recipe, 8848, 6632, tokens=16, length=8, device="cpu")
    step(lambda _: None)
    used = sum(p.numel() for p in model.parameters() if p.grad is not None)
    unused = [name for name, p in model.named_parameters() if p.grad is None]
    assert len(unused) == 7 + 6 and all(name.endswith(".conv.conv_bias") for name in unused)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    r = translation_memory.account(recipe, 8848, 6632, tokens=4000, length=32)
    assert r.category_max["gradients"] == 4 * used
    assert r.category_max["optimizer"] == 2 * 4 * used  # exp_avg and exp_avg_sq, fp32
    assert r.category_max["model"] == 4 * n + buffers
    # The full-size configuration: 7 encoder layers with kernels 3..31, 6 decoder layers, width 512.
    args = translation_memory.model_args(recipe)
    assert (args.encoder_layers, args.decoder_layers, args.encoder_embed_dim, args.encoder_glu) == (7, 6, 512, False)
    assert args.encoder_kernel_size_list == [3, 7, 15, 31, 31, 31, 31]
