"""The package's layout is its architecture: dependencies point one way, pipeline → studies → cli (the product a
user runs: ``lowmem profile``, ``plan``, model specs) → tracks (wrn, dynamicconv) → techniques → memory, and the two
tracks never import each other. No module is over ``MAX_LINES``: a longer one holds more than one role. ``config`` (the stage-parameter
resolver) and ``runs`` (the run store) serve every layer and import no other lowmem module."""

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "lowmem"
LAYER = {"memory": 0, "techniques": 1, "wrn": 2, "dynamicconv": 2, "cli": 3, "studies": 4, "pipeline": 5, "fairseq_user_dir": 5}
COMMON = ("config", "runs", "cpu")
MAX_LINES = 400


def _part(module: str) -> str:
    return module.split(".")[1]


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(ROOT).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return out


def _imports(path: Path) -> set[str]:
    """Every lowmem module or package the file imports, lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lowmem.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lowmem"):
            for a in node.names:
                found.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; lowmem uses absolute imports")
    return found


MODULES = _modules()


def test_every_module_lives_in_a_layer_or_is_common() -> None:
    for m in MODULES:
        if m == "lowmem":
            continue
        assert _part(m) in LAYER or _part(m) in COMMON, f"{m} is in no layer: put it under one of {sorted(LAYER)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "lowmem"))
def test_imports_point_down_the_layers(module: str) -> None:
    here = _part(module)
    for target in sorted(_imports(MODULES[module])):
        if target == "lowmem":
            raise AssertionError(f"{module}: `from lowmem import X` hides the layer; import from lowmem.<layer>")
        there = _part(target)
        if here in COMMON:
            assert there in COMMON and there != here, f"{module} (common) imports {target}: common modules import no layer"
            continue
        if there in COMMON or there == here:
            continue
        assert LAYER[there] < LAYER[here], f"{module} imports {target}: {here} may import only layers below it"


def test_the_rule_would_catch_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from lowmem.studies.frontier import pareto\n")
    assert "lowmem.studies.frontier" in _imports(bad)


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module -> the modules it imports), or None."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_no_module_imports_itself_in_a_circle() -> None:
    """Imports inside functions count: they hide a circle from Python, not from a reader."""
    graph = {m: {t for t in _imports(f) if t in MODULES and t != m} for m, f in MODULES.items()}
    circle = _circle(graph)
    assert circle is None, f"import circle: {' -> '.join(circle)}; move what both need below them"


def test_the_circle_rule_would_catch_a_lazy_circle(tmp_path: Path) -> None:
    a = tmp_path / "a.py"
    a.write_text("from lowmem.cli import plan\n")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    from lowmem.cli import profile\n")
    circle = _circle({"lowmem.cli.profile": _imports(a), "lowmem.cli.plan": _imports(b)})
    assert circle is not None and set(circle) == {"lowmem.cli.plan", "lowmem.cli.profile"}


def test_no_module_is_over_the_line_limit() -> None:
    long = {m: n for m, f in MODULES.items() if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split by role (search, training, tables, captions): {long}"


def test_the_fairseq_user_dir_is_alone_in_its_parent() -> None:
    """fairseq puts the parent of --user-dir on sys.path: nothing else may be importable from there."""
    parent = PACKAGE / "fairseq_user_dir"
    assert sorted(p.name for p in parent.iterdir() if p.name != "__pycache__") == ["lowmem_fairseq"]
