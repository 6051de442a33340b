"""German→English parallel text for the translation track: from a raw corpus to fairseq's binarized data, by one
code path that does what fairseq's ``examples/translation/prepare-iwslt14.sh`` does:

1. Moses tokenization (``sacremoses``, escaping on, as ``tokenizer.perl``) and lowercasing;
2. cleaning of the training pairs by length, as ``clean-corpus-n.perl -ratio 1.5 ... 1 175``;
3. validation = every 23rd cleaned training pair, training = the rest;
4. a joint BPE learned on the training text of both sides (``subword-nmt``, 10,000 merges in the recipe);
5. ``fairseq-preprocess`` (in :func:`binarize`).

Three corpora feed it:

- ``iwslt14``: the IWSLT'14 De-En archive ``de-en.tgz`` (train.tags + the TED/TEDX XML dev and test sets). Its
  original address no longer serves it; :data:`IWSLT14_HELP` says where to get it.
- ``gettext``: a real corpus that exists offline on a Debian machine: the German translations of installed
  software messages (``/usr/share/locale/de/LC_MESSAGES/*.mo``), read with Python's ``gettext``. Only the catalogs
  of a fixed list of Debian packages are read, so the corpus is the same on every machine of one Debian release.
- ``synthetic``: a small learnable corpus written as an IWSLT'14 archive and read through the same path.
"""

from __future__ import annotations

import gettext
import hashlib
import io
import json
import random
import re
import shutil
import subprocess
import tarfile
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from sacremoses import MosesTokenizer
from subword_nmt.apply_bpe import BPE
from subword_nmt.learn_bpe import learn_bpe

from lowmem.dynamicconv import commands

CORPORA = ("iwslt14", "gettext", "synthetic")
LANGS = ("de", "en")
Pair = tuple[str, str]  # (German, English)

IWSLT14_HELP = (
    "The IWSLT'14 De-En archive (de-en.tgz) is not on this machine. Its original addresses no longer serve it "
    "(https://wit3.fbk.eu/archive/2014-01/texts/de/en/de-en.tgz, then fairseq's mirror "
    "http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz). Get the WIT3 2014-01 release "
    "(https://wit3.fbk.eu/2014-01; its texts/de/en/de-en.tgz is the file) or a copy of de-en.tgz from a colleague, "
    "then set translation_data.iwslt14_archive in params.yaml to its path or an http(s) address."
)
IWSLT14_TESTS = ("IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010", "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012")


class CorpusMissing(RuntimeError):
    """The corpus is not on disk; the message says how to get it."""


# --- IWSLT'14 -----------------------------------------------------------------------------------------------------


def _train_tags(lines: Iterable[str]) -> list[str]:
    # prepare-iwslt14.sh: grep -v '<url>' / '<talkid>' / '<keywords>', then strip title and description tags.
    # Other tag lines (<speaker>, <reviewer>, ...) stay in, as they do in the standard preparation.
    out = []
    for line in lines:
        if "<url>" in line or "<talkid>" in line or "<keywords>" in line:
            continue
        out.append(re.sub(r"</?(title|description)>", "", line).rstrip("\n"))
    return out


def _segments(xml: str) -> list[str]:
    # prepare-iwslt14.sh: grep '<seg id', strip the tags, and turn the typographic apostrophe into a plain one.
    return [
        re.sub(r"\s*</seg>\s*", "", re.sub(r'<seg id="[0-9]*">\s*', "", line)).replace("\u2019", "'")
        for line in xml.splitlines()
        if "<seg id" in line
    ]


def fetch_archive(source: str, cache_dir: Path) -> Path:
    """A local path to the IWSLT'14 archive: ``source`` itself, or its download into ``cache_dir``."""
    if re.match(r"https?://", source):
        dest = cache_dir / "de-en.tgz"
        if not dest.exists():
            cache_dir.mkdir(parents=True, exist_ok=True)
            try:
                urllib.request.urlretrieve(source, dest.with_suffix(".part"))
            except OSError as e:
                raise CorpusMissing(f"could not download {source}: {e}. {IWSLT14_HELP}") from None
            dest.with_suffix(".part").rename(dest)
        return dest
    path = Path(source)
    if not path.is_file():
        raise CorpusMissing(f"{source} does not exist. {IWSLT14_HELP}")
    return path


def read_iwslt14(archive: Path) -> dict[str, list[Pair]]:
    """{"train": ..., "test": ...} raw pairs from ``de-en.tgz``; the test set is the five TED/TEDX sets, in the
    order prepare-iwslt14.sh concatenates them."""
    with tarfile.open(archive) as tar:
        members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}

        def text(name: str) -> str:
            if name not in members:
                raise CorpusMissing(f"{archive} has no {name}; is it the IWSLT'14 de-en.tgz? {IWSLT14_HELP}")
            f = tar.extractfile(members[name])
            assert f is not None
            return f.read().decode("utf-8")

        sides = {l: _train_tags(text(f"train.tags.de-en.{l}").splitlines()) for l in LANGS}
        tests = {l: [s for t in IWSLT14_TESTS for s in _segments(text(f"{t}.de-en.{l}.xml"))] for l in LANGS}
    for name, split in (("train.tags", sides), ("test sets", tests)):
        if len(split["de"]) != len(split["en"]):
            raise ValueError(f"{archive}: {name} have {len(split['de'])} German and {len(split['en'])} English lines")
    return {"train": list(zip(sides["de"], sides["en"])), "test": list(zip(tests["de"], tests["en"]))}


def write_iwslt14_archive(path: Path, train: list[Pair], test: list[Pair]) -> Path:
    """Writes ``train`` and ``test`` as an IWSLT'14 ``de-en.tgz`` (talk headers in train.tags, the test pairs spread
    over the five XML sets), for the smoke profile and the tests."""
    files: dict[str, str] = {}
    for i, l in enumerate(LANGS):
        lines = []
        for k, pair in enumerate(train):
            if k % 50 == 0:  # a talk header, as in the real files; its title line carries the pair
                lines += [f"<url>http://www.ted.com/talks/talk{k}.html</url>", f"<keywords>talks, k{k}</keywords>",
                          f"<talkid>{k}</talkid>", f"<title>{pair[i]}</title>"]
            else:
                lines.append(pair[i])
        files[f"train.tags.de-en.{l}"] = "\n".join(lines) + "\n"
        chunks = [test[j :: len(IWSLT14_TESTS)] for j in range(len(IWSLT14_TESTS))]
        for name, chunk in zip(IWSLT14_TESTS, chunks):
            segs = "\n".join(f'<seg id="{n + 1}"> {p[i]} </seg>' for n, p in enumerate(chunk))
            files[f"{name}.de-en.{l}.xml"] = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<mteval>\n<srcset setid="{name}" srclang="{l}">\n'
                f'<doc docid="1" genre="lectures">\n<talkid>1</talkid>\n{segs}\n</doc>\n</srcset>\n</mteval>\n'
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            data = content.encode("utf-8")
            info = tarfile.TarInfo(f"de-en/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


# --- gettext catalogs ---------------------------------------------------------------------------------------------


def catalogs(packages: list[str], locale: str = "de") -> list[Path]:
    """The ``.mo`` files of ``locale`` that ``packages`` install (from ``dpkg -L``), sorted."""
    missing, found = [], []
    for pkg in packages:
        r = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True)
        if r.returncode != 0:
            missing.append(pkg)
            continue
        found += [Path(f) for f in r.stdout.split() if f.startswith(f"/usr/share/locale/{locale}/LC_MESSAGES/") and f.endswith(".mo")]
    if missing:
        raise CorpusMissing(
            f"Debian packages {missing} are not installed, so the gettext corpus would differ from everyone else's. "
            f"Run `make setup` as root (it installs them), or `apt-get install {' '.join(missing)}`."
        )
    return sorted(set(f for f in found if f.is_file()))


def read_catalog(path: Path) -> list[Pair]:
    """(German, English) pairs of one catalog: each translated message, multi-line messages split into lines
    where both sides have as many; untranslated (identical) messages dropped."""
    with open(path, "rb") as f:
        catalog = gettext.GNUTranslations(f)._catalog  # the parsed msgid → msgstr map; gettext has no public view
    pairs = []
    for key, de in catalog.items():
        if isinstance(key, tuple):  # plural forms: keep the singular
            if key[1] != 0:
                continue
            key = key[0]
        en = key.split("\x04")[-1]  # drop a msgctxt prefix
        if not en or not de:
            continue
        en_lines, de_lines = en.strip().split("\n"), de.strip().split("\n")
        if len(en_lines) != len(de_lines):
            continue
        pairs += [(d.strip(), e.strip()) for d, e in zip(de_lines, en_lines) if d.strip() and e.strip() and d.strip() != e.strip()]
    return pairs


def read_gettext(packages: list[str], test_size: int, seed: int) -> tuple[dict[str, list[Pair]], dict]:
    """{"train", "test"} pairs from the packages' German catalogs, and their provenance. One pair per English
    message (the first in catalog order), so no English sentence is in both training and test."""
    pairs: dict[str, str] = {}
    used, skipped = [], []
    for path in catalogs(packages):
        try:
            cat = read_catalog(path)
        except UnicodeDecodeError:  # a catalog whose header is not UTF-8; Python's gettext cannot read it
            skipped.append(path.name)
            continue
        used.append(path.name)
        for de, en in cat:
            pairs.setdefault(en, de)
    items = sorted((de, en) for en, de in pairs.items())
    random.Random(seed).shuffle(items)
    if len(items) <= 2 * test_size:
        raise ValueError(f"the gettext corpus has only {len(items)} pairs, too few for a test set of {test_size}")
    versions = subprocess.run(["dpkg-query", "-W", "-f", "${Package}=${Version}\\n", *packages], capture_output=True, text=True).stdout.split()
    info = {"catalogs": used, "skipped_catalogs": skipped, "packages": versions}
    return {"train": items[test_size:], "test": items[:test_size]}, info


# --- synthetic ----------------------------------------------------------------------------------------------------

# A toy lexicon: German word order differs from English in the verb's place, so the model has to learn more than
# a word-for-word copy. Only the smoke profile and the tests use it.
_NOUNS = [("der hund", "the dog"), ("die katze", "the cat"), ("das kind", "the child"), ("der mann", "the man"),
          ("die frau", "the woman"), ("das haus", "the house"), ("der ball", "the ball"), ("das buch", "the book")]
_VERBS = [("sieht", "sees"), ("hat", "has"), ("mag", "likes"), ("findet", "finds"), ("sucht", "seeks")]
_ADVS = [("heute", "today"), ("oft", "often"), ("morgen", "tomorrow"), ("nie", "never")]


def synthetic_pairs(n: int, seed: int) -> list[Pair]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        (sd, se), (vd, ve), (od, oe), (ad, ae) = rng.choice(_NOUNS), rng.choice(_VERBS), rng.choice(_NOUNS), rng.choice(_ADVS)
        out.append((f"{ad.capitalize()} {vd} {sd} {od}.", f"{se.capitalize()} {ae} {ve} {oe}."))
    return out


# --- preparation --------------------------------------------------------------------------------------------------


def _clean(pairs: list[tuple[str, str]], max_len: int, ratio: float) -> list[tuple[str, str]]:
    # clean-corpus-n.perl: 1..max_len tokens on each side, and neither side more than `ratio` times the other.
    out = []
    for de, en in pairs:
        nd, ne = len(de.split()), len(en.split())
        if 1 <= nd <= max_len and 1 <= ne <= max_len and nd / ne <= ratio and ne / nd <= ratio:
            out.append((" ".join(de.split()), " ".join(en.split())))
    return out


def _write(path: Path, lines: Iterable[str]) -> None:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


def sha256_of(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def prepare(raw: dict[str, list[Pair]], out_dir: Path, merges: int, max_len: int = 175, ratio: float = 1.5, valid_every: int = 23) -> dict:
    """Writes ``out_dir/{train,valid,test}.{de,en}`` (tokenized, lowercased, BPE'd), ``out_dir/code`` (the joint
    BPE codes) and ``out_dir/raw/{train,test}.{de,en}`` (the corpus as read; its test side is sacreBLEU's
    reference). Returns the counts and the raw corpus's hash."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = {l: MosesTokenizer(lang=l) for l in LANGS}

    def tokenize(pairs: list[Pair]) -> list[tuple[str, str]]:
        return [tuple(tok[l].tokenize(s, escape=True, return_str=True).lower() for l, s in zip(LANGS, p)) for p in pairs]  # type: ignore[misc]

    train = _clean(tokenize(raw["train"]), max_len, ratio)
    # The test set is not cleaned (as in the recipe), but a pair with an empty side cannot be scored.
    test_raw = [p for p in raw["test"] if p[0].strip() and p[1].strip()]
    splits = {
        "train": [p for i, p in enumerate(train, 1) if i % valid_every != 0],
        "valid": [p for i, p in enumerate(train, 1) if i % valid_every == 0],
        "test": tokenize(test_raw),
    }
    (out_dir / "raw").mkdir(exist_ok=True)
    for i, l in enumerate(LANGS):
        _write(out_dir / "raw" / f"train.{l}", (p[i] for p in raw["train"]))
        _write(out_dir / "raw" / f"test.{l}", (p[i] for p in test_raw))
    codes = out_dir / "code"
    joint = io.StringIO("".join(f"{p[i]}\n" for i in range(2) for p in splits["train"]))
    with open(codes, "w", encoding="utf-8") as f:
        learn_bpe(joint, f, merges)
    with open(codes, encoding="utf-8") as f:
        bpe = BPE(f)
    for name, pairs in splits.items():
        for i, l in enumerate(LANGS):
            _write(out_dir / f"{name}.{l}", (bpe.process_line(p[i]) for p in pairs))
    counts = {f"{k}_pairs": len(v) for k, v in splits.items()}
    # How much of the test set the model may have seen verbatim (after tokenization and lowercasing): message
    # catalogs repeat short strings, so a reader of the BLEU needs this.
    for i, l in enumerate(LANGS):
        seen = {p[i] for p in splits["train"]}
        counts[f"test_{l}_seen_in_train"] = sum(p[i] in seen for p in splits["test"])
    counts["raw_train_pairs"] = len(raw["train"])
    raw_files = [out_dir / "raw" / f"{n}.{l}" for n in ("train", "test") for l in LANGS]
    counts["raw_sha256"] = sha256_of(raw_files)
    counts["raw_bytes"] = sum(f.stat().st_size for f in raw_files)
    counts["bpe_merges_learned"] = sum(1 for line in codes.read_text(encoding="utf-8").splitlines() if not line.startswith("#"))
    return counts


def binarize(bpe_dir: Path, bin_dir: Path, workers: int = 1) -> dict:
    """fairseq's own ``fairseq-preprocess`` on the BPE'd splits; returns the dictionary sizes fairseq reports."""
    args = ["--source-lang", "de", "--target-lang", "en",
           "--trainpref", str(bpe_dir / "train"), "--validpref", str(bpe_dir / "valid"), "--testpref", str(bpe_dir / "test"),
           "--destdir", str(bin_dir), "--workers", str(workers)]
    # fairseq-preprocess refuses a destination that holds dictionaries, and an old one may come from another corpus
    # (a notebook's smoke run beside another's): the splits are rebuilt from bpe_dir, as DVC does for its output.
    if bin_dir.exists():
        shutil.rmtree(bin_dir)
    r = commands.captured("preprocess", args)
    if r.returncode != 0:
        raise RuntimeError(f"fairseq-preprocess failed ({r.returncode}):\n{r.stderr[-3000:]}")
    (bin_dir / "preprocess.log").write_text(" ".join(r.args) + "\n" + r.stdout + r.stderr)
    # fairseq's dictionaries list the corpus types; bos, pad, eos and unk come on top.
    return {f"dict_{l}_types": 4 + len((bin_dir / f"dict.{l}.txt").read_text(encoding="utf-8").splitlines()) for l in LANGS}


def manifest(path: Path, **info: object) -> None:
    path.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
