"""Two entry points: ``lowmem`` for users, ``python -m lowmem.pipeline COMMAND`` for dvc.yaml and make. A stage's
code deps are its own command's, never every command's."""

import ast
import re
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lowmem.pipeline import commands, stage_deps

ROOT = Path(__file__).parents[1]
# Their own parsers, with why: the user's command; the GPU check runs on a lent GPU with stock PyTorch alone; torchrun
# starts the sharding run's workers by module name.
OWN_PARSER = {"lowmem.cli.main", "lowmem.pipeline.commands", "lowmem.studies.gpu_check", "lowmem.studies.shard_run"}


def test_only_the_entry_points_build_an_argument_parser() -> None:
    found = set()
    for f in (ROOT / "lowmem").rglob("*.py"):
        tree = ast.parse(f.read_text())
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "ArgumentParser"
               for n in ast.walk(tree)):
            found.add(".".join(f.relative_to(ROOT).with_suffix("").parts))
    assert found == OWN_PARSER


@pytest.mark.parametrize("command", sorted(commands.COMMANDS))
def test_every_command_declares_its_options_and_runs(command: str) -> None:
    mod = importlib.import_module(f"lowmem.{commands.COMMANDS[command][0]}")
    assert callable(mod.add_arguments) and callable(mod.run)
    # A study function of the same name would be shadowed by the command's (or shadow it): each defined once.
    tree = ast.parse(Path(mod.__file__).read_text())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert defined.count("run") == defined.count("add_arguments") == 1
    assert list(inspect.signature(mod.run).parameters) == [next(iter(inspect.signature(mod.run).parameters))]


def test_every_stage_runs_a_known_command() -> None:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        for module, command in re.findall(r"python -m (lowmem[\w.]*)(?: ([\w-]+))?", stage["cmd"]):
            assert module == "lowmem.pipeline" and command in commands.COMMANDS, f"stage {name}: {stage['cmd']}"


def test_a_stage_depends_on_its_command_alone() -> None:
    deps = stage_deps.code_deps("python -m lowmem.pipeline lever-effects --root . --out m.json")
    assert "lowmem/studies/lever_effects.py" in deps and "lowmem/pipeline/__main__.py" in deps
    others = {f"lowmem/{m.replace('.', '/')}.py" for c, (m, _) in commands.COMMANDS.items() if c != "lever-effects"}
    assert not others & set(deps)


def test_help_lists_every_command_and_an_unknown_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert commands.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {c} " in out for c in commands.COMMANDS)
    assert commands.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_the_package_runs_as_a_process() -> None:
    done = subprocess.run([sys.executable, "-m", "lowmem.pipeline", "deps", "check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
