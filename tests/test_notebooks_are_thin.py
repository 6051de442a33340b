"""The notebooks are thin: imports, a papermill `parameters` cell whose smoke defaults come from the resolver
(params.yaml at the smoke profile, through ``lowmem.config.load``), calls into ``lowmem.studies``, no function of
their own, at most 40 code lines."""

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from lowmem import config
from lowmem.studies import planner_params as _planner_params  # noqa: F401
from lowmem.dynamicconv import params as _dynamicconv_params  # noqa: F401  (registers the stages)
from lowmem.studies import params as _study_params  # noqa: F401

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def _code(nb: Path) -> list[dict]:
    return [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_defines_nothing_and_stays_short(nb: Path) -> None:
    cells = _code(nb)
    lines = sum(len(_source(c).splitlines()) for c in cells)
    assert lines <= 40, f"{nb.name}: {lines} code lines; move the logic into lowmem.studies"
    for c in cells:
        for node in ast.walk(ast.parse(_source(c))):
            assert not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)), nb.name


def _stage_of(nb: Path) -> str | None:
    """The stage block dvc.yaml hands the notebook as `params`, if any."""
    for stage in STAGES.values():
        m = re.search(rf"papermill notebooks/{nb.name} .*?-p params \.\./data/params/(\w+)\.yaml", stage["cmd"], re.S)
        if m:
            return m.group(1)
    return None


@pytest.mark.parametrize("nb", [nb for nb in NOTEBOOKS if _stage_of(nb)], ids=lambda p: p.stem)
def test_a_stage_notebooks_defaults_are_the_smoke_profile_of_params_yaml(nb: Path) -> None:
    stage = _stage_of(nb)
    cells = _code(nb)
    params_cell = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
    assert len(params_cell) == 1, f"{nb.name}: one papermill parameters cell"
    assigned = {t.id for node in ast.parse(_source(params_cell[0])).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    fields = {f.name for f in dataclasses.fields(config.STAGES[stage])}
    assert "params" in assigned and not assigned & fields, f"{nb.name} copies stage fields {sorted(assigned & fields)}"
    assert re.search(r"^params = None\b", _source(params_cell[0]), re.M), nb.name
    assert any(f'config.load("{stage}", params' in _source(c) for c in cells), f"{nb.name} must load stage {stage}"
