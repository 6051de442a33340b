"""The README and docs/: short, linked, and every result number in them true to the committed file it comes from
(``lowmem.pipeline.docs``)."""

import re
from pathlib import Path

import pytest

from lowmem.pipeline import docs
from lowmem.studies import frontier_tables

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
STUDY_PAGES = ["memory-profile", "baseline", "sparsity", "precision", "microbatching", "checkpointing", "translation",
               "combinations", "noise", "levers", "rounding", "planner", "sharding", "gpu-check", "pipeline"]


def test_every_number_in_the_readme_and_docs_is_embedded_traced_or_allowed() -> None:
    problems = docs.check(ROOT)
    assert not problems, "\n".join(problems)


def test_the_readme_is_short_and_opens_with_the_question_the_commands_and_the_headline() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    first = "\n".join(lines[:40])
    assert "make repro" in first and "make test" in first and "Sohoni" in first
    assert frontier_tables.README_BEGIN in first and frontier_tables.README_END in first


def test_every_study_has_a_page_linked_from_the_readme_and_no_page_is_long() -> None:
    readme = README.read_text()
    for stem in STUDY_PAGES:
        page = ROOT / "docs" / f"{stem}.md"
        assert page.exists(), page
        assert f"(docs/{stem}.md)" in readme, f"the README does not link docs/{stem}.md"
        assert len(page.read_text().splitlines()) <= 170, f"{page} is long; split it or cut it"


@pytest.mark.parametrize("page", docs.pages(ROOT), ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page.name}: link to {target}, which does not exist"


@pytest.mark.parametrize("page", [p for p in docs.pages(ROOT)], ids=lambda p: p.name)
def test_no_page_holds_history(page: Path) -> None:
    """Timing history ("on commit X it took Y") belongs in the session notes, not in what a user reads."""
    text = re.sub(r"```.*?```|<!--.*?-->", "", page.read_text(), flags=re.DOTALL)
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert not hashes, f"{page.name}: commit hashes {hashes}"
    took = re.findall(r"\b(?:took|ran in)\s+(?:about\s+)?\d[\d.]*\s*(?:min|minutes|s|seconds|h|hours)\b", text)
    assert not took, f"{page.name}: timing history {took}"


# --- the checker itself --------------------------------------------------------------------------------------------

def _page(tmp_path: Path, text: str, sources: dict[str, str] | None = None, allowed: str = "") -> Path:
    (tmp_path / "docs" / "numbers-allowed").mkdir(parents=True)
    (tmp_path / "docs" / "numbers-allowed" / "page.yaml").write_text(allowed)
    for name, content in (sources or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    page = tmp_path / "docs" / "page.md"
    page.write_text(text)
    return page


SHARDING = ("model,mode,devices,reduction\ndynamicconv,ddp,2,1.80\ndynamicconv,ddp,8,5.4512\n"
            "dynamicconv,fsdp,2,1.9081\ndynamicconv,fsdp,8,6.5471\n")


def test_a_stale_number_is_caught_against_its_source(tmp_path: Path) -> None:
    """The README's old sharding row said 5.44x and 6.54x where the table holds 5.45 and 6.55 (and 1.90 for 1.91)."""
    page = _page(tmp_path, "<!-- numbers: figures/s.csv -->\n| DynamicConv | 1.80x / 5.44x | 1.90x / 6.54x |\n",
                 {"figures/s.csv": SHARDING})
    found = docs.untraced(page, tmp_path)
    assert [p.split(": ", 1)[1].split(" ")[0] for p in found] == ["5.44", "1.90", "6.54"]
    page.write_text("<!-- numbers: figures/s.csv -->\n| DynamicConv | 1.80x / 5.45x | 1.91x / 6.55x |\n")
    assert docs.untraced(page, tmp_path) == []


def test_a_number_matches_at_the_precision_written_signs_and_percentages_included(tmp_path: Path) -> None:
    page = _page(tmp_path, "<!-- numbers: m.json -->\nIt lost 2.3 points (-2.30), 96% of the peak, 1,467,610 weights.\n",
                 {"m.json": '{"a": {"change": -2.2951, "share": 0.9612}, "n": [1467610]}'})
    assert docs.untraced(page, tmp_path) == []
    page.write_text("<!-- numbers: m.json -->\nIt lost 2.31 points.\n")
    assert len(docs.untraced(page, tmp_path)) == 1


def test_names_code_links_and_dates_are_not_numbers_but_a_bare_number_needs_a_source(tmp_path: Path) -> None:
    text = ("WRN-28-2 in fp32 with 8-bit state on 28x28 images, torch 2.14.1, on 2026-12-04: `--batch 128` "
            "[a](figures/09_frontier.png)\n```\npeak 491.0 MiB\n```\n")
    page = _page(tmp_path, text)
    assert docs.untraced(page, tmp_path) == []
    page.write_text(text + "It used 3 seeds.\n")
    assert [p.split(": ", 1)[1].split(" ")[0] for p in docs.untraced(page, tmp_path)] == ["3"]
    (tmp_path / "docs" / "numbers-allowed" / "page.yaml").write_text('"3": the seeds of the cpu profile\n')
    assert docs.untraced(page, tmp_path) == []


def test_an_allowed_number_needs_its_reason_and_a_named_source_must_exist(tmp_path: Path) -> None:
    page = _page(tmp_path, "<!-- numbers: figures/gone.csv -->\nNothing.\n", allowed='"3": ""\n')
    with pytest.raises(ValueError, match="no reason"):
        docs.untraced(page, tmp_path)
    (tmp_path / "docs" / "numbers-allowed" / "page.yaml").write_text("")
    assert docs.untraced(page, tmp_path) == ["docs/page.md:1: source figures/gone.csv does not exist"]


def test_an_embed_block_is_stale_until_refreshed(tmp_path: Path) -> None:
    page = _page(tmp_path, "a\n<!-- lowmem:embed figures/t.md -->\nold 1.0\n<!-- lowmem:embed:end -->\nb\n",
                 {"figures/t.md": "| x |\n|---|\n| 2.5 |\n"})
    assert docs.stale_embeds(page, tmp_path) == ["figures/t.md"]
    assert docs.refresh(page, tmp_path) is True
    assert docs.stale_embeds(page, tmp_path) == [] and docs.untraced(page, tmp_path) == []
    assert page.read_text() == "a\n<!-- lowmem:embed figures/t.md -->\n| x |\n|---|\n| 2.5 |\n<!-- lowmem:embed:end -->\nb\n"
    assert docs.refresh(page, tmp_path) is False


def test_the_readme_excerpt_of_lowmem_profile_is_what_the_tool_prints(capsys: pytest.CaptureFixture[str]) -> None:
    from lowmem.cli import main

    readme = README.read_text()
    section = readme[readme.index("## Your own model"):]
    command = re.search(r"^lowmem (profile .*)$", section, re.MULTILINE).group(1).split()
    excerpt = re.search(r"```\n(\| category .*?)```", section, re.DOTALL).group(1).strip().splitlines()
    assert main.main(command) == 0
    printed = capsys.readouterr().out.split("\n\nWhat this CPU holds")  # the op workspace that follows is the machine's
    assert "| op workspace |" in printed[1]
    assert [line for line in printed[0].splitlines() if line.startswith("|")] == excerpt
