"""The `clover-batch` command line: thin typer commands that each call one function.

Job commands (`validate`, `run`, `show`, `parse`) live here; model commands (`model init`, `model inspect`, `generate`)
live in `jobs/model_cli.py` and are mounted below. Library code logs; only this module draws on the screen.

`run` is a scheduler's task: its exit code is the outcome (jobs.runner.ExitCode), SIGINT and SIGTERM unwind the
run (its lock is released) before it exits 130 / 143, and with `--json` stdout carries the run report alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer
from clover_batch.jobs.model_cli import register_model_commands
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from clover_batch.jobs.runner import RunReport

app = typer.Typer(help="Run the Clover diffusion MoE model over collections of documents.", no_args_is_help=True)
register_model_commands(app)

console = Console()
err_console = Console(stderr=True)

JobArg = Annotated[str, typer.Argument(help="Path to the job YAML file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout and nothing else there; "
                                       "progress and logs go to stderr.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a job field: key.path=value (repeatable), e.g. resources.replicas=2."),
]


def _load(job: str, overrides: list[str] | None):
    from clover_batch.jobs.spec import JobSpecError, load_job

    try:
        return load_job(job, overrides or [])
    except JobSpecError as e:
        err_console.print(f"[red]{e}[/red]", highlight=False)
        raise typer.Exit(2) from None


@app.command()
def validate(job: JobArg, set_: SetOpt = None) -> None:
    """Check a job file and its model (config, checkpoint, chat template); print the resolved job, or what is
    wrong."""
    from clover_batch.jobs.preflight import check_model

    spec = _load(job, set_)
    console.print_json(json.dumps(masked(spec.model_dump(mode="json"))))
    try:
        check_model(spec)
    except (ValueError, OSError) as e:  # Config, Checkpoint, ChatTemplate errors; unreadable files: one line
        err_console.print(f"[red]{escape(f'{job}: model.source {spec.model.source}: {type(e).__name__}: {e}')}[/red]",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    console.print(f"[green]{escape(job)}: valid[/green]", highlight=False, soft_wrap=True)


SECRET_WORDS = ("secret", "key", "token", "password", "credential", "session")


def masked(value, *, inside_options: bool = False):
    """The job as printed: inside storage_options and Iceberg catalogs, credential-like values (key, secret, token,
    ...) become ***."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if inside_options and not isinstance(v, dict) and any(w in str(k).lower() for w in SECRET_WORDS):
                out[k] = "***"
            else:
                out[k] = masked(v, inside_options=inside_options or k in ("storage_options", "catalog"))
        return out
    if isinstance(value, list):
        return [masked(v, inside_options=inside_options) for v in value]
    return value


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt, so the run unwinds (and releases its lock)."""


def _terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def _stdout_kept_for(json_: bool) -> Iterator[Console]:
    """The console progress and tables go to. With --json: stderr, and while the run runs, file descriptor 1 points
    at stderr too, so whatever a library prints cannot land in the JSON document printed after it."""
    if not json_:
        yield console
        return
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # not a file (typer's CliRunner): nothing to move
        yield err_console
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    os.dup2(sys.stderr.fileno(), fd)
    try:
        yield err_console
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


@app.command()
def run(
    job: JobArg,
    set_: SetOpt = None,
    address: Annotated[
        str | None,
        typer.Option(help="Ray cluster: host:port (its GCS) or ray://host:port (Ray Client); default RAY_ADDRESS, "
                     "else a new local Ray."),
    ] = None,
    retry_failed: Annotated[
        bool,
        typer.Option("--retry-failed", help="Run again the documents whose row failed for reasons of the "
                     "infrastructure (read_error, inference_error, internal_error, crashed); each new row replaces "
                     "the old one."),
    ] = False,
    retry_status: Annotated[
        list[str] | None,
        typer.Option("--retry-status", help="With --retry-failed, or alone: retry rows of this status instead "
                     "(repeatable), e.g. --retry-status invalid_output."),
    ] = None,
    fail_on_status: Annotated[
        list[str] | None,
        typer.Option("--fail-on-status", help="Count rows of this document status as failures, exit 3 "
                     "(repeatable), besides the job's run.fail_on_status, e.g. --fail-on-status encrypted."),
    ] = None,
    json_: JsonOpt = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show library logs.")] = False,
) -> None:
    """Run a job: every new document of the input gets one row in the output's Parquet files.

    Exit codes, judged on the output's rows of every listed document (earlier runs' rows too):
    0 every document has a row and none failed;
    3 the run completed, but some rows are failures (read_error, inference_error, internal_error, crashed, or a
    status named in run.fail_on_status / --fail-on-status): rerun with --retry-failed;
    1 the run itself failed (model, storage, cluster, another run writing the output), stalled (nothing moved
    for run.stall_timeout_s: a diagnosis on stderr and in the run report), or the cluster did not grow to fit the
    job within run.startup_timeout_s;
    2 bad job file or usage, or a job whose resources can never fit the cluster (nothing was run);
    130 / 143 interrupted by SIGINT / SIGTERM (the output's lock released, finished rows kept).
    """
    from clover_batch.connectors.sink import OutputConflict
    from clover_batch.jobs.resources import PlanRefused
    from clover_batch.jobs.runner import DEFAULT_RETRY_STATUSES, ExitCode, Stalled, UsageError
    from clover_batch.jobs.runner import run as run_job

    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not verbose:
        # Ray Data logs each execution at INFO and warns that its bars are off: this CLI draws its own.
        import ray.data  # Ray Data sets its loggers' levels on import; ours must come after

        logging.getLogger("ray").setLevel(logging.WARNING)
        logging.getLogger("ray.data").setLevel(logging.ERROR)
    spec = _load(job, set_)
    retry = tuple(retry_status) if retry_status else DEFAULT_RETRY_STATUSES if retry_failed else ()
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[statuses]}"),
    ]
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with _stdout_kept_for(json_) as screen:
            with Progress(*columns, console=screen, transient=False) as bar:
                task_id = bar.add_task(spec.name, total=None, statuses="listing")

                def on_progress(p) -> None:
                    statuses = " ".join(f"{k}={v}" for k, v in sorted(p.by_status.items()))
                    bar.update(task_id, total=p.total, completed=p.done, statuses=statuses)

                result = run_job(spec, address=address, on_progress=on_progress, retry_statuses=retry,
                                 fail_on_status=fail_on_status or ())
            if not json_:
                _print_report(result.report)
                console.print(f"run report: {result.report_uri}", markup=False, highlight=False, soft_wrap=True)
    except (KeyboardInterrupt, Terminated) as e:
        code = ExitCode.INTERRUPTED if isinstance(e, KeyboardInterrupt) else ExitCode.TERMINATED
        err_console.print(f"[red]run interrupted ({'SIGINT' if code == ExitCode.INTERRUPTED else 'SIGTERM'}): "
                          "the output's lock is released and finished documents are kept; run again to go on[/red]",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(code) from None
    except (UsageError, OutputConflict, PlanRefused) as e:  # the job or the command line must change
        err_console.print(f"[red]{job}: {escape(str(e))}[/red]", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.BAD_JOB) from None
    except Stalled as e:  # the watchdog logged the diagnosis (stderr); the report holds it too
        if e.report_uri:
            err_console.print(f"run report with the diagnosis: {e.report_uri}", highlight=False, soft_wrap=True)
        err_console.print(f"{e} (finished documents are kept; run again to go on)", markup=False,
                          highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.RUN_FAILED) from None
    except Exception as e:  # a run-level failure (model cannot load, storage unreachable): say it plainly
        if verbose:
            raise
        import ray.exceptions

        message = _ray_message(e) if isinstance(e, ray.exceptions.RayError) else f"{type(e).__name__}: {e}"
        err_console.print(f"[red]run failed: {message}[/red]", highlight=False, soft_wrap=True)
        err_console.print("(rerun with --verbose for the traceback; finished documents are kept)")
        raise typer.Exit(ExitCode.RUN_FAILED) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    report = result.report
    if json_:
        typer.echo(json.dumps(report.to_json()))
    if report.failures:
        _print_failures(report, job)
    raise typer.Exit(report.exit_code)


def _print_failures(report: RunReport, job: str) -> None:
    infra = {s: n for s, n in report.failures.items() if s not in report.fail_on_status}
    named = {s: n for s, n in report.failures.items() if s in report.fail_on_status}
    counts = ", ".join(f"{s}={n}" for s, n in report.failures.items())
    err_console.print(f"[yellow]{sum(report.failures.values())} documents have failed rows ({counts})[/yellow]",
                      highlight=False, soft_wrap=True)
    if infra:
        err_console.print(f"{', '.join(infra)}: failures of the infrastructure; rerun with `clover-batch run {job} "
                          "--retry-failed` to run those documents again", highlight=False, soft_wrap=True)
    if named:
        err_console.print(f"{', '.join(named)}: named in fail_on_status; `--retry-status "
                          f"{' --retry-status '.join(named)}` runs those documents again", highlight=False,
                          soft_wrap=True)


def _ray_message(e: Exception) -> str:
    """A Ray error in one line. Its text is the remote traceback, whose last exception line is the cause (an actor
    that could not load its model says ActorDiedError first, the ConfigError naming the problem last)."""
    lines = str(e).splitlines() or [""]
    causes = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception): ", line)]
    if causes:
        name, _, text = causes[-1].partition(": ")
        return f"{name.rsplit('.', 1)[-1]}: {text} (in a Ray worker: {type(e).__name__})"
    return f"{type(e).__name__}: {lines[0]}"


def _print_report(report: RunReport) -> None:
    retried = f", {report.retried} retried" if report.retried else ""
    console.print(f"run {report.run_id}: {report.processed} processed{retried}, {report.skipped_done} already done")
    table = Table()
    table.add_column("status")
    table.add_column("documents", justify="right")
    for status, n in report.by_status.items():
        table.add_row(status, str(n))
    console.print(table)
    stages = Table(title="seconds per stage, summed over documents")
    for stage in report.stage_seconds:
        stages.add_column(stage, justify="right")
    stages.add_row(*(f"{v:.2f}" for v in report.stage_seconds.values()))
    console.print(stages)
    console.print(
        f"{report.wall_seconds:.1f} s wall, {report.documents_per_second:.2f} documents/s, "
        f"{report.output_tokens} output tokens ({report.output_tokens_per_second:.1f} tokens/s), "
        f"{report.output_rows} rows in the output; up to {report.max_decode_batch} documents decoded "
        "together"
    )
    if report.uncertain.get("unsure"):
        what = "fields" if report.job.get("task", {}).get("kind") == "extract" else "words"
        console.print(f"{report.uncertain['unsure']} of {report.uncertain['rows']} answers are unsure of some {what} "
                      f"(the rows' uncertain_{what}: below task.uncertain_below)", highlight=False)
    if report.parts.get("rows"):
        console.print(f"{report.parts['rows']} of {report.processed} documents were also answered from their parts "
                      f"(task.parts: longer than the attention window's reach); {report.parts['from_parts']} of them "
                      f"took their answer or some of its fields from a part (the rows' answer_parts)", highlight=False)
    for kernels in report.kernels:
        console.print(f"replica: {kernels}", highlight=False)
    if report.resources:
        console.print(f"resources: {report.resources['summary']}", highlight=False, markup=False)


@app.command()
def show(
    output: Annotated[str, typer.Argument(help="Output folder (path or URI) of a job.")],
    option: Annotated[
        list[str] | None, typer.Option("--option", "-o", help="fsspec storage option key=value (repeatable).")
    ] = None,
    samples: Annotated[int, typer.Option(help="Sample rows per status.")] = 2,
    catalog: Annotated[
        list[str] | None, typer.Option("--catalog", help="Iceberg output: a catalog property key=value that the "
                                       "output's _iceberg.json leaves out, such as a credential (repeatable).")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Show an output folder: rows by status and a few sample rows, from its Parquet parts or its Iceberg table.
    Exits 1 when it holds no committed rows."""
    import yaml
    from clover_batch.connectors.fs import Location
    from clover_batch.jobs.inspect_output import summarize_output

    options = {k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in option or [])}
    catalog_options = {k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in catalog or [])}
    summary = summarize_output(Location(output, options), samples=samples, catalog=catalog_options)
    if json_:
        typer.echo(json.dumps(dataclasses.asdict(summary)))
        raise typer.Exit(0 if summary.rows else 1)
    if not summary.rows:
        err_console.print(f"no committed rows under {output}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    files = "data files" if summary.format == "iceberg" else "parts"
    # a path or URI of any length, on one line (wrapping splits it where a terminal is narrow), never read as markup
    console.print(f"{summary.uri}: {summary.rows} rows in {summary.parts} {files}", markup=False, highlight=False,
                  soft_wrap=True)
    counts = Table()
    counts.add_column("status")
    counts.add_column("rows", justify="right")
    for status, n in summary.by_status.items():
        counts.add_row(status, str(n))
    console.print(counts)
    rows = Table(title="sample rows", show_lines=True)
    # the fields (extract) or words (summarize) whose least likely token was below task.uncertain_below
    unsure = [", ".join(r.get("uncertain_fields") or r.get("uncertain_words") or []) for r in summary.samples]
    doubts_column = ["unsure of"] if any(unsure) else []
    for col in ("source_uri", "status", "pages", "in", "out", "output / error", *doubts_column):
        rows.add_column(col, overflow="fold")
    for r, doubts in zip(summary.samples, unsure, strict=True):
        text = r["output_text"] if r["status"] == "ok" else r["error"]
        rows.add_row(
            r["source_uri"],
            r["status"],
            describe_page_sources(r.get("page_sources")),
            str(r["input_tokens"] or ""),
            str(r["output_tokens"] or ""),
            (text or "")[:200],
            *([doubts] if doubts_column else []),
        )
    console.print(rows)


class OcrChoice(StrEnum):
    auto = "auto"
    always = "always"
    never = "never"


class PdfTextChoice(StrEnum):
    markdown = "markdown"
    plain = "plain"


PARSE_FAILED = 1  # exit status of `parse` for a document whose status is not ok (2 is a usage error, as everywhere)


@app.command()
def parse(
    file: Annotated[str, typer.Argument(help="A document: local path or URI (s3://, gs://, az://, memory://).")],
    ocr: Annotated[
        OcrChoice | None,
        typer.Option(help="OCR of PDF pages: auto (pages without a usable text layer), always, never. "
                     "Default: the job's input.ocr, else auto."),
    ] = None,
    pdf_text: Annotated[
        PdfTextChoice | None,
        typer.Option("--pdf-text", help="PDF/EPUB/XPS text: markdown (layout, tables) or plain. Default: the job's "
                     "input.pdf_text, else markdown."),
    ] = None,
    job: Annotated[
        str | None,
        typer.Option(help="Take the input settings (storage_options, pdf_text, ocr, fallback_encoding, max_pages, "
                     "parse_timeout_s, max_file_bytes) from this job file; the options above override it."),
    ] = None,
    fallback_encoding: Annotated[
        str | None, typer.Option("--fallback-encoding", help="Encoding tried when a text file is not UTF-8.")
    ] = None,
    timeout: Annotated[float | None, typer.Option(help="Most seconds the parse may take (parse_timeout_s).")] = None,
    option: Annotated[
        list[str] | None, typer.Option("--option", "-o", help="fsspec storage option key=value (repeatable).")
    ] = None,
) -> None:
    """Print the text the model would be given for one document (before the prompt template).

    stdout is the text alone, so it pipes; the status and how the text was obtained go to stderr. Exit status: 0
    for an ok document, 1 for any other status (named on stderr, nothing on stdout), 2 for a usage error.
    """
    import dataclasses

    import yaml
    from clover_batch.jobs.parse_file import ParseSettings, parse_file

    settings = ParseSettings()
    if job is not None:
        spec = _load(job, None).input
        settings = ParseSettings(spec.storage_options, spec.max_file_bytes, spec.fallback_encoding,
                                 spec.parse_timeout_s, spec.max_pages, spec.pdf_text, spec.ocr, spec.pages_per_task)
    bad = [o for o in option or [] if "=" not in o]
    if bad or (timeout is not None and timeout <= 0):
        why = f"--option must be key=value, not {bad[0]!r}" if bad else "--timeout must be greater than 0"
        err_console.print(f"[red]{why}[/red]", highlight=False)
        raise typer.Exit(2)
    overrides = {"ocr": ocr.value if ocr else None, "pdf_text": pdf_text.value if pdf_text else None,
                 "fallback_encoding": fallback_encoding, "parse_timeout_s": timeout}
    settings = dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if option:
        extra = {k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in option)}
        settings = dataclasses.replace(settings, storage_options={**settings.storage_options, **extra})
    result = parse_file(file, settings)
    p = result.parsed
    if p.status != "ok":
        err_console.print(f"{file}: {p.status}: {p.error}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(PARSE_FAILED)
    sys.stdout.write(p.text)
    sys.stdout.flush()
    pages = "" if p.pages is None else f", {p.pages} page" + ("s" if p.pages != 1 else "")
    sources = f"; pages: {describe_page_sources(p.page_sources)}" if p.page_sources else ""
    err_console.print(
        f"{file}: ok ({p.format}{pages}; text from {p.text_source}; pdf_text={settings.pdf_text}, "
        f"ocr={settings.ocr}; {len(p.text)} characters in {result.seconds:.2f} s{sources})",
        markup=False, highlight=False, soft_wrap=True)


def describe_page_sources(sources: dict[str, int] | None) -> str:
    """'1950 markdown, 50 plain_fallback': the page_sources counts that are not zero (how each page's text was
    obtained)."""
    return ", ".join(f"{n} {name}" for name, n in (sources or {}).items() if n)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
