"""Pipeline stages: small classes, setup in `__init__`, `__call__(batch: pa.Table) -> pa.Table` does the work.

read -> parse -> tokenize are cheap, stateless tasks (Ray fuses them); `InferStage` is the actor that holds one
model replica and one continuous-batching engine, fed by several Ray batches at once (started by the run itself, see
pipeline/replicas.py); postprocess decodes and checks answers;
`WriteStage` commits each batch as one Parquet part and passes on only small stats rows for progress and the report.
Stages never raise for a bad document: they set its status (see pipeline/parse.py and pipeline/rows.py).
Each stage tells the run's progress board (pipeline/progress.py) as it moves on, for the stall watchdog: per
document where one document may take long (read, parse), per batch elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from clover_batch.connectors.attempts import Attempt, AttemptStore
from clover_batch.connectors.checkpoint import local_checkpoint
from clover_batch.connectors.faults import document_fault, fault_point
from clover_batch.connectors.fs import Location, read_bytes
from clover_batch.connectors.sink import stage_replacement, write_part
from clover_batch.pipeline.page_ranges import PAGES_PER_TASK, parse_document
from clover_batch.pipeline.parts import Answer, dumps_sources, merge_extractions, part_prompt, part_spans, pick_summary
from clover_batch.pipeline.postprocess import (
    FieldRule,
    check_extraction,
    extraction_instruction,
    field_confidence,
    strip_thinking,
    uncertain_words,
)
from clover_batch.pipeline.progress import NO_PROGRESS, REPLICA_LOAD, ProgressNote
from clover_batch.pipeline.rows import (
    OUTPUT_SCHEMA,
    STATS_SCHEMA,
    fail,
    guarded,
    timed,
    to_rows,
    to_table,
)
from clover_batch.pipeline.tokenizer import PromptBuilder

if TYPE_CHECKING:  # the model package (torch) is imported by the infer actor only, not by the cheap stages
    from clover_batch.model import DecodeOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelRef:
    """Where a replica gets its model and tokenizer."""

    source: str  # preset, folder or URI
    dtype: str = "float32"  # float32 | bfloat16
    storage_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None
    expert_parallel: int = 1  # ranks one replica's experts are spread over (rank 0 is the infer actor)
    overrides: dict[str, Any] = field(default_factory=dict)  # diffusion settings given by the job (load_config)
    enable_thinking: bool = False  # passed to the chat template

    def local(self) -> str:
        return local_checkpoint(self.source, self.storage_options, self.cache_dir)


@dataclass(frozen=True)
class TaskRef:
    """What to ask of each document."""

    kind: str  # summarize | extract
    instruction: str
    fields: tuple[FieldRule, ...] = ()  # extract only
    # a field (extract) or a word (summarize) whose least likely token is less likely than this is listed in the
    # row's uncertain_fields or uncertain_words
    uncertain_below: float = 0.5
    # task.parts: (document tokens per part, overlap); (0, 0): a document is answered whole only (pipeline/parts.py)
    parts: tuple[int, int] = (0, 0)

    def prompt_instruction(self) -> str:
        return (
            extraction_instruction(self.instruction, list(self.fields)) if self.kind == "extract" else self.instruction
        )


def _ok(row: dict[str, Any]) -> bool:
    return row["status"] == "ok"


class ReadStage:
    """Fetch each document's bytes (needs: source_uri, size)."""

    def __init__(self, storage_options: dict[str, Any], max_file_bytes: int, progress: ProgressNote = NO_PROGRESS):
        self.storage_options = storage_options
        self.max_file_bytes = max_file_bytes
        self.progress = progress

    RETRY_DELAYS_S = (0.5, 2.0, 8.0)

    def _read(self, uri: str) -> bytes:
        """read_bytes, retried on transient storage errors (a throttled or reset request must not become a final
        read_error row); a missing, forbidden or oversize file fails at once."""
        for delay in (*self.RETRY_DELAYS_S, None):
            try:
                return read_bytes(uri, self.storage_options, self.max_file_bytes)
            except (FileNotFoundError, PermissionError, IsADirectoryError, ValueError):
                raise
            except Exception as e:
                if delay is None:
                    raise
                log.warning("reading %s failed (%s: %s); retrying in %.1f s", uri, type(e).__name__, e, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = to_rows(batch)
        for row in rows:
            row["status"] = "ok"
            if row["size"] > self.max_file_bytes:
                fail(row, "too_large", f"{row['size']} bytes is over input.max_file_bytes={self.max_file_bytes}")
                continue
            with timed(row, "read"):
                try:
                    row["data"] = self._read(row["source_uri"])
                except Exception as e:  # storage errors are per document; the run goes on
                    fail(row, "read_error", f"cannot read: {type(e).__name__}: {e}")
            self.progress("read")
        return to_table(rows)


class ParseStage:
    """Bytes -> text (needs: data, source_uri). PDF, DOCX, HTML, EPUB and XPS documents are parsed in this worker's
    child process, each within `timeout_s` (pipeline/parse_process.py): a document that hangs or crashes its parser
    costs its own row, not the worker. A PDF, EPUB or XPS of more than `pages_per_task` pages is parsed as page
    ranges, Ray tasks of `range_cpus` CPUs each, `timeout_s` per range (pipeline/page_ranges.py). Sets `format`,
    `pages`, `text_source` and `page_sources` (how the text was obtained)."""

    def __init__(self, fallback_encoding: str | None, timeout_s: float = 300.0, max_pages: int | None = None, *,
                 pdf_text: str = "markdown", ocr: str = "auto", max_unpacked_bytes: int | None = None,
                 pages_per_task: int = PAGES_PER_TASK, range_cpus: float = 0.5,
                 progress: ProgressNote = NO_PROGRESS):
        self.progress = progress
        self.fallback_encoding = fallback_encoding
        self.timeout_s = timeout_s
        self.max_pages = max_pages
        self.pdf_text = pdf_text
        self.ocr = ocr
        self.max_unpacked_bytes = max_unpacked_bytes
        self.pages_per_task = pages_per_task
        self.range_cpus = range_cpus

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = to_rows(batch)
        for row in rows:
            if not _ok(row):
                continue
            with guarded(row, "parse"):
                with timed(row, "parse"):
                    parsed = parse_document(row["source_uri"], row["data"], timeout_s=self.timeout_s,
                                            fallback_encoding=self.fallback_encoding, max_pages=self.max_pages,
                                            pdf_text=self.pdf_text, ocr=self.ocr,
                                            max_unpacked_bytes=self.max_unpacked_bytes,
                                            pages_per_task=self.pages_per_task, range_cpus=self.range_cpus,
                                            progress=self.progress)
                row.update(format=parsed.format, pages=parsed.pages, data=None, text=parsed.text,
                           text_source=parsed.text_source, page_sources=parsed.page_sources)
                if parsed.status != "ok":
                    fail(row, parsed.status, parsed.error)
            self.progress("parse")
        return to_table(rows)


class TokenizeStage:
    """Text -> prompt token ids (needs: text); documents over the limit get `too_long`."""

    def __init__(self, model: ModelRef, task: TaskRef, max_input_tokens: int, progress: ProgressNote = NO_PROGRESS):
        self.progress = progress
        self.model = model
        self.instruction = task.prompt_instruction()
        self.max_input_tokens = max_input_tokens
        self._builder: PromptBuilder | None = None  # built on first use, in the worker

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self._builder is None:
            builder = PromptBuilder(self.model.local(), enable_thinking=self.model.enable_thinking)
            # Rendered here, outside the per-document guard: a template that fails is the checkpoint's problem and
            # fails the run (the driver checked it first), instead of writing a final error row for every document.
            builder.check(self.instruction)
            self._builder = builder
        rows = to_rows(batch)
        for row in rows:
            if not _ok(row):
                continue
            with guarded(row, "tokenize"):
                with timed(row, "tokenize"):
                    ids = self._builder.build(self.instruction, row["text"])
                row.update(text=None, input_tokens=len(ids),
                           doc_span=list(self._builder.document_span(self.instruction, len(ids))))
                if len(ids) > self.max_input_tokens:
                    fail(row, "too_long",
                         f"prompt is {len(ids)} tokens, over input.max_input_tokens={self.max_input_tokens}")
                else:
                    row["prompt_ids"] = ids
        self.progress("tokenize")
        return to_table(rows)


EP_MAX_RESTARTS = 2  # restarts in a row of an expert-parallel replica's workers before the run fails


class InferStage:
    """One model replica (a Ray actor, pipeline/replicas.py) and its continuous-batching engine, fed by several Ray
    batches at once.

    `infer` is async: the actor runs several calls concurrently, each hands its documents to the engine loop
    (pipeline/serving.py) and returns its rows once all of them finished, so the engine always has the next batch's
    documents to admit when a slot frees up. Its constructor takes small values only (specs, a URI, a run id), so
    Ray can always restart it.
    """

    def __init__(self, model: ModelRef, decode: DecodeOptions, num_threads: int, max_slots: int, page_size: int = 256,
                 output: Location | None = None, run_id: str = "", max_attempts: int = 2, job_name: str = "",
                 replica_index: int = 0, rank_num_cpus: float = 1.0, parts: tuple[int, int] = (0, 0),
                 progress: ProgressNote = NO_PROGRESS):
        """rank_num_cpus: the Ray CPU share of each expert-parallel worker rank (the run's resource plan may fit it
        to the cluster); parts: task.parts (tokens, overlap), (0, 0) for none (pipeline/parts.py); progress: where
        this replica's heartbeat goes while it loads (pipeline/progress.py)."""
        self.parts = parts
        # The watchdog cannot ask a replica that is still in its constructor: it sends its own heartbeat, from the
        # first line (importing torch and loading the model take long on a busy machine) until it can answer.
        with progress.beating(REPLICA_LOAD):
            self._start(model, decode, num_threads, max_slots, page_size, output, run_id, max_attempts, job_name,
                        replica_index, rank_num_cpus)

    def _start(self, model: ModelRef, decode: DecodeOptions, num_threads: int, max_slots: int, page_size: int,
               output: Location | None, run_id: str, max_attempts: int, job_name: str, replica_index: int,
               rank_num_cpus: float) -> None:
        import ray
        import torch
        from clover_batch.model import Engine, kernels, load_model
        from clover_batch.model.precision import checkpoint_dtype, choose_dtype
        from clover_batch.pipeline.metrics import ReplicaMetrics
        from clover_batch.pipeline.serving import EngineLoop

        device = "cuda" if torch.cuda.is_available() else "cpu"
        # model.dtype auto: the checkpoint's dtype where this device computes it fast (model/precision.py)
        choice = choose_dtype(model.dtype, checkpoint_dtype(model.local()), device)
        dtype = choice.dtype
        self.replica = None
        # Poison documents: attempts are written down as documents enter the engine (output/_attempts/), so one
        # that keeps killing this process ends as a `crashed` row instead of being retried by Ray forever.
        self.attempts = AttemptStore(output, run_id) if output is not None else None
        self.max_attempts = max_attempts
        self._uris: dict[str, str] = {}  # doc_id -> source URI of documents submitted (messages, test-only fault)
        self._past: dict[str, list[Attempt]] = {}  # doc_id -> its attempts on record when its batch came in
        on_admit = self._admitted if self.attempts is not None else None
        on_leave = self._left if self.attempts is not None else None

        def build() -> Engine:
            """On the engine thread: the replica's torch work all happens there (see pipeline/serving.py)."""
            kernels.model_threads(num_threads)
            if model.expert_parallel > 1:
                from clover_batch.pipeline.expert_parallel import group_prefix, load_replica

                self.replica = load_replica(model.local(), expert_parallel=model.expert_parallel, dtype=choice.name,
                                            device=device, num_threads=max(1, num_threads),
                                            num_cpus_per_rank=rank_num_cpus,
                                            group_prefix=f"{group_prefix(run_id)}{replica_index}-",
                                            num_gpus_per_rank=1.0 if device == "cuda" else 0.0,
                                            max_restarts=EP_MAX_RESTARTS, overrides=model.overrides)
                self.model = self.replica.model
            else:
                self.model = load_model(model.local(), device=device, dtype=dtype, overrides=model.overrides)
            return Engine(self.model, decode, max_slots=max_slots, page_size=page_size)

        # a dead worker rank of an expert-parallel replica: restart the workers, rerun what was in flight
        recover = (lambda: self.replica.restart()) if model.expert_parallel > 1 else None  # type: ignore[union-attr]
        self.metrics = ReplicaMetrics(job_name, replica_index) if ray.is_initialized() else None
        self.loop = EngineLoop(build, recover=recover, max_recoveries=EP_MAX_RESTARTS, on_admit=on_admit,
                               on_leave=on_leave, on_step=self.metrics.stepped if self.metrics else None)
        self.engine = self.loop.engine
        self.kernels = (f"{kernels.describe()}; CUDA graphs {'on' if self.engine.static else 'off'}; "
                        f"{self.model.dtype} on {device} ({choice.reason})")
        b = self.engine.slot_bytes
        log.info("replica loaded %s on %s: %d slots of %.1f MiB, %d pages of %d positions (%.2f MiB each)",
                 self.model.config.name, device, self.engine.num_slots, b.fixed / 2**20, self.engine.num_pages,
                 b.page_size, b.page / 2**20)

    def _admitted(self, entering: dict[str, bool]) -> None:
        """On the engine loop's records thread, before documents enter the engine: record their attempts. Their
        records go (`_left`, same thread, in order) as they come out, so a death alone is charged to its document
        only (pipeline/serving.py)."""
        # their past attempts as read when their batch came in, not again: a document taken back out of the
        # engine and re-admitted alone in this process (EngineLoop._isolate) did not die the first time
        known = all(d in self._past for d in entering)
        self.attempts.enter(entering, past={d: self._past[d] for d in entering} if known else None)
        for doc_id in entering:
            document_fault("crash_infer", self._uris.get(doc_id, ""))

    def _left(self, doc_ids: list[str]) -> None:
        """On the records thread, as documents came out of the engine (a result or an error): their records go."""
        try:
            self.attempts.finish(doc_ids)
        except Exception as e:  # a record left behind only makes its document run alone if it comes back
            log.warning("cannot remove the attempt records of %s: %s: %s",
                        ", ".join(self._uris.get(d, d) for d in doc_ids), type(e).__name__, e)

    async def _run_one(self, row: dict[str, Any], alone: bool):
        """The document's Generation, and with task.parts for a prompt longer than the window, each part's
        ((start, end) of the document's tokens, Generation)."""
        self._uris[row["doc_id"]] = row["source_uri"]
        prompt, name = row["prompt_ids"], row["doc_id"]
        try:
            start, end = row["doc_span"] or (0, len(prompt))
            spans = part_spans(end - start, len(prompt) - end, self.engine.window,
                               self.engine.options.max_new_tokens, *self.parts)
            gens = await asyncio.gather(
                self.loop.submit(prompt, name=name, alone=alone),
                *(self.loop.submit(part_prompt(prompt, start, end, s), name=name, alone=alone) for s in spans))
            return gens[0], list(zip(spans, gens[1:], strict=True))
        finally:
            self._uris.pop(row["doc_id"], None)
            self._past.pop(row["doc_id"], None)

    async def load(self) -> int:
        """Documents in this replica now (submitted to its engine loop, result not back yet)."""
        return self.loop.in_loop

    async def health(self):
        """The engine loop's state and step count (pipeline.serving.EngineHealth), for the run's stall watchdog;
        answered on the actor's event loop, so a stuck engine thread still answers."""
        return self.loop.health()

    async def infer(self, batch: pa.Table) -> pa.Table:
        """The batch's rows with their answers (or their failure); fails when the replica itself is broken."""
        from clover_batch.model import EngineCapacityError
        from clover_batch.model.expert_parallel import ExpertParallelError

        rows = to_rows(batch)
        todo = [r for r in rows if _ok(r)]
        if todo:
            past = {}
            if self.attempts is not None:
                past = await asyncio.to_thread(self.attempts.unfinished, [r["doc_id"] for r in todo])
            run = []
            for row in todo:
                attempts = past.get(row["doc_id"], [])
                if len(attempts) >= self.max_attempts and any(a.alone for a in attempts):
                    fail(row, "crashed", crashed_message(attempts, self.max_attempts))
                else:  # a document that was in the engine when its process died (a suspect) runs alone
                    self._past[row["doc_id"]] = attempts
                    run.append((row, bool(attempts)))
            results = await asyncio.gather(*(self._run_one(row, alone) for row, alone in run), return_exceptions=True)
            todo = [row for row, _ in run]
            for row, result in zip(todo, results, strict=True):
                if isinstance(result, ExpertParallelError | EngineCapacityError):
                    raise result  # the replica is broken or too small: not the documents' fault, so no rows for them
                if isinstance(result, BaseException):
                    fail(row, "inference_error", f"{type(result).__name__}: {result}")
                    continue
                gen, parts = result
                every = [gen, *(g for _, g in parts)]
                if self.metrics is not None:
                    for g in every:
                        self.metrics.generated(g)
                # the row's engine work is all its answers'
                prefill, decode = sum(g.prefill_seconds for g in every), sum(g.decode_seconds for g in every)
                tokens, decode_forwards = sum(len(g.tokens) for g in every), sum(g.decode_forwards for g in every)
                blocks, accepted = sum(g.verified_blocks for g in every), sum(g.accepted_tokens for g in every)
                full = sum(g.full_blocks for g in every)
                row["timings"] = {
                    **(row["timings"] or {}),
                    # this document's engine time: its prefill, and its share of every decode step it was in
                    "infer": prefill + decode,
                    "prefill": prefill,
                    "decode": decode,
                }
                row.update(
                    prompt_ids=None,
                    doc_span=None,
                    output_ids=list(gen.tokens),
                    output_tokens=tokens,
                    mean_logprob=gen.mean_logprob,
                    output_logprobs=gen.token_logprobs,
                    part_answers=[{"start": s, "end": e, "ids": list(g.tokens), "logprobs": g.token_logprobs}
                                  for (s, e), g in parts] or None,
                    parts=len(parts) or None,
                    windows=gen.windows,
                    forward_passes=sum(g.forward_passes for g in every),
                    denoising_steps=sum(g.denoising_steps for g in every),
                    decode_forwards=decode_forwards,
                    tokens_per_forward=tokens / decode_forwards if decode_forwards else None,
                    accepted_per_block=accepted / blocks if blocks else None,
                    full_block_share=full / blocks if blocks else None,
                    verified_blocks=blocks or None,
                    accepted_tokens=accepted or None,
                    full_blocks=full if blocks else None,
                    stopped=gen.stopped,
                    decode_batch=max(g.decode_batch for g in every),
                    kernels=self.kernels,
                )
            fault_point("inference")
        return to_table(rows)


def crashed_message(attempts: list[Attempt], max_attempts: int) -> str:
    """The `crashed` row's error: how often, where and when the process died with the document inside."""
    return (f"the model replica's process died {len(attempts)} times with this document in its engine, at least "
            f"once with no other document there (input.max_attempts={max_attempts}): "
            f"{'; '.join(a.describe() for a in attempts)}. Out of memory or a native crash (see the Ray logs of "
            f"those processes); not run again unless `run --retry-failed`")


class PostprocessStage:
    """Output ids -> text; extraction answers parsed and checked; run metadata stamped on every row."""

    def __init__(self, model: ModelRef, task: TaskRef, job_name: str, run_id: str,
                 progress: ProgressNote = NO_PROGRESS):
        self.model, self.task, self.job_name, self.run_id = model, task, job_name, run_id
        self.progress = progress
        self._builder: PromptBuilder | None = None

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self._builder is None:
            self._builder = PromptBuilder(self.model.local())
        rows = to_rows(batch)
        for row in rows:
            row.update(model=self.model.source, task=self.task.kind, job_name=self.job_name, run_id=self.run_id)
            if not _ok(row):
                continue
            with guarded(row, "postprocess"), timed(row, "postprocess"):
                if row["part_answers"]:
                    self._from_parts(row)
                    continue
                ids, logprobs = row["output_ids"] or [], row["output_logprobs"]
                text = self._builder.decode(ids)
                row["output_text"] = strip_thinking(text)
                row.update(output_ids=None, output_logprobs=None, min_logprob=min(logprobs) if logprobs else None)
                if self.task.kind == "extract":
                    checked = check_extraction(row["output_text"], list(self.task.fields))
                    row["output_json"] = checked.output_json
                    if checked.error:
                        row.update(status="invalid_output", error=f"extraction answer refused: {checked.error}")
                    elif logprobs:
                        self._confidence(row, text, ids, logprobs)
                elif logprobs:
                    row["uncertain_words"] = uncertain_words(text, row["output_text"], ids, logprobs,
                                                             self._builder.decode, self.task.uncertain_below)
        self.progress("postprocess")
        return to_table(rows)

    def _from_parts(self, row: dict[str, Any]) -> None:
        """A document answered whole and from its parts (task.parts, pipeline/parts.py): the row keeps, per field
        or whole, the answer the model was surest of, and says in `answer_parts` which parts it took."""
        assert self._builder is not None
        decode, task = self._builder.decode, self.task
        names = [f.name for f in task.fields]
        outputs = [(None, row["output_ids"] or [], row["output_logprobs"]),
                   *(((p["start"], p["end"]), p["ids"] or [], p["logprobs"]) for p in row["part_answers"])]
        row.update(output_ids=None, output_logprobs=None, part_answers=None)
        answers, raw, texts, first_error = [], [], [], None
        for span, ids, logprobs in outputs:
            text = decode(ids)
            answer = strip_thinking(text)
            raw.append(text)
            texts.append(answer)
            mean = sum(logprobs) / len(logprobs) if logprobs else None
            if task.kind != "extract":
                answers.append(Answer(span, mean))
                continue
            checked = check_extraction(answer, list(task.fields))
            if checked.error:
                first_error = first_error or checked.error
                answers.append(Answer(span, mean))
                continue
            confidence = field_confidence(text, answer, ids, logprobs, decode, names) if logprobs else None
            answers.append(Answer(span, mean, json.loads(checked.output_json), confidence))
        if task.kind != "extract":
            at = pick_summary(answers)
            span, ids, logprobs = outputs[at]
            row.update(output_text=texts[at], mean_logprob=answers[at].mean_logprob,
                       min_logprob=min(logprobs) if logprobs else None,
                       answer_parts=dumps_sources({"summary": list(span)} if span else {}))
            if logprobs:
                row["uncertain_words"] = uncertain_words(raw[at], texts[at], ids, logprobs, decode,
                                                         task.uncertain_below)
            return
        merged = merge_extractions(answers, names)
        if merged is None:
            row.update(output_text=texts[0], status="invalid_output",
                       error=f"extraction answer refused (the whole document's and each of its parts'): {first_error}")
            return
        values, confidence, sources = merged
        used = [i for i, a in enumerate(answers)  # the answers some field was taken from
                if (a.span is None and len(sources) < len(names)) or (a.span and list(a.span) in sources.values())]
        scored = [lp for i in used for lp in (outputs[i][2] or [])]
        output_json = json.dumps(values, ensure_ascii=False, sort_keys=True)
        # the model's own text where one answer gave every field, else the merged object
        row.update(output_json=output_json, output_text=texts[used[0]] if len(used) == 1 else output_json,
                   answer_parts=dumps_sources(sources), min_logprob=min(scored) if scored else None,
                   mean_logprob=sum(scored) / len(scored) if scored else None)
        if confidence:
            row["field_confidence"] = json.dumps(confidence, sort_keys=True)
            row["uncertain_fields"] = [n for n in names if n in confidence and confidence[n] < task.uncertain_below]

    def _confidence(self, row: dict[str, Any], text: str, ids: list[int], logprobs: list[float]) -> None:
        """field_confidence (each field's least likely token's probability) and uncertain_fields (those below
        task.uncertain_below), from the trunk's log-probabilities of the output tokens."""
        assert self._builder is not None
        names = [f.name for f in self.task.fields]
        confidence = field_confidence(text, row["output_text"], ids, logprobs, self._builder.decode, names)
        if confidence is None:
            return
        row["field_confidence"] = json.dumps(confidence, sort_keys=True)
        row["uncertain_fields"] = [n for n in names if n in confidence and confidence[n] < self.task.uncertain_below]


class WriteStage:
    """Commit each batch as one Parquet part; pass on small stats rows for progress and the run report.

    Rows that replace a document's failed row (`run --retry-failed`) are only staged here: the driver swaps them
    into the parts holding the old rows, one part at a time (connectors.sink.swap_in).
    """

    def __init__(self, output: Location, run_id: str, progress: ProgressNote = NO_PROGRESS):
        self.output, self.run_id = output, run_id
        self.progress = progress

    def __call__(self, batch: pa.Table) -> pa.Table:
        start = time.perf_counter()
        replaces = pc.fill_null(batch.column("replaces"), False)
        stats = []
        for mask, replacing in ((pc.invert(replaces), False), (replaces, True)):
            rows = batch.filter(mask)
            if not rows.num_rows:
                continue
            out = rows.select(OUTPUT_SCHEMA.names).cast(OUTPUT_SCHEMA)
            if replacing:
                part, staged = None, stage_replacement(self.output, out, self.run_id)
            else:
                part, staged = write_part(self.output, out, self.run_id), None
            for row in rows.select([n for n in STATS_SCHEMA.names if n in rows.column_names]).to_pylist():
                stats.append({**row, "part_uri": part, "replacement": staged})
            self.progress("write")
        seconds = time.perf_counter() - start
        for row in stats:
            row["write_seconds"] = seconds / max(1, len(stats))
        return to_table(stats, STATS_SCHEMA)
