"""Checks on the driver before any work: is the model source usable, and is its checkpoint what it claims?

`check_model(spec)` runs in `validate` and at the start of `run`, before the output lock, Ray or any worker:
- the config (a preset, or the checkpoint's config.json, with the job's model overrides) parses, the decode options
  suit it, and expert_parallel divides its experts;
- the checkpoint's own decode controls (generation_config.json: threshold, penalties, stop ids) become the defaults
  of the job's decode fields that the job leaves unset; the result says which (`ModelCheck`);
- a local checkpoint's safetensors headers match the config, tensor by tensor (no tensor data is read);
- the chat template renders in the sandbox for this job's instruction and places the document once: a template
  that tries to escape, or fails, stops the run here with the file named, not in every worker;
- the tokenizer's ids fit the model's vocabulary (an id past it would fail every document at inference).
A checkpoint given as a URI is checked from its small files (config.json, tokenizer files, chat template), fetched
into a temporary folder; its weights are checked where the replicas load them.
Whether the weights fit the device is checked where the device is, by `load_model` in each replica.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clover_batch.connectors.checkpoint import is_uri
from clover_batch.connectors.fs import Location
from clover_batch.jobs.spec import DecodeSpec, JobSpec
from pydantic import ValidationError

if TYPE_CHECKING:
    from clover_batch.model import CloverConfig

log = logging.getLogger(__name__)

# The small files of a checkpoint folder that the driver reads to check a URI checkpoint.
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "chat_template.jinja")
MAX_METADATA_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ModelCheck:
    """What the checks found out about the model."""

    config: CloverConfig  # with the job's overrides
    decode: DecodeSpec  # the job's decode section, the checkpoint's defaults filled in where the job sets nothing
    decode_sources: dict[str, str]  # decode field -> "generation_config.json:threshold", for those defaults


def check_model(spec: JobSpec) -> ModelCheck:
    """Raise a ConfigError, CheckpointError, ChatTemplateError or ValueError naming what is wrong with the model."""
    source = spec.model.source
    if is_uri(source):
        with tempfile.TemporaryDirectory(prefix="clover-preflight-") as folder:
            _fetch_metadata(source, spec.model.storage_options, folder)
            try:
                return _check_local(spec, folder, weights=False)
            except ValueError as e:  # name the checkpoint's own files, not the temporary copies
                raise type(e)(str(e).replace(folder, source.rstrip("/"))) from None
    return _check_local(spec, source.removeprefix("file://"), weights=True)


def effective_decode(spec: JobSpec, source: str) -> tuple[DecodeSpec, dict[str, str]]:
    """The job's decode section with the checkpoint's decode controls (model.vendor_decode_defaults) as defaults
    of the fields the job does not set. A value the checkpoint gets wrong is a ValueError naming file and key."""
    from clover_batch.model import vendor_decode_defaults

    if not os.path.isdir(source):
        return spec.decode, {}
    explicit = spec.decode.model_fields_set
    merged: dict[str, Any] = spec.decode.model_dump()
    sources: dict[str, str] = {}
    for name, (value, where) in vendor_decode_defaults(source).items():
        if name in explicit:
            continue
        try:
            DecodeSpec.model_validate({name: value})
        except ValidationError as e:
            raise ValueError(f"{spec.model.source.rstrip('/')}/{where.replace(':', ' key ', 1)}: {value!r} is not "
                             f"a valid decode.{name} ({e.errors()[0]['msg']}); set decode.{name} in the job") from None
        merged[name], sources[name] = value, where
    return DecodeSpec.model_validate(merged), sources


def _fetch_metadata(source: str, storage_options: dict, folder: str) -> None:
    fs, root = Location(source, storage_options).filesystem()
    root = root.rstrip("/")
    for name in METADATA_FILES:
        path = f"{root}/{name}"
        if not fs.exists(path):
            continue
        size = fs.size(path)
        if size is not None and size > MAX_METADATA_BYTES:
            raise ValueError(f"{source.rstrip('/')}/{name}: {size:,} bytes, over the limit of {MAX_METADATA_BYTES:,}")
        fs.get_file(path, os.path.join(folder, name))


def _check_local(spec: JobSpec, source: str, *, weights: bool) -> ModelCheck:
    from clover_batch.model import build_model, load_config
    from clover_batch.model.expert_parallel import check_expert_parallel
    from clover_batch.model.weights import check_checkpoint
    from clover_batch.pipeline.postprocess import FieldRule
    from clover_batch.pipeline.stages import TaskRef
    from clover_batch.pipeline.tokenizer import PromptBuilder

    config = load_config(source, spec.model.overrides())  # ConfigError names the source and the field
    decode, decode_sources = effective_decode(spec, source)
    try:
        decode.options().check(config)
    except ValueError as e:
        raise ValueError(f"decode: {e} (model {spec.model.source})") from None
    options = decode.options()
    if spec.task.parts is not None and options.diffusion(config) and not (config.diffusion and
                                                                          config.diffusion.logits_shift):
        raise ValueError(f"task.parts picks the answer the model scores likeliest, and decode.mode {options.mode} "
                         f"on model {spec.model.source} (no logits_shift: its causal logits do not score its "
                         f"outputs) scores none; use decode.mode verified or autoregressive, or leave task.parts out")
    if spec.model.expert_parallel > 1:
        check_expert_parallel(config, spec.model.expert_parallel)
    if weights and os.path.isdir(source):
        check_checkpoint(build_model(config), Path(source))
    builder = PromptBuilder(source, enable_thinking=spec.model.enable_thinking)
    fields = getattr(spec.task, "fields", {})
    task = TaskRef(spec.task.kind, spec.task.instruction,
                   tuple(FieldRule(n, f.type, f.description, f.required) for n, f in fields.items()))
    builder.check(task.prompt_instruction())  # ChatTemplateError names tokenizer_config.json (or the .jinja)
    vocab = builder.tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > config.vocab_size:
        raise ValueError(f"{spec.model.source.rstrip('/')}/tokenizer.json: {vocab} tokens, more than the model's "
                         f"vocab_size={config.vocab_size} in config.json; their ids would fail every document")
    log.info("model %s checked: config, %s chat template", spec.model.source,
             "sandboxed" if builder.template is not None else "plain")
    if decode_sources:
        log.info("decode defaults from the checkpoint: %s",
                 ", ".join(f"{k}={getattr(decode, k)!r} ({v})" for k, v in decode_sources.items()))
    return ModelCheck(config, decode, decode_sources)
