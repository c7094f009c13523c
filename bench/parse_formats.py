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

Long documents (issue 33; `--long-only` runs only these, `--long-pages 1000` is the issue's measure):

- before vs after, pages per second of one worker, default settings (Markdown, OCR auto), on a text-heavy PDF of
  --long-pages pages (a manual: headings and dense paragraphs) and on the multipage PDF (text and tables). Before
  is the code path that parsing had: in a fresh process with onnxruntime's default threads, the OCR pass, then
  pymupdf4llm's one `to_markdown` call over the document (parse.markdown_reference), after a warm-up page. After
  is today's parse child (one layout thread, parse.markdown_pieces, whole document in one child). The two
  alternate, --repeats times; the texts are compared (equal, and the same Markdown table rows).
- range overhead: one worker parsing a --range-pages document as ranges of k pages one after another
  (page_ranges.parse_ranges without Ray): what a range costs beyond its pages (k = all pages is the baseline).
- wall time of the long PDF as ranges of input.pages_per_task on a Ray of 1 and of 2 CPUs (each its own Ray,
  started in a subprocess; range tasks of 1 CPU, so 1 and 2 parse at once; warmed up first).

    python bench/parse_formats.py --long-only --long-pages 1000 --repeats 1   # ~25 min on an idle 2-core machine
    python bench/parse_formats.py --long-only --long-pages 100 --range-pages 40 --repeats 1   # ~5 min
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


def text_pdf(pages: int, seed: int = 0) -> bytes:
    """A manual's pages: a section heading and dense paragraphs filling the page, no tables or pictures."""
    rng = random.Random(seed)
    doc = pymupdf.open()
    for n in range(pages):
        page = doc.new_page()
        page.insert_text((50, 60), f"{n // 10 + 1}.{n % 10 + 1} Configuring the service", fontsize=14)
        y = 80
        for _ in range(3):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(110, 140))) + "."
            rect = pymupdf.Rect(50, y, 550, y + 230)
            left = page.insert_textbox(rect, text, fontsize=10)
            y = rect.y1 - max(left, 0) + 14
    return doc.tobytes(garbage=3, deflate=True)


def reference_worker(path: str, repeats: int) -> None:
    """(Subprocess) the code path parsing had before page ranges, timed after a warm-up page: prints one JSON line
    {seconds: [...], sha, table_rows}."""
    import hashlib
    import json

    from clover_batch.pipeline.ocr import Recogniser, recognise_document
    from clover_batch.pipeline.parse import clean, markdown_reference, tidy_lines

    data = Path(path).read_bytes()
    recogniser = Recogniser()
    warm = pymupdf.open(stream=first_page(data))
    recognise_document(warm, "auto", recogniser)
    markdown_reference(warm)
    seconds, cpu, text = [], [], ""
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        with pymupdf.open(stream=data, filetype="pdf") as doc:
            recognise_document(doc, "auto", recogniser)
            [page.get_text() for page in doc]
            text = tidy_lines(clean(markdown_reference(doc)))
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    print(json.dumps({"seconds": seconds, "cpu": cpu, "sha": hashlib.sha256(text.encode()).hexdigest(),
                      "table_rows": sum(line.startswith("|") for line in text.splitlines())}))


def before_after(corpus: dict[str, bytes], repeats: int, workdir: Path) -> list[tuple]:
    """(document, pages, before s, after s, same text, table rows before, after, before CPU s, after CPU s):
    medians, sides alternating. CPU seconds are the process's, all its threads."""
    import hashlib
    import json
    import subprocess

    parser = IsolatedParser()
    out = []
    try:
        for name, data in corpus.items():
            path = workdir / f"{name}.pdf"
            path.write_bytes(data)
            parser.parse("warm.pdf", first_page(data), timeout_s=3600)
            before, after, cpu_before, cpu_after, text, ref = [], [], [], [], "", {}
            for _ in range(repeats):
                proc = subprocess.run([sys.executable, __file__, "--reference-worker", str(path)], check=True,
                                      capture_output=True, text=True, env={**os.environ, "CLOVER_LAYOUT_THREADS": "0"})
                ref = json.loads(proc.stdout.strip().splitlines()[-1])
                before += ref["seconds"]
                cpu_before += ref["cpu"]
                start, cpu_start = time.perf_counter(), child_cpu(parser)
                parsed = parser.parse(f"{name}.pdf", data, timeout_s=3600)
                after.append(time.perf_counter() - start)
                cpu_after.append(child_cpu(parser) - cpu_start)
                if parsed.status != "ok":
                    raise RuntimeError(f"{name}: {parsed.status}: {parsed.error}")
                text = parsed.text
            rows = sum(line.startswith("|") for line in text.splitlines())
            same = hashlib.sha256(text.encode()).hexdigest() == ref["sha"]
            out.append((name, pymupdf.open(stream=data).page_count, statistics.median(before),
                        statistics.median(after), same, ref["table_rows"], rows, statistics.median(cpu_before),
                        statistics.median(cpu_after)))
    finally:
        parser.close()
    return out


def child_cpu(parser: IsolatedParser) -> float:
    """CPU seconds the parser's child process has used, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{parser._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def range_overhead(data: bytes, sizes: list[int]) -> list[tuple[int, int, float]]:
    """(pages per range, ranges, seconds) of one worker parsing `data` as ranges one after another."""
    from clover_batch.pipeline.page_ranges import page_ranges, parse_ranges
    from clover_batch.pipeline.parse_process import shared_parser

    count = pymupdf.open(stream=data).page_count
    shared_parser().parse("warm.pdf", first_page(data), timeout_s=3600)
    out = []
    for k in sizes:
        start = time.perf_counter()
        parsed = parse_ranges("doc.pdf", data, count, timeout_s=3600, pages_per_task=k, use_ray=False)
        if parsed.status != "ok":
            raise RuntimeError(f"ranges of {k}: {parsed.status}: {parsed.error}")
        out.append((k, len(page_ranges(count, k)), time.perf_counter() - start))
    shared_parser().close()
    return out


def ray_worker(path: str, cpus: int, pages_per_task: int) -> None:
    """(Subprocess) wall seconds of one document parsed as ranges on a Ray of `cpus` CPUs: prints JSON."""
    import json

    import ray
    from clover_batch.pipeline.page_ranges import parse_ranges

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR)
    data = Path(path).read_bytes()
    count = pymupdf.open(stream=data).page_count
    warm = first_page(data)  # every worker's parse child started and its models loaded
    parse_ranges("warm.pdf", warm, 1, timeout_s=3600, range_cpus=1.0, use_ray=True)
    two = pymupdf.open(stream=data)
    two.select(list(range(min(count, 2 * cpus))))
    parse_ranges("warm.pdf", two.tobytes(), two.page_count, timeout_s=3600, pages_per_task=1, range_cpus=1.0,
                 use_ray=True)
    start = time.perf_counter()
    parsed = parse_ranges("doc.pdf", data, count, timeout_s=3600, pages_per_task=pages_per_task, range_cpus=1.0,
                          use_ray=True)
    wall = time.perf_counter() - start
    ray.shutdown()
    print(json.dumps({"wall": wall, "status": parsed.status, "error": parsed.error}))


def workers_wall(data: bytes, workdir: Path, pages_per_task: int) -> dict[int, float]:
    import json
    import subprocess

    path = workdir / "long.pdf"
    path.write_bytes(data)
    out = {}
    for cpus in (1, 2):
        proc = subprocess.run([sys.executable, __file__, "--ray-worker", str(path), str(cpus), str(pages_per_task)],
                              check=True, capture_output=True, text=True)
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        if got["status"] != "ok":
            raise RuntimeError(f"{cpus} CPUs: {got['status']}: {got['error']}")
        out[cpus] = got["wall"]
    return out


def long_documents(args: argparse.Namespace) -> None:
    from clover_batch.pipeline.page_ranges import PAGES_PER_TASK

    long_pdf = text_pdf(args.long_pages)
    with tempfile.TemporaryDirectory() as tmp:
        rows = before_after({f"text-heavy ({args.long_pages} p.)": long_pdf,
                             f"text+tables ({args.pages} p.)": multipage_pdf(args.pages)}, args.repeats, Path(tmp))
        print("\ndefault parsing (Markdown, OCR auto), one worker: before (one pymupdf4llm call, onnxruntime's "
              "threads and no arena) vs after (the parse child); pages per second, and pages per CPU-second")
        print(f"{'document':24s}{'before':>9s}{'after':>9s}{'after/before':>14s}{'p/CPU-s before':>16s}"
              f"{'after':>7s}{'ratio':>7s}{'same text':>11s}{'table rows':>12s}")
        for name, pages, before, after, same, rows_before, rows_after, cpu_before, cpu_after in rows:
            print(f"{name:24s}{pages / before:9.2f}{pages / after:9.2f}{before / after:13.2f}x"
                  f"{pages / cpu_before:16.2f}{pages / cpu_after:7.2f}{cpu_before / cpu_after:6.2f}x{same!s:>11s}"
                  f"{f'{rows_before} / {rows_after}':>12s}")
        sizes = sorted({5, 10, 20, args.range_pages} & set(range(1, args.range_pages + 1)))
        overhead = range_overhead(text_pdf(args.range_pages, seed=1), sizes)
        base = overhead[-1][2]
        print(f"\none worker, a {args.range_pages}-page text-heavy PDF as ranges of k pages one after another")
        print(f"{'k':>5s}{'ranges':>8s}{'seconds':>9s}{'s per extra range':>19s}")
        for k, n, seconds in overhead:
            extra = "-" if n == 1 else f"{(seconds - base) / (n - 1):.2f}"
            print(f"{k:5d}{n:8d}{seconds:9.1f}{extra:>19s}")
        walls = workers_wall(long_pdf, Path(tmp), PAGES_PER_TASK)
    print(f"\nwall seconds of the {args.long_pages}-page PDF as ranges of {PAGES_PER_TASK} pages: 1 worker "
          f"{walls[1]:.1f}, 2 workers {walls[2]:.1f} ({walls[2] / walls[1]:.2f}x of 1)")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


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
    ap.add_argument("--long-pages", type=int, default=1000, help="pages of the text-heavy PDF")
    ap.add_argument("--range-pages", type=int, default=100, help="pages of the range-overhead PDF")
    ap.add_argument("--long-only", action="store_true", help="only the long-document measures")
    ap.add_argument("--reference-worker", help=argparse.SUPPRESS)
    ap.add_argument("--ray-worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reference_worker:
        return reference_worker(args.reference_worker, 1)
    if args.ray_worker:
        path, cpus, per_task = args.ray_worker
        return ray_worker(path, int(cpus), int(per_task))
    print(f"python {sys.version.split()[0]}, pymupdf {pymupdf.__version__}, {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.long_only:
        return long_documents(args)

    multipage = multipage_pdf(args.pages)
    scan = scanned(multipage, args.scan_pages)
    corpora = {
        "examples": [(p.name, p.read_bytes()) for p in sorted(EXAMPLES.glob("*.pdf"))],
        f"multipage ({args.pages} p.)": [("multipage.pdf", multipage)],
        f"scanned ({args.scan_pages} p.)": [("scanned.pdf", scan)],
    }
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

    long_documents(args)
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
