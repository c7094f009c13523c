"""`clover-batch model parity` against stand-in "authors' code": a Hugging Face remote-code folder made here.

The stand-in implements Clover with transformers' remote-code conventions (a PretrainedConfig and a PreTrainedModel
subclass named in config.json's auto_map, saved with save_pretrained) around our own layers, plus the adapter file
the harness calls for a preview and for block decoding. A faithful stand-in must match on every pass; one whose
preview differs must be caught on that pass alone, with exit code 1.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from clover_batch.jobs.cli import app
from clover_batch.jobs.parity import compare, run_parity
from typer.testing import CliRunner

CONFIGURATION = '''
from transformers import PretrainedConfig


class StandInCloverConfig(PretrainedConfig):
    model_type = "clover_moe"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
'''

MODELING = '''
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from clover_batch.model import CloverConfig, CloverModel

from .configuration_standin import StandInCloverConfig


class StandInCloverLM(PreTrainedModel):
    config_class = StandInCloverConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        ours = CloverConfig.from_json_dict(config.to_dict())
        self.model = CloverModel(ours)  # parameters model.embed_tokens, model.layers.*, model.lm_head
        self.post_init()

    def _init_weights(self, module):
        pass

    def forward(self, input_ids, output_hidden_states=False, **kwargs):
        hidden = []
        hooks = [layer.register_forward_hook(lambda _m, _i, o: hidden.append(o[0])) for layer in self.model.layers]
        try:
            logits, _ = self.model(input_ids, attention="causal")
        finally:
            for h in hooks:
                h.remove()
        states = None
        if output_hidden_states:
            states = (self.model.embed_tokens(input_ids), *hidden[:-1], self.model.norm(hidden[-1]))
        return CausalLMOutputWithPast(logits=logits, hidden_states=states)
'''

ADAPTER = '''
import torch

from clover_batch.model import generate

HISTORY_SHIFT = {shift}


def preview_logits(model, prompt_ids, block_ids):
    inner = model.model
    _, state = inner(torch.tensor([prompt_ids]))
    gdn = next(layer.linear_attn for layer in inner.layers if layer.kind == "linear_attention")
    with torch.no_grad():
        gdn.bd_softmax_history_bias.add_(HISTORY_SHIFT)  # a stand-in whose preview differs, when asked to
        logits, _ = inner(torch.tensor([block_ids]), state, preview=True)
        gdn.bd_softmax_history_bias.sub_(HISTORY_SHIFT)
    return logits[0]


def generate_blocks(model, prompt_ids, max_new_tokens):
    return generate(model.model, [prompt_ids], max_new_tokens=max_new_tokens, tokens_per_step=1,
                    stop_token_ids=[])[0].tokens
'''


def _stand_in(folder: Path, *, history_shift: float = 0.0) -> Path:
    folder.mkdir(parents=True)
    (folder / "configuration_standin.py").write_text(CONFIGURATION)
    (folder / "modeling_standin.py").write_text(MODELING)
    (folder / "clover_parity_adapter.py").write_text(textwrap.dedent(ADAPTER.format(shift=history_shift)))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "clover_moe", "architectures": ["StandInCloverLM"],
        "auto_map": {"AutoConfig": "configuration_standin.StandInCloverConfig",
                     "AutoModelForCausalLM": "modeling_standin.StandInCloverLM"}}))
    return folder


def test_a_faithful_implementation_matches_on_every_pass(tmp_path):
    report = run_parity(_stand_in(tmp_path / "code"), trust_remote_code=True)
    assert [p.name for p in report.passes] == ["prefill", "preview", "commit", "decode"]
    assert all(p.compared and p.ok for p in report.passes), report
    assert "GDN" in report.passes[0].detail and "attention" in report.passes[0].detail  # per layer kind
    assert report.exit_code == 0


def test_a_different_preview_is_caught_on_that_pass_and_exits_1(tmp_path):
    result = CliRunner().invoke(app, ["model", "parity", str(_stand_in(tmp_path / "code", history_shift=2.5)),
                                      "--trust-remote-code"], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    lines = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") >= 3}
    assert "MISMATCH" in lines["preview"]
    assert "match" in lines["prefill"] and "MISMATCH" not in lines["prefill"]
    assert "MISMATCH" not in lines["commit"]


def test_passes_without_an_entry_point_are_not_compared_and_exit_4():
    """What the child reports when the authors' code has no adapter: prefill and commit still compared."""
    logits = torch.randn(6, 10)
    ours = {"layer_kinds": torch.tensor([True, False]), "prefill.logits": logits, "commit.logits": logits,
            "prefill.layer.0": logits, "commit.layer.0": logits}
    theirs = {"prefill.logits": logits.clone(), "commit.logits": logits + 1e-6}
    status = {"prefill": "ok", "commit": "ok", "preview": "no preview_logits in an adapter (none given)",
              "decode": "no generate_blocks in an adapter (none given)"}
    report = compare(ours, theirs, status, 1e-4)
    assert {p.name: (p.compared, p.ok) for p in report.passes} == {
        "prefill": (True, True), "commit": (True, True), "preview": (False, False), "decode": (False, False)}
    assert report.exit_code == 4
    theirs["commit.logits"] = logits + 0.1
    assert compare(ours, theirs, status, 1e-4).exit_code == 1


def test_remote_code_runs_only_when_trusted(tmp_path):
    marker = tmp_path / "ran"
    code = _stand_in(tmp_path / "code")
    (code / "modeling_standin.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n" + MODELING)
    result = CliRunner().invoke(app, ["model", "parity", str(code)])
    assert result.exit_code == 2
    assert "--trust-remote-code" in result.output
    assert not marker.exists()
    with pytest.raises(Exception, match="no modeling_"):
        run_parity(tmp_path, trust_remote_code=True)
