"""What parsing PDFs in a child process costs: in-process vs one persistent child vs a fresh child per document.

The corpus is ordinary PDFs made with pymupdf (text pages of contract-like prose, 1 to --max-pages pages, seeded),
parsed side by side in one run: document by document, in-process and in the persistent child alternate (so a
busy machine slows both alike), --repeats passes, after one warm-up pass that also checks the child's results are
exactly the in-process ones. A fresh child per document is timed on the first --fresh-docs documents.

    python bench/parse_isolation.py --docs 40 --max-pages 40 --repeats 3
    python bench/parse_isolation.py --docs 40 --examples --repeats 3

PDFs are read as plain text without OCR (the cheapest parse, where the round trip weighs most; Markdown and OCR
costs are bench/parse_formats.py's). Prints ms per document and the ratio to in-process. The persistent child's
start is printed apart: a Ray worker pays it once, on its first PDF.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import pymupdf
from clover_batch.pipeline.parse import parse_document
from clover_batch.pipeline.parse_process import IsolatedParser

EXAMPLES = Path(__file__).resolve().parent.parent / "jobs" / "examples" / "docs"
WORDS = ("the tenant shall pay rent on the first day of each month to the landlord at the address given in clause "
         "four unless notice in writing is served no later than thirty days before the renewal date and both parties "
         "agree that any dispute is settled under the laws of the state where the property lies").split()


def make_corpus(docs: int, max_pages: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    corpus = []
    for _ in range(docs):
        doc = pymupdf.open()
        for _ in range(rng.randint(1, max_pages)):
            page = doc.new_page()
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(250, 450)))
            page.insert_textbox(pymupdf.Rect(50, 50, 550, 800), text, fontsize=9)
        corpus.append(doc.tobytes(garbage=3, deflate=True))
    return corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--max-pages", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh-docs", type=int, default=10, help="documents timed with a fresh child each")
    ap.add_argument("--examples", action="store_true",
                    help="use the example PDFs (jobs/examples/docs, one or two small pages each: the worst case, "
                         "where the round trip is largest against the parse) repeated to --docs documents")
    args = ap.parse_args()

    if args.examples:
        examples = [p.read_bytes() for p in sorted(EXAMPLES.glob("*.pdf"))]
        corpus = [examples[i % len(examples)] for i in range(args.docs)]
    else:
        corpus = make_corpus(args.docs, args.max_pages, args.seed)
    reference = [parse_document("doc.pdf", data, pdf_text="plain", ocr="never") for data in corpus]
    pages = sum(r.pages for r in reference)
    print(f"corpus: {len(corpus)} PDFs, {pages} pages, {sum(map(len, corpus)) / 2**20:.1f} MiB "
          f"({pages / len(corpus):.1f} pages per document)")

    parser = IsolatedParser()
    try:
        start = time.perf_counter()
        first = parser.parse_pdf(corpus[0], timeout_s=300, pdf_text="plain", ocr="never")
        startup = time.perf_counter() - start
        # warm both ways up (imports, font caches), and check the child gives exactly the in-process results
        rest = [parser.parse_pdf(d, timeout_s=300, pdf_text="plain", ocr="never") for d in corpus[1:]]
        if [first, *rest] != reference:
            raise SystemExit("the child's results differ from in-process parsing")
        in_process, child = [], []
        for rep in range(args.repeats):
            # document by document, alternating which way goes first: a busy machine slows both alike
            for i, data in enumerate(corpus):
                for way in ((0, 1) if (i + rep) % 2 == 0 else (1, 0)):
                    start = time.perf_counter()
                    if way == 0:
                        parse_document("doc.pdf", data, pdf_text="plain", ocr="never")
                    else:
                        parser.parse_pdf(data, timeout_s=300, pdf_text="plain", ocr="never")
                    (in_process if way == 0 else child).append(time.perf_counter() - start)
    finally:
        parser.close()
    fresh = []
    for data in corpus[: args.fresh_docs]:
        start = time.perf_counter()
        one = IsolatedParser()
        try:
            one.parse_pdf(data, timeout_s=300, pdf_text="plain", ocr="never")
        finally:
            one.close()
        fresh.append(time.perf_counter() - start)

    n = len(corpus) * args.repeats
    base = sum(in_process) / n
    ratios = [c / p for c, p in zip(child, in_process, strict=True)]
    print(f"{'way':<34}{'ms/doc':>10}{'vs in-process':>16}")
    print(f"{'in-process':<34}{1000 * base:>10.2f}{1.0:>15.3f}x")
    print(f"{'persistent child':<34}{1000 * sum(child) / n:>10.2f}{sum(child) / sum(in_process):>15.3f}x"
          f"   (median per-document ratio {statistics.median(ratios):.3f}x)")
    print(f"{'fresh child per document':<34}{1000 * statistics.mean(fresh):>10.2f}"
          f"{statistics.mean(fresh) / base:>15.3f}x   (first {len(fresh)} documents)")
    print(f"persistent child's one start: {startup:.2f} s, paid once per worker process "
          f"(= {startup / base:.0f} in-process documents)")


if __name__ == "__main__":
    main()
