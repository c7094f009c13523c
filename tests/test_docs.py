"""README is the front door and docs/ the reference behind it: the job reference is generated from the schema and
never stale, README stays short and links every page, and every relative link in them lands on a file and heading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from clover_batch.jobs import reference
from clover_batch.jobs.spec import InputSpec

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_job_reference_is_generated_from_the_schema():
    assert (DOCS / "jobs.md").read_text() == reference.render(), (
        "docs/jobs.md is stale: run python -m clover_batch.jobs.reference")
    assert reference.main(["--check"]) == 0


def test_job_reference_goes_stale_when_a_description_changes(monkeypatch, tmp_path):
    out = tmp_path / "jobs.md"
    assert reference.main(["--out", str(out)]) == 0
    assert reference.main(["--check", "--out", str(out)]) == 0
    text = out.read_text()
    for dotted in ("`input.pages_per_task`", "`decode.mode`", "`task.fields.NAME.type`", "`input.table.id_column`",
                   "`run.stall_timeout_s`", "`output.commit_interval_s`"):
        assert f"| {dotted} |" in text, dotted
    field = InputSpec.model_fields["pages_per_task"]
    monkeypatch.setattr(field, "description", field.description + " Changed.")
    assert "Changed." in reference.render()
    assert reference.main(["--check", "--out", str(out)]) == 1


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces as -."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_readme_is_a_front_door_that_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme) < 10_000, len(readme)
    links = set(LINK.findall(readme))
    for page in sorted(DOCS.glob("*.md")):
        assert f"docs/{page.name}" in links, f"README does not link docs/{page.name}"


@pytest.mark.parametrize("page", ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))])
def test_relative_links_land(page):
    source = ROOT / page
    for target in LINK.findall(source.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        path = (source.parent / file).resolve() if file else source
        assert path.exists(), f"{page}: link to {target}: no such file"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{page}: link to {target}: no such heading in {path.name}"
