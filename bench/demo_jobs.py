"""The two example jobs on documents nobody trained or evaluated on: do the demo's answers carry the document's facts?

    python bench/demo_jobs.py --docs 40               # 40 fresh documents through both example jobs
    python bench/demo_jobs.py --examples              # the 5 example documents of README command 1

Writes documents of jobs/demo_corpus.py drawn from FRESH_SEEDS (a range no training, held-out evaluation or example
file uses; kinds, long documents and layouts as the corpus draws them, one in three a one-page PDF) into a temporary
folder, runs jobs/examples/summarize-local.yaml and extract-local.yaml on it unchanged but for their input and
output folders (the real pipeline: local Ray, parsing, the job's prompt, decoding and checks; `--model` swaps the
checkpoint), reads their Parquet rows and scores them against each document's targets:

- extraction: exact match per field (the answer checked as the pipeline checks it; a refused answer matches none);
- summary: the facts the target summary states (names, amounts, dates and others such as the item or the site,
  `Document.summary_facts`), each present verbatim in the output or not; and per document whether all its names,
  amounts and dates are there.

Long documents (facts before a log longer than the attention window) are scored apart as well. And whether the rows
say where they are unsure: of the wrong fields, how many the row lists in `uncertain_fields` (and of the right
ones), and of the summaries missing a fact, how many have `uncertain_words` (and of those with every fact).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from clover_batch.jobs.demo_corpus import EXTRACT_FIELDS, FRESH_SEEDS, Document, make_document
from clover_batch.jobs.demo_model import (
    DEMO_DIR,
    EXAMPLES,
    EXTRACT_JOB,
    SUMMARIZE_JOB,
    field_matches,
)

log = logging.getLogger("bench.demo_jobs")
CHECKED = ("name", "amount", "date")  # the summary facts README's first command is judged on


def _write_pdf():
    spec = importlib.util.spec_from_file_location("make_example_docs", EXAMPLES / "make_example_docs.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.write_pdf


def fresh_documents(folder: Path, n: int) -> dict[str, Document]:
    """n documents from FRESH_SEEDS written into `folder`; file name -> document."""
    write_pdf = _write_pdf()
    folder.mkdir(parents=True, exist_ok=True)
    docs = {}
    for i in range(n):
        seed = FRESH_SEEDS[i]
        if i % 3 == 2:  # a PDF from the unwrapped text, as the example PDFs are made
            doc = make_document(seed, wrap=False)
            name = f"{i:03d}-{doc.title}.pdf"
            write_pdf(folder / name, doc.text, 1)
        else:
            doc = make_document(seed)
            name = f"{i:03d}-{doc.title}.{'md' if doc.extra['markdown'] else 'txt'}"
            (folder / name).write_text(doc.text)
        docs[name] = doc
    return docs


def example_documents() -> tuple[Path, dict[str, Document]]:
    """README command 1's documents (jobs/examples/docs) and the corpus documents they were made from."""
    expected = json.loads((EXAMPLES / "expected.json").read_text())
    docs = {name: make_document(entry["seed"], kind=entry["extraction"]["document_type"],
                                long=name.endswith("-long.txt"), wrap=False) for name, entry in expected.items()}
    return EXAMPLES / "docs", docs


def run_job(job: Path, docs: Path, out: Path, model: str, overrides: list[str] = ()) -> dict[str, dict]:
    """Run an example job on `docs` into `out` (`overrides`: more `--set` values); file name -> its output row."""
    import pyarrow.parquet as pq
    from clover_batch.jobs.runner import run
    from clover_batch.jobs.spec import load_job

    spec = load_job(str(job), [f"input.uri={docs}", f"output.uri={out}", f"model.source={model}", *overrides])
    start = time.perf_counter()
    result = run(spec)
    log.info("%s: exit %s in %.0f s", job.name, result.report.exit_code, time.perf_counter() - start)
    rows = pq.read_table(out).to_pylist()
    return {Path(r["source_uri"]).name: r for r in rows}


def facts_present(text: str, doc: Document) -> dict[str, tuple[int, int]]:
    """Per fact kind: (facts present verbatim in `text`, facts the target summary states)."""
    out: dict[str, tuple[int, int]] = {}
    for kind, fact in doc.summary_facts:
        hit, total = out.get(kind, (0, 0))
        out[kind] = (hit + (fact in text), total + 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=40, help="fresh documents")
    p.add_argument("--examples", action="store_true", help="score jobs/examples/docs instead of fresh documents")
    p.add_argument("--model", default=str(DEMO_DIR), help="checkpoint folder (default: the demo checkpoint)")
    p.add_argument("--show", type=int, default=5, help="summaries to print beside their targets")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="a job field for both jobs (repeatable), e.g. --set decode.mode=verified")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="demo-jobs-") as tmp:
        if args.examples:
            folder, docs = example_documents()
        else:
            folder, docs = Path(tmp) / "docs", fresh_documents(Path(tmp) / "docs", args.docs)
        summaries = run_job(SUMMARIZE_JOB, folder, Path(tmp) / "summarize", args.model, args.overrides)
        extractions = run_job(EXTRACT_JOB, folder, Path(tmp) / "extract", args.model, args.overrides)

    every = [*summaries.values(), *extractions.values()]
    statuses = Counter(r["status"] for r in every)
    forwards = sum(r["decode_forwards"] or 0 for r in every)
    per_forward = sum(r["output_tokens"] or 0 for r in every) / max(1, forwards)
    fields, fields_long, fields_short = Counter(), Counter(), Counter()
    facts: dict[str, list[int]] = {}
    facts_long = [0, 0]  # (present, total) over the long documents
    checked_ok, lines = 0, []
    # (field or summary, right, flagged): fields in uncertain_fields or not, summaries with uncertain_words or not
    flags: Counter = Counter()
    long_docs = sum(d.extra["long"] for d in docs.values())
    for name, doc in docs.items():
        got = field_matches(extractions[name]["output_text"] or "", doc)
        fields.update({k: int(v) for k, v in got.items()})
        (fields_long if doc.extra["long"] else fields_short).update({k: int(v) for k, v in got.items()})
        if extractions[name]["field_confidence"] is not None:
            unsure = set(extractions[name]["uncertain_fields"] or [])
            flags.update(("field", ok, k in unsure) for k, ok in got.items())
        text = summaries[name]["output_text"] or ""
        present = facts_present(text, doc)
        for kind, (hit, total) in present.items():
            facts.setdefault(kind, [0, 0])
            facts[kind][0] += hit
            facts[kind][1] += total
            if doc.extra["long"]:
                facts_long[0] += hit
                facts_long[1] += total
        right = all(present[k][0] == present[k][1] for k in CHECKED if k in present)
        checked_ok += right
        if summaries[name]["uncertain_words"] is not None:
            every_fact = all(h == t for h, t in present.values())
            flags.update([("summary", every_fact, bool(summaries[name]["uncertain_words"]))])
        missing = [f for kind, f in doc.summary_facts if f not in text]
        lines.append(f"{name}: {'names, amounts and dates right' if right else 'WRONG'}; fields "
                     f"{sum(got.values())}/{len(got)}; missing facts {missing}\n  ours:   {text}\n"
                     f"  target: {doc.summary}")

    n = len(docs)
    hit_all = sum(h for h, _ in facts.values())
    total_all = sum(t for _, t in facts.values())
    print(f"\ndemo jobs, {args.model}: {n} {'example' if args.examples else 'fresh'} documents ({long_docs} long), "
          f"load average before {load:.1f}; rows by status: {dict(statuses)}"
          + (f"; settings {' '.join(args.overrides)}" if args.overrides else ""))
    print(f"decoding: {per_forward:.2f} output tokens per decode forward over both jobs ({forwards} forwards)")
    print(f"extraction: {100 * sum(fields.values()) / (n * len(EXTRACT_FIELDS)):.1f}% of fields exact; "
          + ", ".join(f"{k} {100 * fields[k] / n:.0f}%" for k in EXTRACT_FIELDS)
          + (f"; long documents {100 * sum(fields_long.values()) / (long_docs * len(EXTRACT_FIELDS)):.1f}%"
             if long_docs else ""))
    for what, column, plural, ok_means in (("field", "uncertain_fields", "fields", "exact"),
                                           ("summary", "uncertain_words", "summaries", "with every fact")):
        wrong, right = (flags[what, False, True] + flags[what, False, False],
                        flags[what, True, True] + flags[what, True, False])
        kept = flags[what, True, False] + flags[what, False, False]
        if wrong + right:
            print(f"{column}: flags {flags[what, False, True]} of {wrong} {plural} not {ok_means} and "
                  f"{flags[what, True, True]} of {right} {ok_means}; of the {plural} it does not flag "
                  f"{100 * flags[what, True, False] / max(1, kept):.1f}% are {ok_means} ({flags[what, True, False]} "
                  f"of {kept})")
    print(f"summary: {100 * hit_all / total_all:.1f}% of the target's facts present; "
          + ", ".join(f"{k} {100 * h / t:.0f}% of {t}" for k, (h, t) in sorted(facts.items()))
          + (f"; long documents {100 * facts_long[0] / facts_long[1]:.1f}%" if facts_long[1] else "")
          + f"; names, amounts and dates all right in {checked_ok} of {n}")
    short = n - long_docs
    if short and long_docs:
        short_facts = (hit_all - facts_long[0], total_all - facts_long[1])
        print(f"short documents ({short}): {100 * sum(fields_short.values()) / (short * len(EXTRACT_FIELDS)):.1f}% of "
              f"fields exact; " + ", ".join(f"{k} {100 * fields_short[k] / short:.0f}%" for k in EXTRACT_FIELDS)
              + f"; summary facts {100 * short_facts[0] / max(1, short_facts[1]):.1f}%")
    for line in lines[:args.show] if not args.examples else lines:
        print(line)


if __name__ == "__main__":
    main()
