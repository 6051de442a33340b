"""The DVC pipeline at the smoke profile, in one throwaway copy of the repository shared by every test here.

The copy runs the WRN training stages (TRAINING below) and the run index, through the test session's run store
(tests/conftest.py): the WRN notebooks, which nbval runs once each afterwards, take their runs from there. The
translation track's notebooks run on another xdist worker, with a store of their own, so its training stage is not
run here: notebook 07 runs the same prepare, binarize and train code (lowmem.dynamicconv.translation), and
tests/test_translation.py its command line.
The notebook stages are the same papermill command at other parameters; their publishing step is tested in
test_outputs.py, and the keys of the plugin's runs in test_runs.py. The tests run in file order and each builds
on the copy the one before left.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lowmem import runs
from lowmem.pipeline import stage_times

ROOT = Path(__file__).parents[1]
TRAINING = ["baseline_train", "sparsity_train"]
pytestmark = pytest.mark.slow


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)


def trained_events() -> list[str]:
    return [e["key"] for e in runs.ledger() if e["event"] == "trained"]


@pytest.fixture(scope="session")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working tree as git sees it, at the smoke profile, after `dvc repro TRAINING` and the run index,
    committed in a fresh git repo."""
    dst = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True)
    for rel in files.stdout.splitlines():
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    params = yaml.safe_load((dst / "params.yaml").read_text())
    params["base"]["profile"] = "smoke"
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    before = len(trained_events())
    first = run(["dvc", "repro", *TRAINING], dst)
    assert first.returncode == 0, first.stdout[-5000:] + first.stderr[-5000:]
    index = run([sys.executable, "-m", "lowmem.pipeline", "runs"], dst)
    assert index.returncode == 0, index.stderr
    (dst / "trained_here.json").write_text(json.dumps(trained_events()[before:]))
    for cmd in (["git", "add", "-A"], ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "smoke"]):
        subprocess.run(cmd, cwd=dst, check=True, capture_output=True)
    return dst


def test_every_distinct_run_is_trained_once_and_shared_between_stages(repo: Path) -> None:
    index = json.loads((repo / "metrics/runs.json").read_text())
    assert len({r["key"] for r in index["runs"]}) == len(index["runs"]) == index["distinct_runs"]
    # The stages left out of `make repro` did not run in the copy: their committed (cpu) results list their own runs.
    left_out = set(stage_times.left_out(repo / "dvc.yaml"))
    here = [r for r in index["runs"] if not {s.split("@")[0] for s in r["stages"]} <= left_out]
    trained = json.loads((repo / "trained_here.json").read_text())
    assert sorted(trained) == sorted(set(trained)) == sorted(r["key"] for r in here)  # each key trained once, by one stage
    for r in here:
        assert len(r["trained_by"]) == 1 and r["trained_by"][0] in r["stages"]
    # The fp32 reference run of seed 0 serves the baseline and every WRN study that trains; it is trained once.
    wrn = {"baseline_train", "sparsity_train"}
    shared = [r for r in here if wrn <= set(r["stages"])]
    assert len(shared) == 1 and len(shared[0]["trained_by"]) == 1  # by whichever of them DVC ran first
    assert sum(len(r["stages"]) for r in here) == len(here) + len(wrn) - 1


def test_a_second_repro_runs_nothing(repo: Path) -> None:
    again = run(["dvc", "repro", *TRAINING], repo)
    assert again.returncode == 0 and "Running stage" not in again.stdout, again.stdout


def test_a_bad_value_through_dvc_exp_run_touches_no_result(repo: Path) -> None:
    """One of a profile mapping, through `dvc exp run -S`; a bad plain value stops the same check
    (test_config.py, without DVC: each DVC run of the copy costs tens of seconds)."""
    r = run(["dvc", "exp", "run", "-S", "sparsity.train_levels.smoke=[0.5]"], repo)
    assert r.returncode != 0
    assert "Nothing was run and no result was touched" in r.stderr + r.stdout, r.stderr[-3000:]
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, check=True).stdout
    changed = [line for line in status.splitlines() if not line.endswith("params.yaml")]
    assert not changed, changed
    subprocess.run(["git", "checkout", "--", "params.yaml"], cwd=repo, check=True)


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_a_docstring_edit_retrains_nothing_and_one_changed_parameter_only_the_runs_it_touches(repo: Path) -> None:
    """One `dvc repro` of one stage for both (each DVC run of the copy costs tens of seconds; `dvc exp run -S` is the
    test above's): a docstring edited in the WRN trainer, and one new static sparsity level. The stage's runs include
    the fp32 run it shares with baseline_train. (The plugin's runs ignore docstrings too: test_runs.py.)"""
    before = trained_events()
    _edit(repo / "lowmem/wrn/train.py", '"""Training WRN on an image dataset', '"""Training a WRN on an image dataset')
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["sparsity"]["static_levels"]["smoke"] = [0.5, 0.9]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    r = run(["dvc", "repro", "sparsity_train"], repo)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # DVC reran the stage, as a file it imports changed, and it took every other run from the store.
    assert "Running stage 'sparsity_train'" in r.stdout
    assert "sparsity: 4 runs, 1 trained, 3 taken from the store" in r.stdout  # static 0.5 at the one smoke seed
    status = run(["dvc", "status", "baseline_train"], repo)  # the other trainer of WRN runs is changed too
    assert "changed deps" in status.stdout and "lowmem/wrn/train.py" in status.stdout, status.stdout
    assert len(trained_events()) == len(before) + 1
    subprocess.run(["git", "checkout", "--", "."], cwd=repo, check=True)
