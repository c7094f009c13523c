"""The job file: a pydantic schema with a description on every field, loaded from YAML with `--set` overrides.

Validation errors name the field by its dotted path (`resources.replicas: Input should be greater than 0`);
unknown fields are errors everywhere (extra="forbid"), so a typo never silently becomes a default.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Annotated, Any, Literal

import yaml
from clover_batch.model.options import DecodeOptions
from clover_batch.pipeline.rows import INFRASTRUCTURE_STATUSES, STATUSES
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TableSpec(_Strict):
    """A table of documents (connectors/tables.py): one row per document, instead of a folder listing."""

    format: Literal["parquet", "json", "csv", "iceberg"] = Field(
        description="parquet, json (JSON Lines), csv: files read with pyarrow; iceberg: a table in a pyiceberg "
        "catalog (`identifier` and `catalog`)."
    )
    uri: str | None = Field(
        default=None,
        description="parquet, json, csv: a file or a folder of such files (local path or fsspec URI; "
        "input.storage_options apply).",
    )
    identifier: str | None = Field(default=None, description="iceberg: the table, `namespace.name`.")
    catalog: dict[str, Any] = Field(
        default={},
        description="iceberg: pyiceberg catalog properties (type: rest | glue | hive | sql, uri, warehouse, "
        "credentials...), as pyiceberg's load_catalog takes them.",
    )
    id_column: str = Field(
        default="id",
        description="The document's identity: its output row's doc_id (as a string). Must be present, non-null and "
        "unique, else the job is refused.",
    )
    text_column: str | None = Field(
        default=None,
        description="Column holding the document's text (strings), run as it is (no parsing). A row whose text "
        "changed since its result was written is run again and its row replaced. Default `text` when "
        "`uri_column` is not set; a null or empty text gives the row status `empty`.",
    )
    uri_column: str | None = Field(
        default=None,
        description="Column holding each document's URI: the file is read and parsed like a listed file, with "
        "every input option (pdf_text, ocr, max_pages...). A changed file (etag, else mtime and size) is run "
        "again and its row replaced.",
    )

    @model_validator(mode="after")
    def _source(self) -> TableSpec:
        if self.format == "iceberg":
            if not self.identifier or self.uri:
                raise ValueError("format iceberg takes `identifier` (namespace.name) and `catalog`, not `uri`")
        elif not self.uri or self.identifier:
            raise ValueError(f"format {self.format} takes `uri` (a file or folder), not `identifier`")
        if self.text_column and self.uri_column:
            raise ValueError("give text_column or uri_column, not both")
        return self

    @property
    def column(self) -> str:
        """The text or URI column read for each document."""
        return self.uri_column or self.text_column or "text"


class InputSpec(_Strict):
    uri: str | None = Field(
        default=None,
        description="Folder (or single file) holding the documents: a local path, s3://, gs://, az:// or memory:// "
        "URI. Give this or `table`.",
    )
    table: TableSpec | None = Field(
        default=None,
        description="A table of documents (Parquet, JSON Lines, CSV or Iceberg) with an id column and a text or "
        "URI column, instead of a folder. Give this or `uri`.",
    )
    include: list[str] = Field(
        default=["*"],
        description="Glob patterns a document must match. A pattern without "
        "'/' matches the file name, one with '/' the path relative to `uri`.",
    )
    exclude: list[str] = Field(default=[], description="Glob patterns that drop a document even if included.")
    storage_options: dict[str, Any] = Field(
        default={},
        description="fsspec options for the input filesystem, "
        "e.g. {endpoint_url, key, secret} for S3-compatible stores.",
    )
    max_file_bytes: int = Field(
        default=256 * 2**20,
        gt=0,
        description="Files larger than this get status `too_large` without being read; so does a DOCX, EPUB or XPS "
        "(zip archives) whose parts would unpack to more than this.",
    )
    max_input_tokens: int = Field(
        default=1_048_576,
        gt=0,
        description="Documents whose prompt is longer than "
        "this many tokens get status `too_long` instead of being run.",
    )
    fallback_encoding: str | None = Field(
        default=None,
        description="Encoding tried when a text file is not "
        "UTF-8 (e.g. 'cp1252'). Unset: such files get status `decode_error`.",
    )
    parse_timeout_s: float = Field(
        default=300,
        gt=0,
        description="Most seconds one page range (input.pages_per_task pages) or one shorter document may take to "
        "parse, OCR of its pages included. PDF, DOCX, HTML, EPUB and XPS documents are parsed in a child process of "
        "the worker; one that runs past this is stopped. A PDF, EPUB or XPS range (or short document) that runs out "
        "of time or crashes in Markdown mode is parsed again as plain text (its pages count as `plain_fallback` in "
        "`page_sources`); failing again gives the document status `parse_timeout` (or `parse_crashed`), naming the "
        "range. A DOCX or HTML document gets that status at once. A long document is never failed for its length: "
        "its limits are input.max_pages and input.max_input_tokens. The run goes on.",
    )
    pages_per_task: int = Field(
        default=25,
        gt=0,
        description="A PDF, EPUB or XPS with more pages than this is parsed as page ranges of this many pages, each "
        "a Ray task in its own parse process on whichever node has a free CPU, then joined in page order (the text "
        "is the same as one parse of the whole document). 25 pages cost 8-10 s of Markdown layout on an idle core and "
        "up to ~2 minutes of OCR if they are all scans; a range's own overhead is a fraction of a second (see "
        "docs/documents.md, 'What parsing costs').",
    )
    max_pages: int = Field(
        default=10_000,
        gt=0,
        description="PDFs (and EPUB, XPS) with more pages than this get status `too_many_pages` before any text is "
        "extracted or recognised. The default is past what input.max_input_tokens admits at ordinary page densities.",
    )
    pdf_text: Literal["markdown", "plain"] = Field(
        default="markdown",
        description="How PDF, EPUB and XPS pages become text: `markdown` (layout analysis by pymupdf4llm: headings, "
        "lists, reading order across columns, tables as Markdown tables) or `plain` (MuPDF's text in content order: "
        "a hundred times and more cheaper per page, tables come out one cell per line).",
    )
    ocr: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="OCR of PDF pages (RapidOCR, models shipped in its package, nothing downloaded): `auto` "
        "recognises pages with no usable text layer (scans, unreadable fonts) and leaves the others alone; "
        "`always` recognises every page and replaces its text layer; `never` does no OCR (a scan gets `no_text`). "
        "A recognised page costs about a second of CPU, counted in input.parse_timeout_s.",
    )
    max_attempts: int = Field(
        default=2,
        ge=1,
        description="A document inside a model replica's process when it died (out of memory, a native crash) "
        "this many times, at least once as the only document there, gets status `crashed` and is not run again "
        "(documents that only shared the process with it run again, alone, and are not charged).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> InputSpec:
        if (self.uri is None) == (self.table is None):
            raise ValueError("give input.uri (a folder of documents) or input.table (a table of them), not both")
        return self

    def source_uri(self) -> str:
        """What the documents come from: the folder, the table's files, or `iceberg:<identifier>`."""
        if self.table is None:
            return self.uri or ""
        return self.table.uri or f"iceberg:{self.table.identifier}"


class OutputSpec(_Strict):
    uri: str = Field(
        description="Folder for the Parquet result parts and run reports (local path or URI). With format iceberg it "
        "holds the run's lock, _job.json and _reports/ (and, by default, the embedded catalog and its warehouse)."
    )
    format: Literal["parquet", "iceberg"] = Field(
        default="parquet",
        description="parquet: committed parts in `uri`. iceberg: rows upserted on doc_id into the Iceberg table "
        "`table`, one snapshot per committed batch (connectors/iceberg.py).",
    )
    table: str | None = Field(default=None, description="format iceberg: the table, `namespace.name`.")
    catalog: dict[str, Any] = Field(
        default={},
        description="format iceberg: pyiceberg catalog properties (type: rest | glue | hive | sql, uri, warehouse, "
        "credentials...). Empty: a SQL catalog on `<uri>/catalog.db` (SQLite) with warehouse `<uri>/warehouse`.",
    )
    storage_options: dict[str, Any] = Field(default={}, description="fsspec options for the output filesystem.")
    rows_per_file: int = Field(
        default=64,
        gt=0,
        description="Rows per committed Parquet part (or Iceberg snapshot). Smaller parts lose "
        "less work when a run is killed; larger ones make fewer files.",
    )

    commit_interval_s: float = Field(
        default=10.0,
        ge=0,
        description="format iceberg: the driver commits the rows that came back as one snapshot once at least "
        "rows_per_file are waiting and this many seconds have passed since the last commit (and at the end). A "
        "snapshot per few seconds keeps the table's metadata small; a killed run loses at most this much work. "
        "0: a snapshot per rows_per_file rows.",
    )

    @model_validator(mode="after")
    def _table(self) -> OutputSpec:
        if self.format == "iceberg":
            if not self.table or not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)+", self.table):
                raise ValueError("format iceberg needs `table` as namespace.name (letters, digits, _)")
        elif self.table or self.catalog:
            raise ValueError("`table` and `catalog` are for format iceberg")
        return self


class ModelSpec(_Strict):
    source: str = Field(
        default="tiny",
        description="A preset name (tiny, tiny-ar, bench, bench-ar, "
        "clover-35b-a3b), a checkpoint folder, or a checkpoint URI (copied once per node).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="Weight, activation and GEMM dtype (recurrent state, softmaxes, router probabilities and the "
        "logits read for confidence stay fp32). auto: the checkpoint's dtype where the device computes it fast "
        "(CUDA with bf16; a CPU with AMX or AVX-512 BF16 units), else float32; the run report's kernels line says "
        "what was chosen and why.")
    storage_options: dict[str, Any] = Field(default={}, description="fsspec options when `source` is a URI.")
    cache_dir: str | None = Field(
        default=None,
        description="Local folder for checkpoints copied from URIs (default: ~/.cache/clover-batch/checkpoints).",
    )
    expert_parallel: int = Field(default=1, ge=1, description="Devices one replica's experts are spread over.")
    block_size: int | None = Field(
        default=None, ge=1,
        description="Diffusion block size, when the checkpoint's config.json / generation_config.json does not give "
        "it (or gives it wrong); unset: the checkpoint's.",
    )
    mask_token_id: int | None = Field(
        default=None, ge=0, description="Id of the mask token of a diffusion checkpoint; unset: the checkpoint's."
    )
    logits_shift: bool | None = Field(
        default=None,
        description="Whether a masked position is read from the previous position's logits (next-token models such "
        "as Clover: true) or its own; unset: the checkpoint's (Clover's layout: true).",
    )
    coreset_size: int | None = Field(
        default=None, ge=1,
        description="Clover's preview: route each block's tokens within the block's expert coreset of this many "
        "experts (the public record's reading of the rule); unset: the checkpoint's, else unrestricted routing.",
    )
    enable_thinking: bool = Field(
        default=False,
        description="Render the chat template with enable_thinking (Qwen3.6-family templates think by default); any "
        "<think>...</think> block is removed from output_text before the answer is read.",
    )

    def overrides(self) -> dict[str, Any]:
        """The model settings that override the checkpoint's (load_config), those that are set."""
        return {k: v for k, v in (("block_size", self.block_size), ("mask_token_id", self.mask_token_id),
                                  ("logits_shift", self.logits_shift), ("coreset_size", self.coreset_size))
                if v is not None}


class ExtractField(_Strict):
    type: Literal["string", "integer", "number", "boolean", "list[string]"] = Field(
        description="JSON type the answer must give for this field."
    )
    description: str = Field(default="", description="What the field means; shown to the model.")
    required: bool = Field(default=True, description="Whether a missing value makes the row `invalid_output`.")


def _uncertain_below(what: str):
    return Field(default=0.5, ge=0.0, le=1.0, description=f"{what}; 0 lists none.")


class PartsSpec(_Strict):
    """`task.parts`: a document longer than the model's attention window is also answered part by part, and the
    row keeps what the model was surest of (pipeline/parts.py)."""

    tokens: int = Field(ge=16, description="Document tokens per part (with the instruction and the template's end, "
                        "the part's prompt must fit the model's attention window with room for the answer).")
    overlap: int = Field(default=0, ge=0, description="Tokens each part shares with the one before it, so a fact "
                         "shorter than this lies whole in some part; less than `tokens`.")

    @model_validator(mode="after")
    def _overlap(self) -> PartsSpec:
        if self.overlap >= self.tokens:
            raise ValueError(f"overlap={self.overlap} must be less than tokens={self.tokens}")
        return self


def _parts(what: str):
    return Field(default=None, description=f"Off by default. A document that attention does not see whole from the "
                 f"answer (the tokens before the model's attention window, less `decode.max_new_tokens`) is also asked "
                 f"the same question from parts of those tokens (the instruction, then the part), each part within "
                 f"one window, and the row keeps {what}; `answer_parts` says which parts it took. For documents whose "
                 f"facts the model's recurrent state does not carry past the window; costs a prefill of those tokens "
                 f"per part they lie in and a decode per part (pipeline/parts.py).")


class SummarizeTask(_Strict):
    """`task.kind: summarize`: one summary per document, in `output_text`."""

    kind: Literal["summarize"] = Field(description="Summarize each document.")
    instruction: str = Field(
        default="Summarize the document.",
        min_length=1,
        description="Instruction placed before the document in the prompt.",
    )
    uncertain_below: float = _uncertain_below(
        "A word of the summary whose least likely token had a lower probability under the model is listed in the "
        "row's `uncertain_words`")
    parts: PartsSpec | None = _parts("the answer (whole or from a part) with the highest mean log-probability")


class ExtractTask(_Strict):
    """`task.kind: extract`: named fields per document, as one JSON object in `output_json`."""

    kind: Literal["extract"] = Field(description="Extract named fields from each document as JSON.")
    instruction: str = Field(
        default="Extract the following fields from the document.",
        min_length=1,
        description="Instruction placed before the field list in the prompt.",
    )
    fields: dict[str, ExtractField] = Field(
        min_length=1,
        description="Fields to extract: name -> type and "
        "description. The answer must be one JSON object with these keys.",
    )
    uncertain_below: float = _uncertain_below(
        "A field whose value's least likely token had a lower probability under the model is listed in the row's "
        "`uncertain_fields` (each field's probability is in `field_confidence`)")
    parts: PartsSpec | None = _parts("per field the value whose least likely token was likeliest "
                                     "(`field_confidence`)")

    @model_validator(mode="after")
    def _field_names(self) -> ExtractTask:
        for name in self.fields:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"field name {name!r} must be an identifier (letters, digits, underscore)")
        return self


class _DecodeBase(_Strict):
    def options(self) -> DecodeOptions:
        """The engine's typed options (the bounds were already checked by this schema)."""
        return DecodeOptions(**self.model_dump())


def _decode_spec() -> type[_DecodeBase]:
    """The job's `decode` section, built from DecodeOptions' own fields: names, types, defaults, bounds and help
    exist once, in clover_batch.model.options."""
    hints = typing.get_type_hints(DecodeOptions)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(DecodeOptions):
        bounds = {k: f.metadata[k] for k in ("ge", "gt", "le") if k in f.metadata}
        fields[f.name] = (hints[f.name], Field(default=f.default, description=f.metadata["help"], **bounds))
    return create_model("DecodeSpec", __base__=_DecodeBase, **fields)


DecodeSpec = _decode_spec()


class ResourcesSpec(_Strict):
    replicas: int = Field(default=1, ge=1, description="Model replicas (Ray actors) in the inference pool.")
    gpus_per_replica: float = Field(default=0, ge=0, description="GPUs reserved per replica (0 on CPU).")
    cpus_per_replica: float = Field(
        default=1, gt=0, description="CPUs reserved per replica; also the torch thread count of the replica."
    )
    batch_size: int = Field(
        default=4,
        ge=1,
        description="Documents per Ray batch handed to a replica. A replica keeps several batches in flight, so "
        "this is not how many it decodes at once (see max_slots); small batches stream results sooner.",
    )
    max_slots: int = Field(
        default=16,
        ge=1,
        description="Documents one replica decodes at once (its engine's slots, continuous batching). Fewer are "
        "used if the replica's memory cannot hold this many (each slot holds a document's fixed-size state: the "
        "recurrent state and its decode block; attention keys and values are in pages, see kv_page_tokens).",
    )
    kv_page_tokens: int = Field(
        default=256,
        ge=1,
        description="Positions per page of attention keys and values. A replica's memory holds slots (each "
        "document's fixed recurrent state) and a pool of pages that documents take as they grow and give back as "
        "their window slides, so short documents do not pay for the whole window. Up to 128, or a multiple of 128 "
        "(flex attention's key blocks).",
    )

    @model_validator(mode="after")
    def _page_tokens(self) -> ResourcesSpec:
        if self.kv_page_tokens > 128 and self.kv_page_tokens % 128:
            raise ValueError(f"kv_page_tokens must be at most 128 or a multiple of 128, got {self.kv_page_tokens}")
        return self


STALL_TIMEOUT_S = 900  # run.stall_timeout_s's default; docs/operations.md, 'A run never hangs', says why


class RunSpec(_Strict):
    startup_timeout_s: float = Field(
        default=600,
        ge=0,
        description="On a cluster the run joined (an address, RAY_ADDRESS), most seconds to wait for the cluster to "
        "grow until the job's resource plan fits (an autoscaler adding nodes); past it the run fails (exit 1). "
        "0: refuse at once (exit 2), for a cluster of fixed size. A Ray the run starts itself cannot grow: a plan "
        "that does not fit it is refused at once.",
    )
    stall_timeout_s: float = Field(
        default=STALL_TIMEOUT_S,
        ge=0,
        description="The run is stalled, and fails (exit 1, with a diagnosis), after this many seconds with no "
        "committed row, no engine step of any replica, no document read or parsed and no loading replica's "
        "heartbeat. Must be more than input.parse_timeout_s (a document may parse that long) and than one prefill "
        "chunk's forward on the slowest replica. 0 turns the watchdog off.",
    )
    fail_on_status: list[str] = Field(
        default=[],
        description="Document statuses that fail the run like infrastructure failures: `clover-batch run` exits 3 "
        "when a listed document's row has one (e.g. [encrypted, too_long]). By default only "
        f"{', '.join(INFRASTRUCTURE_STATUSES)} do, and document failures are data. `--fail-on-status` adds more.",
    )

    @field_validator("fail_on_status")
    @classmethod
    def _known_statuses(cls, value: list[str]) -> list[str]:
        unknown = [s for s in value if s not in STATUSES]
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not a row status (known: {', '.join(STATUSES)})")
        if "ok" in value:
            raise ValueError("ok: a run whose documents succeed is not a failure")
        return value


class JobSpec(_Strict):
    name: str = Field(
        min_length=1,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Job name, recorded in every output row (letters, digits, . _ -).",
    )
    input: InputSpec = Field(description="Where the documents are.")
    output: OutputSpec = Field(description="Where the results go.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="Which model runs.")
    task: Annotated[SummarizeTask | ExtractTask, Field(discriminator="kind")] = Field(
        description="What to do with each document: summarize or extract."
    )
    decode: DecodeSpec = Field(default_factory=DecodeSpec, description="Decoding options.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Actor pool resources.")
    run: RunSpec = Field(default_factory=RunSpec, description="What the run's outcome (its exit code) counts, and "
                         "how long it waits for a cluster or for progress.")

    @model_validator(mode="after")
    def _stall_after_parse(self) -> JobSpec:
        # A document may legitimately parse for input.parse_timeout_s with nothing else moving (one replica, idle)
        if self.run.stall_timeout_s and self.run.stall_timeout_s <= self.input.parse_timeout_s:
            raise ValueError(f"run.stall_timeout_s ({self.run.stall_timeout_s:g}) must be more than "
                             f"input.parse_timeout_s ({self.input.parse_timeout_s:g}): one document may parse that "
                             f"long, and would be taken for a stall")
        return self


class JobSpecError(ValueError):
    """A job file that cannot be used; `problems` has one 'field.path: message' line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"invalid job {source}:\n" + "\n".join(f"  {p}" for p in problems))


def _field_path(loc: tuple) -> str:
    # Drop the discriminator tag pydantic inserts for tagged unions ("task.summarize.instruction").
    parts = [str(p) for i, p in enumerate(loc) if not (i == 1 and loc[0] == "task" and p in ("summarize", "extract"))]
    return ".".join(parts) or "(job)"


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.path=value` overrides; values are parsed as YAML scalars (2 -> int, true -> bool)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise JobSpecError("--set", [f"{item!r}: expected key.path=value"])
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise JobSpecError("--set", [f"{key}: {part} is not a mapping"])
            node = child
        node[leaf] = yaml.safe_load(value) if value else ""
    return raw


def parse_job(raw: Any, source: str = "job") -> JobSpec:
    if not isinstance(raw, dict):
        raise JobSpecError(source, ["(job): the job file must be a YAML mapping"])
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        raise JobSpecError(source, [f"{_field_path(err['loc'])}: {err['msg']}" for err in e.errors()]) from None


def load_job(path: str, overrides: list[str] | None = None) -> JobSpec:
    """Read, override and validate a job file."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise JobSpecError(path, [f"(file): {e.strerror}"]) from None
    except yaml.YAMLError as e:
        raise JobSpecError(path, [f"(yaml): {e}"]) from None
    return parse_job(apply_overrides(raw or {}, overrides or []), path)
