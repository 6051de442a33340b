"""The translation track's runs (Sohoni et al. 2019, the DynamicConv benchmark), through fairseq's own CLI:
prepare → binarize → ``fairseq-train`` → checkpoint averaging → ``fairseq-generate`` (beam 4, ``--remove-bpe``).

Each step is a subcommand of ``python -m lowmem.pipeline dynamicconv`` that DVC runs with one stage's resolved parameters::

    python -m lowmem.pipeline dynamicconv prepare  --params data/params/translation_data.yaml
    python -m lowmem.pipeline dynamicconv binarize --params data/params/translation_data.yaml
    python -m lowmem.pipeline dynamicconv train    --params data/params/translation_train.yaml
    python -m lowmem.pipeline dynamicconv evaluate --params data/params/translation_evaluate.yaml

``train`` prints the exact ``fairseq-train`` command it runs. Its run lives in the run store (``lowmem.runs``),
keyed by the command without its paths and device, the binarized data's digest, and, for runs through lowmem's
plugin, the plugin's code: a finished run is read, never retrained, and one stopped part-way resumes from
fairseq's own ``checkpoint_last.pt``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from lowmem import runs
from lowmem.config import ParamError, load, resolve
from lowmem.dynamicconv import commands, corpus
from lowmem.dynamicconv.params import TranslationDataParams, TranslationEvaluateParams, TranslationTrainParams

DATA = Path("data/translation")  # raw/ and bpe/ (prepare), bin/ (binarize), generate/ (evaluate); runs: lowmem.runs
# Options that do not change what fairseq-train computes: where it writes and finds the plugin (the plugin's code is
# keyed instead), whether it runs on the CPU, and its data-loading workers. Value: how many words follow.
CHECKPOINT = "--checkpoint-activations"
NOT_IN_KEY = {"--save-dir": 1, "--user-dir": 1, "--num-workers": 1, "--cpu": 0,
              # Checkpointed layers recompute the same forward: tests/test_translation_techniques.py proves loss and
              # gradients bit-equal with dropout on, so a checkpointed run is the plain run, trained once, without.
              CHECKPOINT: 0}


def prepare(p: TranslationDataParams, data_dir: Path = DATA) -> dict[str, Any]:
    """Reads the profile's corpus and writes tokenized, cleaned, BPE'd splits to ``data_dir/bpe``."""
    info: dict[str, Any] = {"corpus": p.corpus}
    if p.corpus == "gettext":
        raw, extra = corpus.read_gettext(p.gettext_packages, p.test_size, p.seed)
        info.update(extra, source="German gettext catalogs of the listed Debian packages (/usr/share/locale/de)")
        info["debian_version"] = Path("/etc/debian_version").read_text().strip() if Path("/etc/debian_version").exists() else "unknown"
    else:
        if p.corpus == "synthetic":
            pairs = corpus.synthetic_pairs(p.synthetic_pairs + p.test_size, p.seed)
            archive = corpus.write_iwslt14_archive(data_dir / "synthetic" / "de-en.tgz", pairs[p.test_size :], pairs[: p.test_size])
            info["source"] = "synthetic toy corpus, written as an IWSLT'14 archive"
        else:
            archive = corpus.fetch_archive(p.iwslt14_archive, data_dir / "download")
            info["source"] = f"IWSLT'14 De-En ({p.iwslt14_archive})"
        info["archive_sha256"] = corpus.sha256_of([archive])
        raw = corpus.read_iwslt14(archive)
    info.update(corpus.prepare(raw, data_dir / "bpe", p.bpe_merges, p.max_len, p.length_ratio, p.valid_every))
    corpus.manifest(data_dir / "bpe" / "corpus.json", **info)
    return info


def binarize(p: TranslationDataParams, data_dir: Path = DATA) -> dict[str, Any]:
    info = json.loads((data_dir / "bpe" / "corpus.json").read_text())
    info.update(corpus.binarize(data_dir / "bpe", data_dir / "bin", p.workers))
    corpus.manifest(data_dir / "bin" / "corpus.json", **info)
    return info


def _use_cpu(device: str) -> bool:
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def train_args(p: TranslationTrainParams, bin_dir: Path, save_dir: Path) -> list[str]:
    """``fairseq-train``'s arguments: the recipe, then the profile's scaling, then this run's paths and sizes."""
    args = [str(bin_dir), *map(str, p.recipe_args), *map(str, p.scale_args)]
    args += ["--max-tokens", str(p.max_tokens), "--max-update", str(p.max_update), "--warmup-updates", str(p.warmup_updates),
             "--lr", str(p.lr), "--seed", str(p.seed), "--save-dir", str(save_dir),
             # fairseq-fixed drops a last batch smaller than this multiple (environment notes).
             "--required-batch-size-multiple", "1", "--log-format", "json", "--log-interval", "10", "--num-workers", "0"]
    args += ["--keep-last-epochs", str(p.keep_last_epochs)] if p.keep_last_epochs > 1 else ["--no-epoch-checkpoints"]
    return args + (["--cpu"] if _use_cpu(p.device) else [])


def data_digest(bin_dir: Path) -> str:
    """The binarized corpus's identity: the names and bytes of what fairseq-train reads, its dictionaries and
    binaries (not where they lie, nor fairseq-preprocess's log, which holds the time it ran)."""
    h = hashlib.sha256()
    for f in sorted(Path(bin_dir).iterdir()):
        if f.is_file() and (f.suffix in (".bin", ".idx") or f.name.startswith("dict.")):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def run_fields(p: TranslationTrainParams, data_dir: Path = DATA) -> dict[str, Any]:
    """What a fairseq run's key is made of, besides the plugin's code: its options, the data, fairseq's version."""
    args, kept = train_args(p, Path("BIN"), Path("SAVE"))[1:], []
    i = 0
    while i < len(args):
        if args[i] in NOT_IN_KEY:
            i += 1 + NOT_IN_KEY[args[i]]
            continue
        kept.append(args[i])
        i += 1
    return {"args": kept, "data": data_digest(data_dir / "bin"), "fairseq": importlib.metadata.version("fairseq-fixed")}


# What --user-dir names: a folder alone in its parent, since fairseq puts that parent on sys.path. Defined here, off
# the plugin's code path, so that where the folder lives is never part of a run's key.
PLUGIN_DIR = Path(__file__).parents[1] / "fairseq_user_dir" / "lowmem_fairseq"
# The code on a plugin run's training path, for its key.
PLUGIN_CODE = runs.closure("lowmem.dynamicconv.plugin")


def store_run(p: TranslationTrainParams, data_dir: Path = DATA) -> runs.Run:
    plugin = "--user-dir" in map(str, p.scale_args)
    return runs.Run("fairseq", run_fields(p, data_dir), PLUGIN_CODE if plugin else [])


def shell(name: str, args: list[str]) -> str:
    """A command line a user can paste (``fairseq-<name> ...``), for logs and the README."""
    return " ".join([f"fairseq-{name}", *(a if re.fullmatch(r"[\w@%+=:,./-]+", a) else f"'{a}'" for a in args)])


def parse_log(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON records of a ``--log-format json`` fairseq-train log, each tagged with its kind (train_inner,
    train, valid); numbers as floats."""
    out = []
    for line in lines:
        m = re.search(r"\| (train_inner|train|valid) \| (\{.*\})\s*$", line)
        if m:
            rec = {k: float(v) if re.fullmatch(r"-?[\d.e+-]+", str(v)) else v for k, v in json.loads(m.group(2)).items()}
            out.append({"kind": m.group(1), **rec})
    return out


def train(p: TranslationTrainParams, data_dir: Path = DATA) -> list[dict[str, Any]]:
    """The parsed records of the run's ``fairseq-train`` log, from the run store: a finished run is read, an
    interrupted one resumes from its ``checkpoint_last.pt``, a new one is trained. Its log streams to ``train.log``
    in the run's folder (``store_run(p, data_dir).dir``), where its checkpoints are too."""
    run = store_run(p, data_dir)
    done = run.result()
    if done is not None:
        run.log("reused")
        print(f"fairseq run {run.key} is in the store; nothing to train", flush=True)
        return done
    save_dir = run.dir
    run.start()
    args = [a for a in train_args(p, data_dir / "bin", save_dir) if a != CHECKPOINT]  # see NOT_IN_KEY
    print(shell("train", args), flush=True)
    log = save_dir / "train.log"
    t0 = time.perf_counter()
    if log.exists() and "done training in" in log.read_text().rstrip().rsplit("\n", 1)[-1]:
        # Finished, but stopped before its result was written: restarting fairseq would take one more update.
        records = parse_log(log.read_text().splitlines())
        run.finish(records, 0.0)
        return records
    bar = tqdm(total=p.max_update, desc="fairseq-train updates", mininterval=5)
    log.touch()
    with open(log) as f:
        f.seek(0, 2)  # this attempt's lines; a resumed run's earlier ones are in the log already
        pending = [""]  # a line fairseq has not finished writing

        def follow() -> None:
            *lines, pending[0] = (pending[0] + f.read()).split("\n")
            for line in lines:
                for rec in parse_log([line]):
                    if rec["kind"] == "train_inner":
                        bar.update(int(rec["num_updates"]) - bar.n)
                    elif rec["kind"] == "valid":
                        bar.write(f"epoch {int(rec['epoch'])}: valid loss {rec['valid_loss']:.3f}")

        code = commands.run("train", args, log, poll=follow)
        follow()
    bar.close()
    finished = "done training in" in log.read_text().rstrip().rsplit("\n", 1)[-1]
    if code != 0 and finished:
        # fairseq-train printed its last line, after saving its last checkpoint, and then died as the interpreter
        # exited (seen once in CI: "terminate called without an active exception", SIGABRT): the run is complete.
        print(f"fairseq-train exited with {code} after it finished training; its run is kept", flush=True)
    elif code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"fairseq-train failed ({code}); the end of {log}:\n{tail}")
    records = parse_log(log.read_text().splitlines())
    run.finish(records, time.perf_counter() - t0)
    return records


def average_checkpoints(paths: list[Path], out: Path) -> Path:
    """The element-wise mean of the models in ``paths``, saved as a fairseq checkpoint (the first one's metadata).
    Hand-written: fairseq's ``scripts/average_checkpoints.py`` is not part of its pip package."""
    avg: dict[str, torch.Tensor] = {}
    first: dict[str, Any] = {}
    for i, path in enumerate(paths):
        state = torch.load(path, map_location="cpu", weights_only=False)
        if i == 0:
            first = state
        for k, v in state["model"].items():
            if not isinstance(v, torch.Tensor):
                continue  # a module's extra state (lowmem's DSR schedule) is kept as the first checkpoint has it
            if i > 0 and not v.is_floating_point() and not torch.equal(v, first["model"][k]):
                # Sparse layers' positions (DSR moves them): their values do not line up across checkpoints.
                raise ValueError(f"{k} differs between {paths[0].name} and {path.name}; these checkpoints cannot be averaged "
                                 "(a DSR run rewires its sparse layers): evaluate with average_last 1")
            v = v.double() if v.is_floating_point() else v
            avg[k] = v.clone() if i == 0 else avg[k] + v
    # As fairseq's script: floats averaged (integer buffers are equal, checked above).
    first["model"] = {k: (avg[k] / len(paths)).to(v.dtype) if k in avg and v.is_floating_point() else v for k, v in first["model"].items()}
    torch.save(first, out)
    return out


def last_epoch_checkpoints(save_dir: Path, n: int) -> list[Path]:
    found = sorted(save_dir.glob("checkpoint[0-9]*.pt"), key=lambda f: int(re.findall(r"\d+", f.name)[0]))
    if len(found) < n:
        raise FileNotFoundError(
            f"average_last={n} needs {n} epoch checkpoints in {save_dir}, found {len(found)}; "
            f"train with translation_train.keep_last_epochs >= {n}"
        )
    return found[-n:]


def parse_bleu(text: str) -> float:
    """The score of fairseq-generate's last line, ``Generate test with beam=4: BLEU4 = 34.52, ...``."""
    m = re.findall(r"Generate \w+ with beam=\d+: BLEU4? = ([\d.]+)", text)
    if not m:
        raise ValueError("no 'Generate ... BLEU4 = ' line in fairseq-generate's output")
    return float(m[-1])


def hypotheses(text: str) -> list[str]:
    """fairseq-generate's hypotheses (``H-<id>`` lines), in test-set order."""
    hyps = {int(m.group(1)): m.group(2) for m in re.finditer(r"^H-(\d+)\t[^\t]*\t(.*)$", text, flags=re.M)}
    return [hyps[i] for i in sorted(hyps)]


def detokenized(hyps: list[str]) -> list[str]:
    """fairseq-generate's hypotheses (BPE removed, Moses-tokenized) as plain English sentences, for sacreBLEU."""
    from sacremoses import MosesDetokenizer

    md = MosesDetokenizer(lang="en")
    return [md.detokenize(h.split(), unescape=True) for h in hyps]


def test_references(data_dir: Path) -> list[str]:
    """The untokenized English side of the test split, which sacreBLEU scores against."""
    return (data_dir / "bpe" / "raw" / "test.en").read_text(encoding="utf-8").splitlines()


# The recipe lowercases both sides, so sacreBLEU scores case-insensitively (its own option), here and in the paired
# bootstrap of lowmem.studies.translation.
LOWERCASE = True


def sacrebleu_score(hyps: list[str], refs: list[str]) -> tuple[float, str]:
    """sacreBLEU of the detokenized hypotheses against the untokenized references. The model writes lowercase
    (the recipe lowercases), so the score is case-insensitive. Returns (score, sacreBLEU's signature)."""
    from sacrebleu.metrics import BLEU

    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses for {len(refs)} references")
    bleu = BLEU(lowercase=LOWERCASE)
    return round(bleu.corpus_score(detokenized(hyps), [refs]).score, 2), str(bleu.get_signature())


def update_checkpoint(save_dir: Path, updates: int, max_update: int) -> Path:
    """The checkpoint a run trained with ``--save-interval-updates`` saved at ``updates`` (its last one is
    ``checkpoint_last.pt``)."""
    found = sorted(save_dir.glob(f"checkpoint_*_{updates}.pt"))
    if found:
        return found[0]
    if updates == max_update and (save_dir / "checkpoint_last.pt").exists():
        return save_dir / "checkpoint_last.pt"
    saved = sorted(int(f.stem.rsplit("_", 1)[1]) for f in save_dir.glob("checkpoint_*_*.pt"))
    raise FileNotFoundError(
        f"no checkpoint at update {updates} in {save_dir} (saved: {saved}); fairseq saves an interval checkpoint only "
        "off an epoch's last update, so choose update counts off the epoch ends (each epoch's num_updates is in the "
        "log's train records)")


def evaluate(p: TranslationEvaluateParams, data_dir: Path, save_dir: Path, out_dir: Path | None = None,
             extra_args: tuple[str, ...] = (), checkpoint: Path | None = None) -> dict[str, Any]:
    """fairseq-generate on the test split with the (averaged) checkpoint of the run in ``save_dir``, or with
    ``checkpoint``, output in ``out_dir`` (default ``data_dir/generate``); ``extra_args`` such as a plugin's
    ``--user-dir``."""
    out_dir = out_dir or data_dir / "generate"
    out_dir.mkdir(parents=True, exist_ok=True)
    if checkpoint is not None:
        if not checkpoint.exists():
            raise FileNotFoundError(f"{checkpoint} is missing")
    elif p.average_last > 1:
        checkpoint = average_checkpoints(last_epoch_checkpoints(save_dir, p.average_last), out_dir / f"checkpoint_last{p.average_last}_avg.pt")
    else:
        checkpoint = save_dir / "checkpoint_last.pt"
        if not checkpoint.exists():
            raise FileNotFoundError(f"{checkpoint} is missing; run the translation_train stage first (dvc repro translation_train)")
    args = [str(data_dir / "bin"), "--path", str(checkpoint), "--gen-subset", "test", "--beam", str(p.beam),
            "--lenpen", str(p.lenpen), "--remove-bpe", "--batch-size", str(p.batch_size),
            "--required-batch-size-multiple", "1", *extra_args] + (["--cpu"] if _use_cpu(p.device) else [])
    print(shell("generate", args), flush=True)
    r = commands.captured("generate", args)
    (out_dir / "generate.txt").write_text(r.stdout)
    if r.returncode != 0:
        raise RuntimeError(f"fairseq-generate failed ({r.returncode}):\n{r.stderr[-3000:]}")
    refs = test_references(data_dir)
    sacre, signature = sacrebleu_score(hypotheses(r.stdout), refs)
    return {"bleu_tokenized": parse_bleu(r.stdout), "sacrebleu": sacre, "sacrebleu_signature": signature,
            "test_sentences": len(refs), "checkpoint": checkpoint.name, "beam": p.beam, "averaged_checkpoints": p.average_last}


def train_result(p: TranslationTrainParams, data_dir: Path = DATA) -> dict[str, Any]:
    """What the translation_train stage records: the run's key and folder, whether this call trained it, its log."""
    run = store_run(p, data_dir)
    trained = run.result() is None
    records = train(p, data_dir)
    return {"profile": p.profile, "key": run.key, "dir": str(run.dir), "trained": trained, "records": records}


def run_track(params: dict[str, Any], data_dir: Path, train_path: Path) -> dict[str, Any]:
    """All four steps at the profile of ``params`` (a parsed params.yaml): what the DVC stages do, for a notebook
    opened where the pipeline has not run. Writes the training result to ``train_path``; returns the evaluation."""
    data = TranslationDataParams(**resolve("translation_data", params))
    prepare(data, data_dir)
    binarize(data, data_dir)
    result = train_result(TranslationTrainParams(**resolve("translation_train", params)), data_dir)
    runs.write_json(train_path, result)
    return evaluate(TranslationEvaluateParams(**resolve("translation_evaluate", params)), data_dir, Path(result["dir"]))


def history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per epoch: training and validation loss (the last record of each, as a resumed run may log an
    epoch twice)."""
    rows: dict[int, dict[str, Any]] = {}
    for r in records:
        if r["kind"] in ("train", "valid"):
            rows.setdefault(int(r["epoch"]), {"epoch": int(r["epoch"])}).update(
                {k: v for k, v in r.items() if k.startswith(("train_", "valid_")) and isinstance(v, float)}
            )
    return [rows[e] for e in sorted(rows)]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("step", choices=("prepare", "binarize", "train", "evaluate"))
    ap.add_argument("--params", type=Path, required=True, help="a stage's resolved parameters (python -m lowmem.pipeline params)")
    ap.add_argument("--data-dir", type=Path, default=DATA)
    ap.add_argument("--metrics", type=Path, help="write the step's summary here as JSON")
    ap.add_argument("--train-result", type=Path, help="evaluate: the train step's --metrics, naming the run to score")


def run(args: argparse.Namespace) -> int:
    stage = {"prepare": "translation_data", "binarize": "translation_data", "train": "translation_train", "evaluate": "translation_evaluate"}[args.step]
    try:
        p = load(stage, args.params)
        if args.step == "evaluate":
            if args.train_result is None or not args.train_result.exists():
                raise FileNotFoundError(f"evaluate needs --train-result, the train step's output ({args.train_result}); "
                                        "run dvc repro translation_train first")
            result: Any = evaluate(p, args.data_dir, Path(json.loads(args.train_result.read_text())["dir"]))
        else:
            result = {"prepare": prepare, "binarize": binarize, "train": train_result}[args.step](p, args.data_dir)
    except (ParamError, corpus.CorpusMissing, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.metrics:
        runs.write_json(args.metrics, result)
    return 0
