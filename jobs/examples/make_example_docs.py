"""Regenerate the example documents in jobs/examples/docs (run once; the outputs are committed).

    python jobs/examples/make_example_docs.py

They are synthetic documents of the kinds the `demo` checkpoint was trained on (jobs/demo_corpus.py), drawn from
seeds used neither for training nor for the held-out evaluation: for each file below, the first seed of
EXAMPLE_SEEDS not taken by an earlier file that gives its kind (and length). Two are real PDFs made with pymupdf
(one of them two pages), one is markdown, and one is longer than the demo model's attention window with all its
facts before it. The targets (summary and extraction) are written to jobs/examples/expected.json for checking the
demo job's answers.
"""

import json
from pathlib import Path

import pymupdf
from clover_batch.jobs.demo_corpus import EXAMPLE_SEEDS, make_document

HERE = Path(__file__).parent
DOCS = HERE / "docs"

# file name -> (kind, long, markdown, pages)
FILES = {
    "lease-agreement.pdf": ("lease agreement", False, False, 1),
    "invoice.pdf": ("invoice", False, False, 2),
    "meeting-minutes.txt": ("meeting minutes", False, False, 0),
    "purchase-order.md": ("purchase order", False, True, 0),
    "incident-report-long.txt": ("incident report", True, False, 0),
}


def first_document(kind: str, long: bool, markdown: bool, used: set[int]):
    for seed in EXAMPLE_SEEDS:
        if seed in used:  # every file its own seed: different names, dates and amounts
            continue
        doc = make_document(seed, kind=kind, long=long, wrap=False)
        if doc.extra["markdown"] == markdown:
            used.add(seed)
            return doc
    raise RuntimeError(f"no example seed gives a {kind}")


def write_pdf(path: Path, text: str, pages: int) -> None:
    """The text's paragraphs over `pages` pages, or more where they do not fit: pymupdf's insert_textbox writes
    nothing at all into a box its text overflows (it returns a negative number), which left a blank PDF."""
    paragraphs = text.strip().split("\n\n")
    for n in range(pages, max(pages, len(paragraphs)) + 1):
        cut = -(-len(paragraphs) // n)
        doc = pymupdf.open()
        fits = True
        for i in range(n):
            page = doc.new_page()
            fits &= page.insert_textbox(pymupdf.Rect(72, 72, 540, 770),
                                        "\n\n".join(paragraphs[i * cut:(i + 1) * cut]), fontsize=11) >= 0
        if fits:
            doc.save(path, garbage=4, deflate=True)
            return
    raise ValueError(f"{path.name}: a paragraph does not fit on a page")


def main() -> None:
    DOCS.mkdir(exist_ok=True)
    for old in DOCS.iterdir():
        old.unlink()
    expected, used = {}, set()
    for name, (kind, long, markdown, pages) in FILES.items():
        doc = first_document(kind, long, markdown, used)
        if pages:
            write_pdf(DOCS / name, doc.text, pages)
        else:
            (DOCS / name).write_text(doc.text)
        expected[name] = {"seed": doc.seed, "summary": doc.summary, "extraction": json.loads(doc.extraction)}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")


if __name__ == "__main__":
    main()
