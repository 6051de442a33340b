"""dvc.yaml: each stage lists exactly the lowmem subpackages it imports, and every stage runs after the parameter check."""

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from lowmem import runs

ROOT = Path(__file__).parents[1]
STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def _notebook_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lowmem":
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    found.add(sub if runs._module_file(sub).exists() else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "lowmem"}
    return found


def _entry_points(stage: dict) -> set[str]:
    """The lowmem modules a stage's command runs: ``python -m lowmem.X`` and the notebooks papermill executes."""
    cmd = stage["cmd"]
    mods = set(re.findall(r"python -m (lowmem[\w.]*)", cmd))
    for nb in re.findall(r"papermill (notebooks/\S+\.ipynb)", cmd):
        mods |= _notebook_imports(ROOT / nb)
    return mods


def _dep_of(module: str) -> str:
    """A module's dep entry: its subpackage's folder, or the file of a top-level module (config, runs)."""
    parts = module.split(".")
    return f"lowmem/{parts[1]}" if len(parts) > 2 else f"lowmem/{parts[1]}.py"


@pytest.mark.parametrize("name", sorted(STAGES))
def test_a_stage_lists_exactly_the_lowmem_subpackages_it_imports(name: str) -> None:
    stage = STAGES[name]
    closure = runs.closure(*_entry_points(stage))
    assert closure, f"stage {name} runs no lowmem code?"
    needed = {_dep_of(m) for m in closure}
    if "lowmem.dynamicconv.plugin" in closure:  # fairseq loads the plugin from its --user-dir folder
        needed.add("lowmem/fairseq_user_dir")
    listed = {d for d in stage["deps"] if d.startswith("lowmem/")}
    assert listed == needed, f"stage {name}: missing {sorted(needed - listed)}, not imported {sorted(listed - needed)}"


def test_bytecode_caches_are_not_deps() -> None:
    ignored = (ROOT / ".dvcignore").read_text().splitlines()
    assert "__pycache__/" in ignored and "*.pyc" in ignored


def test_the_closure_follows_lazy_imports_too() -> None:
    # combinations imports translation_study inside a function (fairseq only where DynamicConv runs).
    assert "lowmem.studies.translation" in runs.closure("lowmem.studies.combinations")
    assert "lowmem.dynamicconv.plugin" in runs.closure("lowmem.studies.translation")


def _upstream(name: str, seen: set[str]) -> set[str]:
    produced = {}
    for n, s in STAGES.items():
        for o in s.get("outs", []) + s.get("metrics", []) + s.get("plots", []):
            produced[o if isinstance(o, str) else next(iter(o))] = n
    for d in STAGES[name].get("deps", []):
        d = d.replace("${item.slot}", "0")
        if d in produced and produced[d] not in seen:
            seen.add(produced[d])
            _upstream(produced[d], seen)
    return seen


@pytest.mark.parametrize("name", sorted(set(STAGES) - {"params"}))
def test_every_stage_runs_after_the_parameter_check(name: str) -> None:
    assert "params" in _upstream(name, set())


def test_every_stage_keeps_an_output_a_fresh_clone_lacks() -> None:
    """So that `make repro` on a fresh clone reruns it: an output in the DVC cache (or a metrics file it writes
    only from a run result in data/results)."""
    for name, stage in STAGES.items():
        if name in ("params", "runs") or stage.get("frozen"):
            continue  # cheap checks and indexes rerun whenever what they read changes; frozen stages never run
        cached = [o for o in stage.get("outs", []) if isinstance(o, str)]
        assert cached, f"stage {name} has no DVC-cached output; a fresh clone would skip it"


def test_no_committed_result_is_deleted_before_its_stage_succeeds() -> None:
    for name, stage in STAGES.items():
        for o in stage.get("outs", []) + stage.get("metrics", []) + stage.get("plots", []):
            if isinstance(o, dict):
                (path, opts), = o.items()
                if opts.get("cache") is False:
                    assert opts.get("persist") is True, f"{name}: {path} is committed but DVC would delete it before the stage runs"


def test_stages_left_out_of_make_repro_keep_every_output_in_git_and_are_named_in_the_readme() -> None:
    """A frozen stage never runs under `make repro`, so a fresh clone must already hold all it makes; the README
    page on the pipeline names each one and the command that runs it."""
    frozen = sorted(n for n, s in STAGES.items() if s.get("frozen"))
    assert frozen == ["bleu_noise_train", "combination_dynamicconv", "combination_search_wrn", "combination_wrn", "combinations_search_wrn",
                      "combinations_sweep_dynamicconv", "combinations_sweep_wrn", "levers_state_train", "levers_train",
                      "proxy_noise_train", "translation_activations_train", "translation_kahan_train", "translation_levers_train",
                      "translation_microbatch_train", "translation_techniques_train"]
    section = (ROOT / "docs" / "pipeline.md").read_text()
    assert "make repro-all" in section
    for name in frozen:
        assert f"`{name}`" in section, name
        for o in STAGES[name].get("outs", []) + STAGES[name].get("metrics", []) + STAGES[name].get("plots", []):
            assert isinstance(o, dict) and next(iter(o.values())).get("cache") is False, f"{name}: {o} would be missing from a fresh clone"
