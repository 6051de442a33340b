"""The DVC pipeline end to end at the smoke profile, in a throwaway copy of the repository."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lowmem import frontier

ROOT = Path(__file__).parents[1]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working tree as git sees it (tracked and untracked-not-ignored files), in a fresh git repo."""
    dst = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True)
    for rel in files.stdout.splitlines():
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    run(["git", "init", "-q"], dst)
    params = yaml.safe_load((dst / "params.yaml").read_text())
    params["base"]["profile"] = "smoke"
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return dst


def params_block(repo: Path) -> dict:
    return yaml.safe_load((repo / "params.yaml").read_text())["translation_techniques"]


@pytest.mark.slow
def test_dvc_repro_runs_the_pipeline_then_nothing(repo: Path) -> None:
    first = run(["dvc", "repro"], repo)
    assert first.returncode == 0, first.stdout + first.stderr
    metrics = json.loads((repo / "metrics/memory_profile.json").read_text())
    assert metrics["profile"] == "smoke"
    assert metrics["parameters"] == 1_467_610
    assert abs(metrics["measured"]["max_abs_gap_pct"]) < 5
    for f in ("01_memory_breakdown.png", "01_memory_breakdown.csv", "01_memory_breakdown.md", "01_accounted_vs_measured.md"):
        assert (repo / "figures" / f).stat().st_size > 0
    assert "profile `smoke`" in (repo / "figures/01_memory_breakdown.md").read_text()
    translation = json.loads((repo / "metrics/translation.json").read_text())
    bleu = json.loads((repo / "metrics/translation_bleu.json").read_text())
    assert translation["profile"] == "smoke" and translation["bleu_tokenized"] == bleu["bleu_tokenized"]
    assert translation["max_abs_gap_pct"] < 3
    assert translation["corpus"].startswith("synthetic")
    assert "profile `smoke`" in (repo / "figures/07_translation_bleu.md").read_text()
    for f in ("07_translation_memory.png", "07_translation_curves.png", "07_translation_curves.csv"):
        assert (repo / "figures" / f).stat().st_size > 0
    assert not list(repo.glob("data/translation/checkpoints/checkpoint[0-9]*.pt"))  # no epoch checkpoints
    techniques = json.loads((repo / "metrics/translation_techniques.json").read_text())
    assert techniques["profile"] == "smoke"
    assert set(techniques["memory_mib"]) == set(params_block(repo)["techniques"])  # every technique accounted
    assert techniques["memory_mib"]["baseline"]["total"] == translation["at_peak_mib"]["total"]  # the same full-size step
    assert set(techniques["bleu"]) == set(params_block(repo)["trained"]["smoke"])
    for f in ("08_translation_techniques_memory.png", "08_translation_techniques_bleu_time.png", "08_translation_techniques.md"):
        assert (repo / "figures" / f).stat().st_size > 0
    assert "profile `smoke`" in (repo / "figures/08_translation_techniques.md").read_text()
    combined = json.loads((repo / "metrics/combinations.json").read_text())
    assert combined["profile"] == {"wrn": "smoke", "dynamicconv": "smoke"}
    for task in ("wrn", "dynamicconv"):
        block = yaml.safe_load((repo / "params.yaml").read_text())[f"combinations_{task}"]
        runs = [json.loads(f.read_text()) for f in sorted((repo / "metrics/combinations").glob(f"{task}-*.json"))]
        assert [r["slot"] for r in runs] == list(range(block["slots"])) and {r["profile"] for r in runs} == {"smoke"}
        assert combined[task]["trained"] >= block["slots"]
        assert set(combined[task]["best_within"]) == {f"{b:g}" for b in block["budgets"]}
    for f in ("09_frontier.png", "09_wrn_budgets.md", "09_paper_comparison.md", "00_headline.md"):
        assert (repo / "figures" / f).stat().st_size > 0
    headline = (repo / "figures/00_headline.md").read_text()
    assert "profile" in headline and "smoke" in headline
    assert frontier.readme_block(repo / "README.md") == headline.strip()  # the report rewrote the README's table
    shown = run(["dvc", "metrics", "show"], repo)
    assert "at_peak_mib.activations" in shown.stdout
    second = run(["dvc", "repro"], repo)
    assert second.returncode == 0
    assert "Running stage" not in second.stdout


@pytest.mark.slow
def test_a_bad_profile_stops_the_stage_before_any_work(repo: Path) -> None:
    figures = {p.name: p.read_bytes() for p in (repo / "figures").glob("*")}
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["base"]["profile"] = "huge"
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    r = run(["dvc", "repro"], repo)
    assert r.returncode != 0
    assert "base.profile='huge' is not allowed; use one of: smoke, cpu, paper" in r.stdout + r.stderr
    # DVC removes a stage's outputs before running it; none may come back half-written.
    for p in (repo / "figures").glob("*"):
        assert p.name in figures and p.read_bytes() == figures[p.name]
