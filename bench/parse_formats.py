"""What a page costs to parse: plain text, Markdown (layout analysis) and OCR, side by side in one run; and the
share of a long document's end-to-end time that parsing takes on the demo model.

Corpora (all made here, seeded):
- examples: the example PDFs (jobs/examples/docs/*.pdf, one or two small pages each);
- multipage: a --pages page PDF drawn by pymupdf, each page a heading, paragraphs and (every other page) a ruled
  table of figures;
- scanned: its first --scan-pages pages rendered at 200 dpi and put into an image-only PDF (no text layer).

"Per worker" is one parse child process (pipeline/parse_process.py, as a Ray worker has), parsing one document after
another; each time is from sending the bytes to the reply, the median of --repeats runs after a warm-up (which loads
the layout and OCR models once, as a worker does on its first document). Modes, each on the same bytes:

    plain        pdf_text=plain,    ocr=never   (MuPDF's text: what the pipeline did before)
    plain+auto   pdf_text=plain,    ocr=auto    (adds the per-page OCR decision; recognises only scans)
    markdown     pdf_text=markdown, ocr=never   (pymupdf4llm layout analysis, tables as Markdown)
    default      pdf_text=markdown, ocr=auto    (the job default)

Then a job on the demo model (jobs/examples/demo, its summarize task) over one long document, the multipage PDF,
once per setting (plain; default; and the scanned pages with OCR), each in a fresh output: the parse stage's
seconds against the sum of the document's stage times (read, parse, tokenize, infer, postprocess). Each job's
input also holds a one-page copy of the document's first page, parsed first in the same worker, so the long
document's parse time is a warm worker's (the parse child's start and model loads are paid once per worker).

    python bench/parse_formats.py                       # about 5 minutes on an idle 2-core machine
    python bench/parse_formats.py --pages 40 --scan-pages 8 --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pymupdf
from clover_batch.pipeline.parse_process import IsolatedParser

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "jobs" / "examples" / "docs"
DEMO = ROOT / "jobs" / "examples" / "demo"
WORDS = ("the tenant shall pay rent on the first day of each month to the landlord at the address given in clause "
         "four unless notice in writing is served no later than thirty days before the renewal date and both parties "
         "agree that any dispute is settled under the laws of the state where the property lies").split()
MODES = {"plain": ("plain", "never"), "plain+auto": ("plain", "auto"), "markdown": ("markdown", "never"),
         "default": ("markdown", "auto")}


def multipage_pdf(pages: int, seed: int = 0) -> bytes:
    """Pages of mixed text and ruled tables."""
    rng = random.Random(seed)
    doc = pymupdf.open()
    for n in range(pages):
        page = doc.new_page()
        page.insert_text((50, 60), f"Section {n + 1}: terms and figures", fontsize=15)
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(120, 220)))
        page.insert_textbox(pymupdf.Rect(50, 80, 550, 420), text, fontsize=10)
        if n % 2 == 0:
            rows = [["Quarter", "Units", "Price", "Revenue"]] + [
                [f"Q{q} 2024", str(rng.randint(10, 999)), f"{rng.randint(5, 90)} EUR", f"{rng.randint(1, 90)},000 EUR"]
                for q in range(1, 5)]
            for r, row in enumerate(rows):
                for c, cell in enumerate(row):
                    rect = pymupdf.Rect(50 + 120 * c, 440 + 22 * r, 170 + 120 * c, 462 + 22 * r)
                    page.draw_rect(rect, color=(0, 0, 0), width=0.7)
                    page.insert_text((rect.x0 + 4, rect.y1 - 7), cell, fontsize=9)
            tail = pymupdf.Rect(50, 560, 550, 800)
        else:
            tail = pymupdf.Rect(50, 440, 550, 800)
        page.insert_textbox(tail, " ".join(rng.choice(WORDS) for _ in range(rng.randint(80, 160))), fontsize=10)
    return doc.tobytes(garbage=3, deflate=True)


def scanned(data: bytes, pages: int, dpi: int = 200) -> bytes:
    """The first `pages` pages as pictures in an image-only PDF."""
    src = pymupdf.open(stream=data)
    out = pymupdf.open()
    for page in list(src)[:pages]:
        out.new_page(width=page.rect.width, height=page.rect.height).insert_image(page.rect,
                                                                                  pixmap=page.get_pixmap(dpi=dpi))
    return out.tobytes(garbage=3, deflate=True)


def time_modes(parser: IsolatedParser, corpus: list[tuple[str, bytes]], repeats: int) -> dict[str, tuple[float, int]]:
    """mode -> (median seconds over the whole corpus, pages in it); modes interleaved per repeat, so a busy machine
    slows all alike."""
    pages = sum(pymupdf.open(stream=d).page_count for _, d in corpus)
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(repeats):
        for mode, (pdf_text, ocr) in MODES.items():
            start = time.perf_counter()
            for name, data in corpus:
                parsed = parser.parse(name, data, timeout_s=3600, pdf_text=pdf_text, ocr=ocr)
                if parsed.status not in ("ok", "no_text"):
                    raise RuntimeError(f"{name} ({mode}): {parsed.status}: {parsed.error}")
            runs[mode].append(time.perf_counter() - start)
    return {m: (statistics.median(t), pages) for m, t in runs.items()}


def first_page(data: bytes) -> bytes:
    doc = pymupdf.open(stream=data)
    doc.select([0])
    return doc.tobytes()


def share_of_parsing(docs: dict[str, bytes], settings: dict[str, dict], workdir: Path) -> list[tuple]:
    """(setting, document, pages, input tokens, parse s, sum of stage s, wall s, text_source) of a demo-model
    summarize job over one document (after a one-page warm-up document)."""
    import ray
    import ray.data  # sets its loggers' levels on import: ours come after
    from clover_batch.connectors.fs import Location
    from clover_batch.connectors.sink import read_output
    from clover_batch.jobs.runner import run
    from clover_batch.jobs.spec import load_job

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    warnings.filterwarnings("ignore")
    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=4, logging_level=logging.ERROR)
    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    out = []
    try:
        for label, (doc_name, input_settings) in settings.items():
            folder = workdir / f"in-{label}"
            folder.mkdir()
            (folder / doc_name).write_bytes(docs[doc_name])
            (folder / "0-warm-up.pdf").write_bytes(first_page(docs[doc_name]))
            spec = load_job(str(ROOT / "jobs" / "examples" / "summarize-local.yaml"), [
                f"input.uri={folder}", f"output.uri={workdir / f'out-{label}'}", f"model.source={DEMO}",
                *(f"input.{k}={v}" for k, v in input_settings.items())])
            start = time.perf_counter()
            run(spec)
            wall = time.perf_counter() - start
            rows = read_output(Location(str(workdir / f"out-{label}"))).to_pylist()
            (row,) = [r for r in rows if r["source_uri"].endswith(doc_name)]
            if row["status"] != "ok":
                raise RuntimeError(f"{label}: {row['status']}: {row['error']}")
            timings = {k: v for k, v in row["timings"].items() if v is not None and k not in ("prefill", "decode")}
            out.append((label, doc_name, row["pages"], row["input_tokens"], timings["parse"], sum(timings.values()),
                        wall, row["text_source"]))
    finally:
        ray.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=16, help="pages of the multipage PDF")
    ap.add_argument("--scan-pages", type=int, default=3, help="pages of the scanned PDF")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-job", action="store_true", help="skip the end-to-end share on the demo model")
    args = ap.parse_args()

    multipage = multipage_pdf(args.pages)
    scan = scanned(multipage, args.scan_pages)
    corpora = {
        "examples": [(p.name, p.read_bytes()) for p in sorted(EXAMPLES.glob("*.pdf"))],
        f"multipage ({args.pages} p.)": [("multipage.pdf", multipage)],
        f"scanned ({args.scan_pages} p.)": [("scanned.pdf", scan)],
    }
    print(f"python {sys.version.split()[0]}, pymupdf {pymupdf.__version__}, {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    parser = IsolatedParser()
    try:
        for corpus in corpora.values():  # warm-up: layout and OCR models loaded once, as in a worker
            time_modes(parser, corpus[:1], 1)
        print("\npages per second per worker (one parse child; median of", args.repeats, "runs)")
        print(f"{'corpus':22s}" + "".join(f"{m:>14s}" for m in MODES) + f"{'default/plain':>16s}")
        for name, corpus in corpora.items():
            got = time_modes(parser, corpus, args.repeats)
            rates = {m: pages / seconds for m, (seconds, pages) in got.items()}
            ratio = "-" if name.startswith("scanned") else f"{rates['plain'] / rates['default']:.0f}x"
            print(f"{name:22s}" + "".join(f"{rates[m]:14.2f}" for m in MODES) + f"{ratio:>16s}")
    finally:
        parser.close()
    print("(scanned: plain and markdown do no OCR, so their rate is that of the no_text answer; plain+auto and "
          "default are the OCR rates)")

    if args.no_job:
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = share_of_parsing(
            {"multipage.pdf": multipage, "scanned.pdf": scan},
            {"plain": ("multipage.pdf", {"pdf_text": "plain", "ocr": "never"}),
             "default (markdown, auto)": ("multipage.pdf", {}),
             "scanned, default (OCR)": ("scanned.pdf", {})},
            Path(tmp))
    print("\nshare of a long document's end-to-end time spent parsing (demo model, summarize, one document)")
    print(f"{'setting':26s}{'pages':>6s}{'tokens':>8s}{'parse s':>9s}{'stages s':>10s}{'share':>7s}{'wall s':>8s}"
          "  source")
    for label, _, pages, tokens, parse_s, total_s, wall_s, source in rows:
        print(f"{label:26s}{pages:6d}{tokens:8d}{parse_s:9.2f}{total_s:10.2f}{parse_s / total_s:7.0%}{wall_s:8.1f}"
              f"  {source}")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
