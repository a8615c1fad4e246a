"""The docs agree with the code: every setting has its row in docs/settings.md, made from its
one declaration in pipeline/settings.py, and every link in the README and docs/ leads somewhere.

    python -m tests.test_docs    prints the settings table, to paste after adding a setting
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from pipeline.settings import ROOT, Settings

DOCS = sorted((Path(ROOT) / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def settings_table() -> str:
    rows = ["| setting | default | range | what |", "|---|---|---|---|"]
    for f in dataclasses.fields(Settings):
        low, high = f.metadata["range"]
        default = "none" if f.default in ("", None) else f"`{f.default}`"
        limits = f"{low:g} to {high:g}" if low is not None else "a finite number" if f.type == "float" else ""
        rows.append(f"| `{f.metadata['env']}` | {default} | {limits} | {f.metadata['what']} |")
    return "\n".join(rows) + "\n"


def test_every_setting_has_its_row_as_declared():
    page = (Path(ROOT) / "docs" / "settings.md").read_text()
    assert settings_table() in page, "docs/settings.md's table differs from pipeline/settings.py: " \
                                     "paste the output of `python -m tests.test_docs`"


def test_a_setting_added_without_its_row_fails(monkeypatch):
    added = dataclasses.make_dataclass("Added", [("extra", int, dataclasses.field(
        default=1, metadata={"env": "CN_EXTRA", "range": (None, None), "what": "new"}))], bases=(Settings,), frozen=True)
    monkeypatch.setattr("tests.test_docs.Settings", added)
    assert settings_table() not in (Path(ROOT) / "docs" / "settings.md").read_text()


def links(page: Path) -> list[str]:
    return [m for m in LINK.findall(page.read_text()) if not m.startswith(("http://", "https://", "mailto:"))]


def test_every_link_in_the_readme_and_docs_leads_to_a_file_and_heading_that_exist():
    pages = [Path(ROOT) / "README.md", *DOCS]
    broken = []
    for page in pages:
        for link in links(page):
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{page.name}: {link} (no such heading)")
    assert not broken, broken


def test_the_readme_links_every_docs_page_and_fits_on_a_screen():
    readme = (Path(ROOT) / "README.md").read_text()
    linked = {(Path(ROOT) / link.partition("#")[0]).resolve() for link in links(Path(ROOT) / "README.md")}
    assert {p.resolve() for p in DOCS} <= linked, "a docs page the README does not link"
    assert len(readme.splitlines()) <= 200


def anchors(page: Path) -> set[str]:
    """GitHub's anchors: a heading lower-cased, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)}


if __name__ == "__main__":
    print(settings_table(), end="")


def test_no_file_of_the_repository_sends_a_reader_outside_it():
    """Whoever clones the repository has only the repository: the input's columns, what a note
    shows and where the rates come from are in docs/input.md, in the project's own words."""
    import re
    import subprocess

    outside = re.compile(r"\.\./shared|shared/(CONTRACT_NOTE|DESIGN|RAY_NOTES|STYLE)|beside the repository")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    named = [f for f in files if f != "tests/test_docs.py" and (Path(ROOT) / f).is_file()
             and outside.search((Path(ROOT) / f).read_bytes().decode("utf-8", "ignore"))]
    assert named == []


def test_the_benchmarks_open_with_a_three_line_headline_whose_figures_are_in_the_docs_tables():
    """"How fast is it" answered before any table: notes a second here, the 1.5M day, the cluster.
    Each figure of the headline is one the tables below it (or aws.md's `plan` table) hold, so
    the headline cannot say what no run measured or projected."""
    page = (Path(ROOT) / "docs" / "benchmarks.md").read_text()
    lines = page.splitlines()
    head, rest = lines[2:5], "\n".join(lines[5:]) + (Path(ROOT) / "docs" / "aws.md").read_text()
    assert lines[0] == "# Benchmarks" and all(line.startswith("- **") for line in head) and lines[5] == ""
    assert [re.search(w, line, re.I) is not None for w, line in zip(("notes a second", "1.5M day", "cluster"), head)] \
        == [True] * 3
    figures = {f for line in head for f in re.findall(r"\$?\d[\d,]*\.\d+|\d{2,}(?:,\d{3})*", line.split("(`")[0])}
    assert figures and not {f for f in figures if f not in rest}, "a headline figure no table holds"


def test_each_ratio_of_the_benchmarks_is_defined_where_it_is_first_used():
    page = (Path(ROOT) / "docs" / "benchmarks.md").read_text()
    first = next(line for line in page.splitlines() if "efficiency" in line.lower())
    assert "over 2 cores x the sequential loop" in first, "efficiency, said before it is defined"
    before_table = page[:page.index("| benchmark |")]
    assert "`Nx`" in before_table, "what a figure written 9.9x is a ratio of"
