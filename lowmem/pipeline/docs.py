"""The README's and docs/'s numbers, kept true to the files that hold them.

Two ways a result number may stand in ``README.md`` or ``docs/*.md``:

- **inside an embed block** that the pipeline writes: the lines between ``<!-- lowmem:embed PATH -->`` and
  ``<!-- lowmem:embed:end -->`` are PATH's text. ``make repro`` rewrites every block after the pipeline
  (``refresh``); ``python -m lowmem.pipeline docs refresh`` does it alone;
- **in prose, traced**: a comment ``<!-- numbers: PATH [PATH ...] -->`` names the committed files that the numbers
  after it (up to the next such comment) come from. Each number written there must be a value of one of those files
  (a CSV or Markdown cell, a JSON or YAML leaf, or any number in the file's text), equal at the precision written.

Everything else that looks like a number (dates, versions, input sizes, line limits) must be on the allow-list
``docs/numbers-allowed/``: ``all.yaml`` for every page, ``PAGE.yaml`` (``README.yaml``, ``sharding.yaml``) for
one, each number with its reason. Inline code, fenced code, link targets, HTML comments and the
headline block are not prose. Numbers glued to a name (WRN-28-2, fp32, 8-bit, 28x28) are names, not numbers.

This is hand-written: no documentation tool traces a prose number to a data file.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

EMBED = re.compile(r"(<!-- lowmem:embed (\S+) -->\n)(.*?)(<!-- lowmem:embed:end -->)", re.DOTALL)
SOURCES = re.compile(r"<!-- numbers: ([^>]*?) -->")
NUMBER = re.compile(r"[-+−]?\d(?:\d|,(?=\d{3}))*(?:\.\d+)?")
UNITS = ("GiB", "MiB", "KiB", "GB", "MB", "kB", "min", "ms", "x", "%", "s", "h")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
# Not prose: fenced code, HTML comments other than the sources markers, the headline block, embed blocks, inline
# code, link targets and bare URLs.
HIDDEN = re.compile(r"```.*?```|<!-- lowmem:headline:begin.*?<!-- lowmem:headline:end -->"
                    r"|<!-- lowmem:embed \S+ -->.*?<!-- lowmem:embed:end -->|`[^`\n]*`|\]\([^)]*\)|https?://\S+",
                    re.DOTALL)
ALLOWED = Path("docs/numbers-allowed")


def pages(root: Path) -> list[Path]:
    """The files whose numbers are kept: the README and every page of docs/."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.exists()]


def refresh(page: Path, root: Path) -> bool:
    """Rewrites the page's embed blocks from their files; True if the page changed."""
    text = page.read_text()

    def body(m: re.Match[str]) -> str:
        src = root / m.group(2)
        if not src.exists():
            raise FileNotFoundError(f"{page}: embed block names {m.group(2)}, which does not exist")
        return f"{m.group(1)}{src.read_text().strip()}\n{m.group(4)}"

    new = EMBED.sub(body, text)
    if new != text:
        page.write_text(new)
    return new != text


def stale_embeds(page: Path, root: Path) -> list[str]:
    """The embed blocks whose text is not their file's, by path."""
    return [m.group(2) for m in EMBED.finditer(page.read_text())
            if not (root / m.group(2)).exists() or m.group(3).strip() != (root / m.group(2)).read_text().strip()]


@dataclass(frozen=True)
class Number:
    text: str  # as written, without its unit
    value: float
    decimals: int
    line: int


def _numbers(prose: str, offset_line: int) -> list[Number]:
    out = []
    prose = DATE.sub(lambda m: " " * len(m.group()), prose)
    for m in NUMBER.finditer(prose):
        s, e = m.span()
        tok = m.group()
        before = prose[s - 1] if s else " "
        if tok[0] in "+-−" and s and (prose[s - 1].isalnum() or prose[s - 1] in "_"):
            continue  # WRN-28: a hyphen inside a name
        if before.isalnum() or before in "_/.'’\\-#":
            continue
        rest = prose[e:]
        unit = next((u for u in UNITS if rest.startswith(u) and not (rest[len(u):len(u) + 1].isalnum())), "")
        after = rest[len(unit):len(unit) + 2]
        if after[:1].isalnum() or after[:1] in "_/" or (after[:1] in ".-" and after[1:2].isalnum()):
            continue  # fp32, 8-bit, 28x28, 2.14.1, 1B: part of a name or a version
        clean = tok.replace(",", "").replace("−", "-").lstrip("+")
        decimals = len(clean.split(".")[1]) if "." in clean else 0
        out.append(Number(tok, float(clean), decimals, offset_line + prose.count("\n", 0, s)))
    return out


def _values(path: Path) -> list[float]:
    """Every number a source file holds."""
    text = path.read_text()
    vals: list[float] = []
    if path.suffix == ".json":
        def walk(x: object) -> None:
            if isinstance(x, bool):
                return
            if isinstance(x, (int, float)):
                vals.append(float(x))
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)
            elif isinstance(x, str):
                vals.extend(float(t.replace(",", "")) for t in NUMBER.findall(x))
        walk(json.loads(text))
    if path.suffix == ".csv":  # by cell, so that a comma between two numbers is not read as a thousands separator
        text = "\n".join(" ".join(row) for row in csv.reader(io.StringIO(text)))
    vals.extend(float(t.replace(",", "").replace("−", "-")) for t in NUMBER.findall(text))
    return [v for v in vals if math.isfinite(v)]


def _matches(n: Number, values: list[float]) -> bool:
    tol = 0.5 * 10 ** -n.decimals + 1e-9
    return any(abs(abs(v) - abs(n.value)) <= tol or abs(abs(v) * 100 - abs(n.value)) <= tol for v in values)


def allowed(root: Path, page: Path) -> dict[str, str]:
    """The page's allow-list: number as written (without sign or unit) -> why it is not a result."""
    out: dict[str, str] = {}
    for f in (root / ALLOWED / "all.yaml", root / ALLOWED / f"{page.stem}.yaml"):
        if f.exists():
            for k, why in (yaml.safe_load(f.read_text()) or {}).items():
                if not isinstance(why, str) or not why.strip():
                    raise ValueError(f"{f}: {k} has no reason; write why it is not a result")
                out[str(k)] = why
    return out


def untraced(page: Path, root: Path) -> list[str]:
    """Each prose number of the page that is neither a value of the sources in force nor on the allow-list."""
    text = page.read_text()
    rel = page.relative_to(root).as_posix()
    ok = allowed(root, page)
    problems: list[str] = []
    cache: dict[str, list[float]] = {}
    # Split at the sources markers; each part's numbers are traced to the marker before it (none before the first).
    parts = SOURCES.split(text)
    pos_line = 1
    sources: list[str] = []
    for i, part in enumerate(parts):
        if i % 2 == 1:
            sources = part.split()
            for s in sources:
                if not (root / s).exists():
                    problems.append(f"{rel}:{pos_line}: source {s} does not exist")
            continue
        prose = HIDDEN.sub(lambda m: "\n" * m.group().count("\n") + " ", part)
        prose = re.sub(r"<!--.*?-->", " ", prose, flags=re.DOTALL)
        for n in _numbers(prose, pos_line):
            key = n.text.lstrip("+-−")
            if key in ok or key.replace(",", "") in ok:
                continue
            vals = [v for s in sources if (root / s).exists() for v in cache.setdefault(s, _values(root / s))]
            if not _matches(n, vals):
                where = ", ".join(sources) if sources else "no source named (<!-- numbers: PATH -->) and not allowed"
                problems.append(f"{rel}:{n.line}: {n.text} is not in {where}")
        pos_line += part.count("\n")
    return problems


def check(root: Path) -> list[str]:
    problems = []
    for page in pages(root):
        problems += [f"{page.relative_to(root)}: embed block of {p} is stale (python -m lowmem.pipeline docs refresh)"
                     for p in stale_embeds(page, root)]
        problems += untraced(page, root)
    return problems


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("action", choices=["refresh", "check"], help="refresh: rewrite embed blocks; check: list untraced numbers")
    ap.add_argument("--root", type=Path, default=Path("."))


def run(args: argparse.Namespace) -> int:
    if args.action == "refresh":
        changed = [p for p in pages(args.root) if refresh(p, args.root)]
        print(f"embed blocks refreshed in {len(changed)} page(s)" + (f": {', '.join(map(str, changed))}" if changed else ""))
        return 0
    problems = check(args.root)
    print("\n".join(problems) or "every number in README.md and docs/ is embedded, traced or allowed")
    return 1 if problems else 0
