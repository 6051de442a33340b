"""The run store: keys made only of what changes a run, code digests blind to docstrings and formatting, resuming
after a real kill."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lowmem import runs
from lowmem.dynamicconv import translation
from lowmem.dynamicconv.params import TranslationTrainParams
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.train import TRAIN_CODE, Techniques, run_fields, store_run

ROOT = Path(__file__).parents[1]


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of lowmem/ that the digests read, so a test can edit its code."""
    dst = tmp_path / "lowmem"
    shutil.copytree(ROOT / "lowmem", dst, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(runs, "PACKAGE", dst)
    return dst


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def _plugin_key(tmp_path: Path, scale_args: list[str]) -> str:
    data = tmp_path / "translation"
    (data / "bin").mkdir(parents=True, exist_ok=True)
    (data / "bin" / "dict.de.txt").write_text("a 1\n")
    p = TranslationTrainParams(recipe_args=["--arch", "lightconv_iwslt_de_en"], scale_args=scale_args, device="cpu")
    return translation.store_run(p, data).key


def test_docstrings_comments_and_formatting_do_not_change_a_digest_but_code_does(package: Path, tmp_path: Path) -> None:
    wrn = runs.code_digest(TRAIN_CODE)
    plugin = ["--user-dir", "/somewhere/lowmem_fairseq", "--sparsity", "0.9"]
    fairseq = (_plugin_key(tmp_path, plugin), _plugin_key(tmp_path, []))
    _edit(package / "wrn" / "train.py", '"""Training WRN on an image dataset', '"""Training a WRN (edited docstring) on an image dataset')
    _edit(package / "wrn" / "train.py", "def evaluate(\n", "# a new comment\n\n\ndef evaluate(\n")
    _edit(package / "wrn" / "train.py", "    model.eval()\n", "    model.eval()   # reformatted\n")
    _edit(package / "dynamicconv" / "corpus.py", '"""German→English parallel text', '"""German→English parallel text (edited)')
    _edit(package / "techniques" / "sparse_linear.py", "    def forward(self, x", "    # a comment in the plugin's path\n    def forward(self, x")
    assert runs.code_digest(TRAIN_CODE) == wrn
    assert (_plugin_key(tmp_path, plugin), _plugin_key(tmp_path, [])) == fairseq
    _edit(package / "wrn" / "train.py", "loss_sum / len(hits), hits", "loss_sum / max(len(hits), 1), hits")
    assert runs.code_digest(TRAIN_CODE) != wrn


def test_moving_a_definition_to_another_module_of_the_path_keeps_the_digest(package: Path) -> None:
    """What a refactoring does: ``evaluate`` moves from train.py to a new module that train.py imports, with the
    imports it needs. The training path holds the same definitions, so no run retrains."""
    wrn = runs.code_digest(TRAIN_CODE)
    text = (package / "wrn" / "train.py").read_text()
    start = text.index("@torch.no_grad()\ndef evaluate(")
    end = text.index("\n\n\n", start) + 3
    (package / "wrn" / "evaluation.py").write_text("import torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
                                           "from torch.utils.data import DataLoader\n\nfrom lowmem import precision\n\n\n"
                                           + text[start:end])
    (package / "wrn" / "train.py").write_text(text[:start] + text[end:] + "\nfrom lowmem.wrn.evaluation import evaluate  # moved\n")
    moved = runs.closure("lowmem.wrn.train")
    assert "lowmem.wrn.evaluation" in moved and "lowmem.wrn.evaluation" not in TRAIN_CODE
    assert runs.code_digest([m for m in moved if m not in ("lowmem.config", "lowmem.wrn.params")]) == wrn
    # A definition the path no longer holds is a change.
    assert runs.code_digest([m for m in moved if m not in ("lowmem.config", "lowmem.wrn.params", "lowmem.wrn.evaluation")]) != wrn


def test_moving_a_module_to_another_subpackage_keeps_every_key(package: Path, tmp_path: Path) -> None:
    """A pure move: the recipe goes from the WRN track to the techniques, every import of it and every string that
    names it rewritten (as a move does), and the path's digest is the same."""
    wrn = runs.code_digest(TRAIN_CODE)
    (package / "wrn" / "recipe.py").rename(package / "techniques" / "recipe.py")
    for f in package.rglob("*.py"):
        text = f.read_text()
        if "lowmem.wrn.recipe" in text:
            f.write_text(text.replace("lowmem.wrn.recipe", "lowmem.techniques.recipe"))
    moved = runs.closure("lowmem.wrn.train")
    assert "lowmem.techniques.recipe" in moved and "lowmem.wrn.recipe" not in moved
    assert runs.code_digest([m for m in moved if m not in ("lowmem.config", "lowmem.wrn.params")]) == wrn


def test_a_change_to_the_plugins_forward_changes_only_the_runs_through_the_plugin(package: Path, tmp_path: Path) -> None:
    plugin = ["--user-dir", "/somewhere/lowmem_fairseq", "--sparsity", "0.9"]
    before = (_plugin_key(tmp_path, plugin), _plugin_key(tmp_path, []), runs.code_digest(TRAIN_CODE))
    _edit(package / "techniques" / "sparse_linear.py", "return y if self.bias is None else y + self.bias", "return y + self.bias if self.bias is not None else y")
    after = (_plugin_key(tmp_path, plugin), _plugin_key(tmp_path, []), runs.code_digest(TRAIN_CODE))
    assert after[0] != before[0]  # the plugin's runs are trained again
    assert after[1:] == before[1:]  # plain fairseq runs and every WRN run keep their keys


def test_the_plugins_path_and_the_device_are_not_part_of_a_fairseq_run(tmp_path: Path) -> None:
    here = _plugin_key(tmp_path, ["--user-dir", "/a/lowmem_fairseq", "--sparsity", "0.9"])
    assert _plugin_key(tmp_path, ["--user-dir", "/b/c/lowmem_fairseq", "--sparsity", "0.9"]) == here
    assert _plugin_key(tmp_path, ["--user-dir", "/a/lowmem_fairseq", "--sparsity", "0.8"]) != here


def test_a_wrn_key_leaves_out_what_does_not_change_the_run() -> None:
    p = BaselineParams(dataset="synthetic", model="wrn-10-1", batch_size=32)
    key = store_run(p, 0).key
    same = [
        BaselineParams(dataset="synthetic", model="wrn-10-1", batch_size=32, profile="cpu", seeds=[0, 1, 2], data_root="/x",
                       device="cpu", num_workers=3, seed=7),
    ]
    assert {store_run(q, 0).key for q in same} == {key}
    assert store_run(p, 0, Techniques(sparse_format="csr16", checkpoint="sqrt", microbatch=32, dsr_periods=(1, 2))).key == key
    assert store_run(p, 1).key != key
    assert store_run(BaselineParams(dataset="synthetic", model="wrn-10-1", batch_size=32, lr=0.05), 0).key != key
    assert store_run(p, 0, Techniques(microbatch=16)).key != key
    static = Techniques(sparsity=0.9, sparse_method="static")
    assert store_run(p, 0, static).key == store_run(p, 0, Techniques(sparsity=0.9, sparse_method="static", dsr_periods=(5,))).key
    assert store_run(p, 0, static).key != store_run(p, 0, Techniques(sparsity=0.9)).key
    assert set(run_fields(p, 0, Techniques())) == {
        "dataset", "augment", "model", "epochs", "batch_size", "lr", "momentum", "nesterov", "weight_decay", "milestones",
        "gamma", "train_subset", "test_subset", "seed", "techniques"}


def test_the_training_path_holds_the_trainer_and_techniques_but_no_study_or_other_track() -> None:
    assert {"lowmem.wrn.train", "lowmem.techniques.sparsity", "lowmem.techniques.precision", "lowmem.techniques.microbatch", "lowmem.techniques.checkpoint",
            "lowmem.wrn.models", "lowmem.wrn.data", "lowmem.wrn.recipe"} <= set(TRAIN_CODE)
    assert not {m for m in TRAIN_CODE if m.endswith("_study") or "translation" in m or m in ("lowmem.dynamicconv.corpus", "lowmem.config")}


def test_a_run_killed_mid_training_resumes_to_the_uninterrupted_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL (no handler can run) while the train stage's entry point is between epochs, then the same command.
    The uninterrupted run is the same entry point called here: a third process would only add its imports."""
    from lowmem.pipeline import commands

    block = {"profile": "smoke", "seed": 0, "seeds": [0], "dataset": "synthetic", "model": "wrn-10-1", "epochs": 4,
             "batch_size": 32, "train_subset": 256, "test_subset": 64, "device": "cpu"}
    resolved = BaselineParams(**block).__dict__
    params = tmp_path / "baseline.yaml"
    params.write_text(yaml.safe_dump(resolved))
    env = {**os.environ, "LOWMEM_RUNS": str(tmp_path / "cut")}
    cmd = [sys.executable, "-m", "lowmem.pipeline", "train", "baseline", "--params", str(params), "--data-root", str(tmp_path / "raw")]
    proc = subprocess.Popen([*cmd, "--out", str(tmp_path / "cut.json")], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    store = tmp_path / "cut"
    deadline = time.time() + 300
    while time.time() < deadline and not list(store.glob("*/checkpoint.pt")):
        time.sleep(0.05)
    assert list(store.glob("*/checkpoint.pt")), "no checkpoint appeared"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not list(store.glob("*/result.json"))  # killed before the run finished
    done = subprocess.run([*cmd, "--out", str(tmp_path / "cut.json")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    events = [e["event"] for e in runs.ledger(store)]
    assert events[0].startswith("resumed at epoch ") and events[-1] == "trained"
    monkeypatch.setenv("LOWMEM_RUNS", str(tmp_path / "whole"))
    monkeypatch.chdir(ROOT)
    assert commands.main(["train", *cmd[4:], "--out", str(tmp_path / "whole.json")]) == 0
    assert [e["event"] for e in runs.ledger(tmp_path / "whole")] == ["trained"]
    timing = ("images_per_s", "step_s", "epoch_s", "peak_mem_mib")
    strip = lambda f: [{k: v for k, v in row.items() if k not in timing}
                       for r in json.loads(f.read_text())["runs"] for row in r["history"]]
    assert strip(tmp_path / "cut.json") == strip(tmp_path / "whole.json")
    assert len(strip(tmp_path / "whole.json")) == 4


def test_the_run_index_fails_on_a_run_trained_twice_by_this_pipeline_only(tmp_path: Path) -> None:
    """A left-out stage's committed metrics say what it trained in the store where it ran (in a fresh clone,
    another machine's): a default stage that trains the same key in this store is listed beside it, not refused.
    Two stages of this checkout's pipeline training one key would be a second training in one store."""
    from lowmem.pipeline import run_index

    results, metrics = tmp_path / "results", tmp_path / "metrics"
    (metrics / "combinations").mkdir(parents=True)
    results.mkdir()
    runs.write_json(results / "baseline_train.json", {"runs": [{"key": "k1", "trained": True}]})
    runs.write_json(results / "precision_train.json", {"runs": [{"key": "k1", "trained": False}, {"key": "k2", "trained": True}]})
    runs.write_json(metrics / "combinations" / "wrn-0.json", {"role": "single", "runs": [{"key": "k1", "trained": True}]})
    out = {r["key"]: r for r in run_index.index(results, metrics)["runs"]}
    assert out["k1"]["stages"] == ["baseline_train", "precision_train", "combination_wrn@0"]
    assert out["k1"]["trained_by"] == ["baseline_train", "combination_wrn@0"] and out["k2"]["trained_by"] == ["precision_train"]
    runs.write_json(metrics / "combinations" / "wrn-1.json", {"role": "single", "runs": [{"key": "k2", "trained": True}]})
    runs.write_json(metrics / "combinations" / "wrn-2.json", {"role": "single", "runs": [{"key": "k2", "trained": True}]})
    with pytest.raises(RuntimeError, match=r"\{'k2': \['combination_wrn@1', 'combination_wrn@2'\]\}"):
        run_index.index(results, metrics)  # two left-out stages, written from one store
    (metrics / "combinations" / "wrn-2.json").unlink()
    runs.write_json(results / "sparsity_train.json", {"runs": [{"key": "k1", "trained": True}]})
    with pytest.raises(RuntimeError, match=r"more than one stage .*\{'k1': \['baseline_train', 'sparsity_train'\]\}"):
        run_index.index(results, metrics)
