"""Row schemas of the pipeline: the working row every stage passes on, and the output row written to Parquet.

Every stage reads and returns the full working schema (explicit, so blocks always unify and all-null columns keep
their types). Status "ok" means "fine so far"; a stage that fails a document sets a named status and message and
later stages pass the row through untouched, so every document reaches the sink as exactly one row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa

log = logging.getLogger(__name__)

STAGES = ("read", "parse", "tokenize", "prefill", "decode", "infer", "postprocess")

# Failures of the infrastructure, not of the document: `run --retry-failed` runs these documents again.
INFRASTRUCTURE_STATUSES = ("read_error", "inference_error", "internal_error", "crashed")
# What a document itself can be refused for (pipeline/parse.py, the stages): a re-run would say the same.
DOCUMENT_STATUSES = ("too_large", "unsupported_format", "empty", "corrupt_pdf", "corrupt_file", "truncated_pdf",
                     "encrypted", "too_many_pages", "parse_timeout", "parse_crashed", "no_text", "binary",
                     "decode_error", "too_long", "invalid_output")
STATUSES = ("ok", *INFRASTRUCTURE_STATUSES, *DOCUMENT_STATUSES)
TIMINGS_TYPE = pa.struct([(s, pa.float64()) for s in STAGES])
# pipeline/parse.py PAGE_SOURCES: markdown, plain, ocr, plain_fallback (pages counted once each)
PAGE_SOURCES_TYPE = pa.struct([(s, pa.int32()) for s in ("markdown", "plain", "ocr", "plain_fallback")])

OUTPUT_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),  # sha256(source_uri + version)[:32]
        ("source_uri", pa.string()),
        ("version", pa.string()),  # etag, or mtime-size
        ("size", pa.int64()),  # bytes
        ("format", pa.string()),  # pdf | docx | html | epub | xps | text | markdown | <extension>
        ("pages", pa.int32()),  # PDF, EPUB and XPS pages, null for the others
        ("text_source", pa.string()),  # text | ocr | mixed: how parsing got the text; null when it got none
        ("page_sources", PAGE_SOURCES_TYPE),  # PDF, EPUB, XPS: pages whose text came from each method
        ("status", pa.string()),  # ok | named error kind
        ("error", pa.string()),  # message when status != ok
        ("output_text", pa.large_string()),
        ("output_json", pa.string()),  # extract: the checked JSON object as text
        ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()),  # tokens generated (task.parts: by all the document's answers, as below)
        ("mean_logprob", pa.float64()),  # mean log-probability of the output tokens under the model's causal trunk
        ("min_logprob", pa.float64()),  # the least likely output token's log-probability under the trunk
        # extract: each field's confidence, the probability of its value's least likely token under the trunk (a
        # JSON object, field -> probability), and the fields below task.uncertain_below; null where the model's
        # causal logits do not score its outputs (mean_logprob null) or the answer was refused
        ("field_confidence", pa.string()),
        ("uncertain_fields", pa.list_(pa.string())),
        # summarize: the words of output_text whose least likely token is below task.uncertain_below, in order
        ("uncertain_words", pa.list_(pa.string())),
        ("windows", pa.int32()),  # attention windows the prompt spanned
        # task.parts: the parts a document longer than the window was also answered from (null: answered whole
        # only), and where the row's answer came from: a JSON object, field (extract) or "summary" -> the document
        # tokens [start, end) of the part it was taken from; those not listed came from the whole document
        ("parts", pa.int32()),
        ("answer_parts", pa.string()),
        ("forward_passes", pa.int64()),
        ("denoising_steps", pa.int64()),
        ("decode_forwards", pa.int64()),  # forward passes of its decode steps (preview, check and commit forwards)
        ("tokens_per_forward", pa.float64()),  # output_tokens / decode_forwards
        # decode.mode verified: tokens each checked block kept (mean), and the share of blocks whose every drafted
        # token the trunk accepted; null in the other modes
        ("accepted_per_block", pa.float64()),
        ("full_block_share", pa.float64()),
        ("stopped", pa.string()),  # eos | length
        ("timings", TIMINGS_TYPE),  # seconds per stage; infer and decode are this document's share of its batch
        ("model", pa.string()),
        ("task", pa.string()),  # summarize | extract
        ("job_name", pa.string()),
        ("run_id", pa.string()),
    ]
)

WORK_SCHEMA = pa.schema(
    [
        *OUTPUT_SCHEMA,
        pa.field("data", pa.large_binary()),  # raw bytes, read -> parse
        pa.field("text", pa.large_string()),  # parsed text, parse -> tokenize
        pa.field("prompt_ids", pa.list_(pa.int32())),  # tokenize -> infer
    pa.field("doc_span", pa.list_(pa.int32())),  # tokenize -> infer: the document's tokens in prompt_ids [start, end)
    # infer -> postprocess (task.parts): each part's answer, its document tokens [start, end) and output
    pa.field("part_answers", pa.list_(pa.struct([("start", pa.int32()), ("end", pa.int32()),
                                                 ("ids", pa.list_(pa.int32())),
                                                 ("logprobs", pa.list_(pa.float64()))]))),
        pa.field("output_ids", pa.list_(pa.int32())),  # infer -> postprocess
        pa.field("output_logprobs", pa.list_(pa.float64())),  # infer -> postprocess: each output token's (trunk)
        pa.field("decode_batch", pa.int32()),  # infer -> stats: most documents decoded together with this one
        pa.field("kernels", pa.string()),  # infer -> stats: the kernels its replica ran (for the run report)
        pa.field("verified_blocks", pa.int64()),  # infer -> stats: verified drafts checked, tokens they verified,
        pa.field("accepted_tokens", pa.int64()),  # checks that rejected no drafted token (the run report's totals)
        pa.field("full_blocks", pa.int64()),
        pa.field("replaces", pa.bool_()),  # run --retry-failed: the new row replaces this document's failed one
    ]
)

STATS_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("status", pa.string()),
        ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("mean_logprob", pa.float64()),
        ("uncertain_fields", pa.list_(pa.string())),  # for the run report's count of rows unsure of something
        ("uncertain_words", pa.list_(pa.string())),
        ("parts", pa.int32()),  # task.parts: for the run report's count of documents answered from parts too
        ("answer_parts", pa.string()),
        ("timings", TIMINGS_TYPE),
        ("decode_batch", pa.int32()),
        ("kernels", pa.string()),
        ("decode_forwards", pa.int64()),
        ("verified_blocks", pa.int64()),
        ("accepted_tokens", pa.int64()),
        ("full_blocks", pa.int64()),
        ("part_uri", pa.string()),
        ("replacement", pa.string()),  # staged path of new rows for retried documents, for the driver's swap_in
        ("write_seconds", pa.float64()),
    ]
)


def to_rows(batch: pa.Table) -> list[dict[str, Any]]:
    return batch.to_pylist()


def to_table(rows: list[dict[str, Any]], schema: pa.Schema = WORK_SCHEMA) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)


def work_table(docs: pa.Table) -> pa.Table:
    """Working rows for listed documents (doc_id, source_uri, size, version, optionally replaces): the columns
    `docs` has, typed as WORK_SCHEMA, and nulls for the rest."""
    n = docs.num_rows
    return pa.table([docs.column(f.name).cast(f.type) if f.name in docs.column_names else pa.nulls(n, f.type)
                     for f in WORK_SCHEMA], schema=WORK_SCHEMA)


def fail(row: dict[str, Any], status: str, error: str) -> None:
    """Mark a row failed and drop its heavy payloads so they do not travel further."""
    row.update(status=status, error=error, data=None, text=None, prompt_ids=None, output_ids=None, part_answers=None)


@contextmanager
def guarded(row: dict[str, Any], stage: str) -> Iterator[None]:
    """One document's step: an unexpected failure becomes that row's `internal_error`, never the stage's crash.

    Without it one document that trips a bug (a parser edge case, a degenerate answer) would fail the Ray run on
    every re-run, since it stays pending: a poison document. Expected failures keep their own named statuses.
    """
    try:
        yield
    except Exception as e:
        log.exception("%s failed on %s", stage, row.get("source_uri"))
        fail(row, "internal_error", f"{stage}: {type(e).__name__}: {e}")


@contextmanager
def timed(rows: list[dict[str, Any]] | dict[str, Any], stage: str) -> Iterator[None]:
    """Add the seconds spent in the block to `timings[stage]` of one row or of each row of a batch."""
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    for row in rows if isinstance(rows, list) else [rows]:
        timings = dict(row.get("timings") or {})
        timings[stage] = (timings.get(stage) or 0.0) + seconds
        row["timings"] = timings
