"""Each dvc.yaml stage's code deps, from what its command really runs: ``python -m lowmem.pipeline deps
write`` rewrites them, ``check`` (and tests/test_dvc_deps.py) fails where dvc.yaml disagrees.

What a stage runs is found from its command, in every way code gets in:
- ``python -m lowmem.pipeline COMMAND``: the command's module (``lowmem.pipeline.commands``), and ``python -m
  lowmem.X``: the module;
- ``papermill notebooks/N.ipynb``: the ``lowmem`` imports of the notebook's code cells;
- fairseq's ``--user-dir``: the plugin package, when ``lowmem.dynamicconv.plugin`` is imported (its folder and the
  plugin's module are both deps);
- the lever registry (``lowmem.techniques.registry``), which imports every module of its package;
- a worker started as ``-m lowmem.X`` by a module (torchrun's workers, ``lowmem.studies.shard_run``): a string
  constant that names a ``lowmem`` module counts as an import;
- data files that a module reads next to its code (``paper_reference.yaml``).
Then every ``lowmem`` module those import, at any depth and lazily too (``lowmem.runs.imports_of``), and each
package ``__init__.py`` above them, which Python runs first. The deps are files, so that a change to
``lowmem/cli/plan.py`` reruns only the stages that import it.

DVC hashes the deps it is given but cannot find them; no tool derives them from Python's imports, hence this module.
Stages' other deps (data, params files, notebooks) are written by hand and kept as they are.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import sys
from pathlib import Path
from typing import Any

from lowmem import runs
from lowmem.pipeline.commands import COMMANDS

ROOT = runs.PACKAGE.parent
PLUGIN = "lowmem.dynamicconv.plugin"
REGISTRY = "lowmem.techniques.registry"
USER_DIR = "lowmem/fairseq_user_dir"
# Files read next to a module's code (not imported): a module that reads one makes it a dep.
DATA_FILES = {"lowmem.studies.frontier": ["lowmem/studies/paper_reference.yaml"],
              "lowmem.studies.gpu_memory": ["lowmem/studies/paper_reference.yaml"]}
MODULE_NAME = re.compile(r"^lowmem(\.\w+)+$")


def notebook_imports(path: Path) -> set[str]:
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


def entry_points(cmd: str, root: Path = ROOT) -> set[str]:
    """The ``lowmem`` modules a stage's command runs: ``python -m lowmem.pipeline COMMAND`` (the entry point and that
    command's module alone), ``python -m lowmem.X``, and the notebooks papermill executes."""
    mods: set[str] = set()
    for module, command in re.findall(r"python -m (lowmem[\w.]*)(?: ([\w-]+))?", cmd):
        if module == "lowmem.pipeline":
            if command not in COMMANDS:
                raise ValueError(f"{cmd!r} runs no command of python -m lowmem.pipeline (lowmem.pipeline.commands)")
            mods |= {"lowmem.pipeline.__main__", f"lowmem.{COMMANDS[command][0]}"}
        else:
            mods.add(module)
    for nb in re.findall(r"papermill (notebooks/\S+\.ipynb)", cmd):
        mods |= notebook_imports(root / nb)
    return mods


@functools.lru_cache(maxsize=None)
def started_modules(module: str) -> frozenset[str]:
    """Modules that ``module`` starts in other processes (``-m lowmem.X``): string constants naming a module."""
    tree = ast.parse(runs._module_file(module).read_text())
    return frozenset(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                     and MODULE_NAME.match(n.value) and n.value != module and runs._module_file(n.value).exists())


def closure(modules: set[str]) -> set[str]:
    """``modules``, what they import (``runs.closure``) and what they start, transitively."""
    return set(_closure(frozenset(modules)))


@functools.lru_cache(maxsize=None)  # the stages of a matrix, and notebooks alike, share their entry points
def _closure(modules: frozenset[str]) -> frozenset[str]:
    seen: set[str] = set()
    todo = list(modules)
    while todo:  # runs.closure's walk, over imports parsed once per module for all the stages
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend((_imports(m) | started_modules(m) | registered(m)) - seen)
    return frozenset(seen)


def registered(module: str) -> frozenset[str]:
    """The lever registry imports every module of its package to read their cards (``lowmem.techniques.registry``)."""
    if module != REGISTRY:
        return frozenset()
    package = runs._module_file(module).parent
    return frozenset(f"lowmem.techniques.{f.stem}" for f in package.glob("*.py") if f.stem != "__init__")


_imports = functools.lru_cache(maxsize=None)(runs.imports_of)


def _file(module: str) -> str:
    return runs._module_file(module).relative_to(ROOT).as_posix()


def code_deps(cmd: str, root: Path = ROOT) -> list[str]:
    """The files of ``lowmem`` code a command runs, sorted: modules, the package ``__init__``s above them, the
    fairseq plugin's folder where fairseq loads it, and the data files the modules read."""
    mods = closure(entry_points(cmd, root))
    files: set[str] = set()
    for m in mods:
        files.add(_file(m))
        parts = m.split(".")
        files |= {_file(".".join(parts[:i])) for i in range(1, len(parts))}  # lowmem/__init__.py, lowmem/X/__init__.py
        files |= set(DATA_FILES.get(m, []))
    if PLUGIN in mods:
        files.add(USER_DIR)
    return sorted(files)


def is_code_dep(dep: str) -> bool:
    return dep.startswith("lowmem/")


def expected(stages: dict[str, Any], root: Path = ROOT) -> dict[str, list[str]]:
    """Every stage's deps as they should be: its other deps in their order, then its code deps."""
    return {name: [d for d in s.get("deps", []) if not is_code_dep(d)] + code_deps(s["cmd"], root)
            for name, s in stages.items()}


def write(dvc_yaml: Path, root: Path = ROOT) -> list[str]:
    """Rewrites the stages' code deps in ``dvc_yaml`` line by line (a YAML library would reflow the commands and
    drop comments); returns the names of the stages whose deps changed."""
    import yaml

    text = dvc_yaml.read_text()
    want = expected(yaml.safe_load(text)["stages"], root)
    lines, out, changed = text.splitlines(), [], []
    stage, i = None, 0
    while i < len(lines):
        line = lines[i]
        if m := re.match(r"^  (\w+):\s*(#.*)?$", line):
            stage = m.group(1)
        out.append(line)
        i += 1
        if line.strip() == "deps:" and stage in want:
            block = []
            while i < len(lines) and lines[i].startswith("    - "):
                block.append(lines[i])
                i += 1
            kept = [b for b in block if not is_code_dep(b[len("    - "):])]
            new = kept + [f"    - {d}" for d in want[stage] if is_code_dep(d)]
            if new != block:
                changed.append(stage)
            out.extend(new)
    dvc_yaml.write_text("\n".join(out) + "\n")
    return changed


def mismatches(dvc_yaml: Path, root: Path = ROOT) -> list[str]:
    import yaml

    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    out = []
    for name, deps in expected(stages, root).items():
        listed = stages[name].get("deps", [])
        if listed != deps:
            missing, extra = sorted(set(deps) - set(listed)), sorted(set(listed) - set(deps))
            out.append(f"stage {name}: missing {missing}, not run {extra}" if missing or extra else f"stage {name}: deps out of order")
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("step", choices=("write", "check"))
    ap.add_argument("--dvc-yaml", type=Path, default=ROOT / "dvc.yaml")


def run(args: argparse.Namespace) -> int:
    if args.step == "write":
        changed = write(args.dvc_yaml)
        print(f"{args.dvc_yaml}: deps rewritten for {len(changed)} stage(s){': ' + ', '.join(changed) if changed else ''}")
        return 0
    bad = mismatches(args.dvc_yaml)
    for line in bad:
        print(line, file=sys.stderr)
    if bad:
        print("error: dvc.yaml's code deps are not what the stages run: python -m lowmem.pipeline deps write",
              file=sys.stderr)
    return 1 if bad else 0
