"""The run store: every training run of both tracks, kept once under ``data/runs/<key>/``.

A run's key is made only of what changes the run: the fields that change training (model, data identity, recipe,
techniques, seed, steps), and a digest of the code on that run's training path. The digest hashes the normalized
AST of each top-level definition on the path, with docstrings and ``lowmem`` imports removed, as a set: comments,
docstrings and formatting never retrain anything, nor does moving a function or class from one module of the path
to another (what a refactoring does), and a module off the path (another study, the accountant's storage formats)
never does either. What a run leaves out of
its key (output paths, the profile's name, device, worker counts, the other seeds of a list, accounting-only fields)
is the caller's to drop; ``lowmem.wrn.train.run_fields`` and ``lowmem.dynamicconv.translation.run_fields`` do.

A stage that needs a run asks for its key: a finished run (``result.json`` present) is read, never retrained; an
interrupted one resumes from its last checkpoint. ``ledger.jsonl`` in the store logs each run's trained/reused
events, which is how the pipeline shows that no key is trained twice.

No library provides a content-addressed store keyed by normalized code (DVC keys stages, not runs inside them, and
hashes files byte for byte), hence this module.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).parent
# The store lives in the checkout's data/ (ignored by git; a fresh clone starts empty and retrains). LOWMEM_RUNS
# points it elsewhere, e.g. a test's scratch directory.
DEFAULT_STORE = PACKAGE.parent / "data" / "runs"


def store() -> Path:
    return Path(os.environ.get("LOWMEM_RUNS", DEFAULT_STORE))


def _module_file(name: str) -> Path:
    rel = name.removeprefix("lowmem").lstrip(".").replace(".", "/")
    path = PACKAGE / rel
    if path.is_dir():
        return path / "__init__.py"
    return path.with_suffix(".py") if rel else PACKAGE / "__init__.py"


def imports_of(module: str) -> set[str]:
    """The ``lowmem`` modules that ``module`` imports (at any depth of its code, lazy imports included)."""
    tree = ast.parse(_module_file(module).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "lowmem"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lowmem" and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if _module_file(sub).exists() else node.module)
    return {m for m in found if m != "lowmem" and _module_file(m).exists()}


def closure(*modules: str) -> list[str]:
    """``modules`` and every ``lowmem`` module they import, transitively, sorted."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(imports_of(m) - seen)
    return sorted(seen)


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def _is_internal_import(node: ast.AST) -> bool:
    """An import of ``lowmem`` code (or ``__future__``): what it brings in is on the path already, and where it
    comes from is the module layout, not the run."""
    if isinstance(node, ast.Import):
        return all(a.name.split(".")[0] == "lowmem" for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").split(".")[0] in ("lowmem", "__future__")
    return False


class _DropInternalImports(ast.NodeTransformer):
    def generic_visit(self, node: ast.AST) -> ast.AST:
        for name, value in ast.iter_fields(node):
            if isinstance(value, list) and any(_is_internal_import(v) for v in value):
                setattr(node, name, [v for v in value if not _is_internal_import(v)])
        return super().generic_visit(node)


# A dotted lowmem module path written in a string (a message naming a module, a closure's root): where code lives,
# not what it computes.
_MODULE_PATH = re.compile(r"\blowmem(\.[A-Za-z_]\w*)+")


class _NormalizeModulePaths(ast.NodeTransformer):
    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, str):
            node.value = _MODULE_PATH.sub("lowmem.<module>", node.value)
        return node


# A lever's card (lowmem.techniques.registry): its names, prose and where its evidence is. It computes nothing, so
# renaming a lever in its card, or adding a card, retrains nothing; the functions and tables it names are code.
CARDS = ("LEVER", "LEVERS")


def _is_card(node: ast.AST) -> bool:
    return isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id in CARDS for t in node.targets)


def definitions(module: str) -> list[str]:
    """The module's top-level statements as normalized ASTs, one string each: docstrings, lever cards and ``lowmem``
    imports removed (lazy ones too), and lowmem module paths in strings blanked, so comments, formatting and the
    module a definition lives in are gone."""
    tree = ast.parse(_module_file(module).read_text())
    tree = _NormalizeModulePaths().visit(_DropInternalImports().visit(_strip_docstrings(tree)))
    out = []
    for node in tree.body:
        if _is_card(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):  # one entry per imported name: `from x import a, b` = a; b
            prefix = f"from {node.module} " if isinstance(node, ast.ImportFrom) else ""
            out += [f"{prefix}import {a.name} as {a.asname or a.name}" for a in node.names]
        else:
            out.append(ast.dump(node, annotate_fields=False, include_attributes=False))
    return out


def code_digest(modules: Iterable[str]) -> str:
    """One digest of the code of ``modules`` (a run's training path): its top-level definitions as a sorted
    multiset and its external imports as a set, so that the same definitions spread over other modules give the
    same digest."""
    every = [d for m in set(modules) for d in definitions(m)]
    # External imports count once: a module that a definition moves into imports torch again, say.
    imports = {d for d in every if d.startswith(("import ", "from "))}
    h = hashlib.sha256()
    for d in sorted(imports) + sorted(d for d in every if d not in imports):
        h.update(d.encode() + b"\0")
    return h.hexdigest()[:16]


def make_key(fields: dict[str, Any], code: Iterable[str]) -> str:
    """The run's key: its fields (JSON, sorted) and the digest of its code path."""
    blob = json.dumps({"fields": fields, "code": code_digest(code)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def atomic_write(path: Path, write: Callable[[str], Any]) -> Path:
    """``write(tmp)`` then rename into ``path``: a killed process leaves the old file or none, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def write_json(path: Path, obj: Any) -> Path:
    return atomic_write(path, lambda p: Path(p).write_text(json.dumps(obj, indent=2, default=str) + "\n"))


def save_torch(path: Path, state: dict[str, Any]) -> Path:
    import torch  # only the trainers' checkpoints need it

    return atomic_write(path, lambda p: torch.save(state, p))


class Run:
    """One run of the store: its key, folder, fields and code path; ``result`` once it has finished."""

    def __init__(self, track: str, fields: dict[str, Any], code: Iterable[str], root: Path | None = None) -> None:
        self.track, self.fields, self.code = track, fields, sorted(set(code))
        self.key = make_key({"track": track, **fields}, self.code)
        self.dir = (root or store()) / self.key

    @property
    def result_path(self) -> Path:
        return self.dir / "result.json"

    def result(self) -> Any | None:
        return json.loads(self.result_path.read_text())["result"] if self.result_path.exists() else None

    def start(self) -> None:
        """Creates the folder and its ``key.json`` (what the key is made of, for a reader)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / "key.json").exists():
            write_json(self.dir / "key.json", {"key": self.key, "track": self.track, "fields": self.fields,
                                               "code": self.code, "code_digest": code_digest(self.code)})

    def finish(self, result: Any, seconds: float) -> None:
        write_json(self.result_path, {"key": self.key, "train_seconds": round(seconds, 1), "result": result})
        self.log("trained")

    def log(self, event: str) -> None:
        line = json.dumps({"key": self.key, "event": event, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.dir.parent / "ledger.jsonl", "a") as f:
            f.write(line + "\n")


def ledger(root: Path | None = None) -> list[dict[str, Any]]:
    path = (root or store()) / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
