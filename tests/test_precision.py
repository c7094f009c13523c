"""Mixed precision (issue 34): `model.dtype: auto` picks bf16 where the device computes it fast, and bf16 stays
within bounds of the fp32 reference, layer by layer, on the same weights.

Tolerances come from bf16's unit roundoff U = 2^-8 (8 significant bits): each value rounded to bf16 carries a
relative error of at most U. A decoder layer rounds its values at about six stages in sequence (the input norm's
output, the mixer's projections, its output projection, the residual add, the MLP's projections, the last residual
add), while everything that accumulates (GEMM sums, the GDN recurrence, softmaxes, norms) runs in fp32, so a layer's
output differs from the fp32 layer's by at most about 6U relative in the worst case (errors of random sign mostly
cancel; measured values are 1-2U). The bound is set at 8U per layer, and at 4 x 8U for the logits after four
layers (each layer's error passes through the next ones).
"""

from __future__ import annotations

import pytest
import torch
from clover_batch.model import DecodeOptions, Engine, Request, load_model
from clover_batch.model.precision import bf16_twin, checkpoint_dtype, choose_dtype, cpu_bf16_units

U = 2.0 ** -8  # bf16 unit roundoff
LAYER_BOUND = 8 * U  # one decoder layer (module docstring)
LOGITS_BOUND = 4 * LAYER_BOUND  # four layers, then the final norm and the lm_head


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("preset", ["tiny-clover", "tiny"])
def test_each_layer_in_bf16_stays_within_its_bound_of_fp32(preset):
    """Each decoder layer of the bf16 model, given the fp32 model's input to it (rounded to bf16), against the fp32
    layer: GDN and attention layers alike within LAYER_BOUND; the logits of the whole forward within
    LOGITS_BOUND; the causal forward and a preview (denoising) pass."""
    f32, b16 = bf16_twin(preset, seed=3)
    ids = torch.randint(4, f32.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[str, dict[int, torch.Tensor]] = {"f32": {}, "b16": {}}

    def keep_input(i):
        def hook(_module, args):
            inputs[i] = args[0].detach()
        return hook

    def feed_fp32_input(i):
        def hook(_module, args):
            return (inputs[i].to(torch.bfloat16), *args[1:])
        return hook

    def keep_output(side, i):
        def hook(_module, _args, out):
            outputs[side][i] = out[0].detach()
        return hook

    handles = []
    for i, (lf, lb) in enumerate(zip(f32.layers, b16.layers, strict=True)):
        handles += [lf.register_forward_pre_hook(keep_input(i)), lf.register_forward_hook(keep_output("f32", i)),
                    lb.register_forward_pre_hook(feed_fp32_input(i)), lb.register_forward_hook(keep_output("b16", i))]
    try:
        with torch.inference_mode():
            f32(ids, attention="causal")
            b16(ids, attention="causal")
    finally:
        for h in handles:
            h.remove()
    kinds = {}
    for i, kind in enumerate(f32.config.layer_types):
        err = _rel(outputs["b16"][i], outputs["f32"][i])
        kinds.setdefault(kind, []).append(err)
        assert outputs["b16"][i].dtype == torch.bfloat16
        assert err < LAYER_BOUND, f"layer {i} ({kind}): {err / U:.1f} U"
    assert set(kinds) == {"linear_attention", "full_attention"}
    with torch.inference_mode():
        for kwargs in ({"attention": "causal"}, {"preview": True} if f32.config.diffusion is not None else {}):
            lf, _ = f32(ids, **kwargs)
            lb, _ = b16(ids, **kwargs)
            assert _rel(lb, lf) < LOGITS_BOUND, kwargs


def test_bf16_engine_keeps_its_state_fp32_and_its_weights_and_keys_bf16():
    model = load_model("tiny-clover", seed=3, dtype=torch.bfloat16)
    engine = Engine(model, DecodeOptions(max_new_tokens=4, stop_token_ids=[], mode="autoregressive"), max_slots=2)
    engine.add(Request("a", list(range(5, 30))))
    while engine.has_work:
        engine.step()
    weights = {p.dtype for n, p in model.named_parameters() if p.dim() == 2}
    assert weights == {torch.bfloat16}
    slots = engine.slots
    assert {t.dtype for t in slots.recurrent if t is not None} == {torch.float32}  # GDN recurrent state
    assert {t.dtype for t in slots.keys if t is not None} == {torch.bfloat16}
    assert engine.runner.logits.dtype == torch.float32  # what confidence and mean_logprob read


def test_auto_takes_the_checkpoints_dtype_only_where_the_device_is_fast(tmp_path):
    (tmp_path / "config.json").write_text('{"dtype": "bfloat16"}')
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    assert checkpoint_dtype("tiny") is None
    choice = choose_dtype("auto", "bfloat16", "cpu")
    if cpu_bf16_units():  # this machine: AMX and AVX-512 BF16
        assert choice.dtype == torch.bfloat16 and "matrix units" in choice.reason
    else:
        assert choice.dtype == torch.float32 and "no bf16 matrix units" in choice.reason
    assert choose_dtype("auto", "float32", "cpu").dtype == torch.float32
    assert choose_dtype("auto", None, "cpu").dtype == torch.float32  # a preset's random weights
    assert choose_dtype("bfloat16", None, "cpu").dtype == torch.bfloat16  # what the job says, whatever the device
    assert choose_dtype("float32", "bfloat16", "cpu").reason == "model.dtype: float32 (set in the job)"
    with pytest.raises(ValueError, match=r"model\.dtype must be one of auto, float32, bfloat16"):
        choose_dtype("fp16", None, "cpu")


def test_the_cpu_units_agree_with_what_the_cpu_reports():
    flags = open("/proc/cpuinfo").read()
    units = cpu_bf16_units()
    assert (units is not None) == ("amx_bf16" in flags or "avx512_bf16" in flags)
