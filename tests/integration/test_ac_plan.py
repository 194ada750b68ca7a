"""Activation checkpointing planned and predicted for a GPU (the planner's default device:
fake CPU tensors with CUDA's kernel choices, :mod:`sharded_exp.measure.cuda_kernels`), for
every model family: ours, Hugging Face's three, and another Hugging Face class given by
``_target_``. Full and selective checkpointing each run their fake steps (the recomputation
in the backward saves what the forward saved) and hold less at the peak than no
checkpointing.

In-process and small: the shapes put the peak in the forward/backward (batch 16, 64
tokens, two blocks), where checkpointing acts; a fake step costs the same at any batch.
"""

from __future__ import annotations

import pytest

from sharded_exp.compose import compose
from sharded_exp.plan import points as plan
from sharded_exp.predict.prediction import model_shapes, predict, predict_peak

FAMILIES = {
    "gpt": ["model=gpt", "model.d_model=64", "model.n_heads=2", "model.seq_len=64"],
    "hf_bert": ["model=hf_bert"],
    "hf_gpt2": ["model=hf_gpt2"],
    "hf_llama": ["model=hf_llama"],
    # Any Hugging Face class by _target_ (model=custom), built from its config class: Qwen2,
    # whose grouped-query attention gives keys and values fewer heads than the queries.
    "hf_target": [
        "model=custom", "model._target_=transformers.Qwen2ForCausalLM", "data=causal_lm",
        "+model.seq_len=64", "+model.vocab_size=256", "+model.config._target_=transformers.Qwen2Config",
        "+model.config.vocab_size=256", "+model.config.hidden_size=64", "+model.config.intermediate_size=128",
        "+model.config.num_hidden_layers=2", "+model.config.num_attention_heads=4",
        "+model.config.num_key_value_heads=2", "+model.config.max_position_embeddings=64",
    ],
}  # fmt: skip
SHAPES = ["precision=bf16", "trainer.batch_size=16"]
LEVER = {"full": "ac", "selective": "ac_selective"}
"""The planner's lever for each ``trainer.activation_checkpointing``."""


@pytest.fixture(scope="module")
def planned():
    """The planned DDP row of a family under a lever combination, at one rank, for a GPU
    (``device="cuda"``, the default plan) or a CPU."""
    rows = {}

    def row(family: str, combo: str, device: str = "cuda") -> dict:
        if (family, combo, device) not in rows:
            cfg = compose([*FAMILIES[family], *SHAPES], config_name="plan")
            shapes = plan.model_shapes(cfg.model, cfg.optimizer)
            rows[family, combo, device] = plan.model_row(cfg, "ddp", 1, shapes, device, combo)
        return rows[family, combo, device]

    return row


@pytest.mark.parametrize(
    "family, mode",
    [
        pytest.param(f, m, id=f"{f}-{m}", marks=() if m == "full" or f == "gpt" else pytest.mark.slow)
        for f in FAMILIES
        for m in LEVER
    ],
)  # every family with full AC in the default tier; selective for gpt, the others with the slow tier
def test_a_gpu_plan_with_activation_checkpointing_holds_less(family, mode, planned):
    plain, checkpointed = planned(family, "none"), planned(family, LEVER[mode])
    assert plain["method"] == "fake step", plain["note"]
    assert checkpointed["method"] == "fake step", checkpointed["note"]
    assert checkpointed["activations_gib"] < plain["activations_gib"]
    assert checkpointed["total_gib"] < plain["total_gib"]


def test_selective_checkpointing_keeps_the_fused_attentions_outputs_on_a_gpu(planned):
    """Selective checkpointing keeps what the attention kernel returns (its output and
    float32 log-sum-exp), on CUDA as on the CPU. Our GPT (no mask, no dropout) runs a flash
    kernel on both, which return the same tensors: the kept activations are the same."""
    cpu, gpu = planned("gpt", "ac_selective", "cpu"), planned("gpt", "ac_selective")
    assert gpu["activations_gib"] == pytest.approx(cpu["activations_gib"], rel=1e-12)


@pytest.mark.slow  # the default tier's: the planner's rows above (the same fake step, every family with full AC),
# test_levers.py's real AC runs, and unit/predict/test_op_trace.py (the recomputed forward is counted apart)
def test_a_gpu_runs_prediction_with_activation_checkpointing():
    """A GPU run's parent predicts as the planner does (the same fake step) and counts FLOPs
    too: the model's, the same with checkpointing as without (the recomputed forward is
    not model work). One family: the steps are the planner's above, plus a third."""
    peaks = {}
    for mode in ("none", *LEVER):
        cfg = compose([*FAMILIES["hf_gpt2"], *SHAPES, f"trainer.activation_checkpointing={mode}"])
        shapes = model_shapes(cfg.model, cfg.optimizer)
        prediction = predict(cfg.strategy, cfg.optimizer, str(cfg.precision.name), shapes, 2)
        peaks[mode] = predict_peak(cfg, 2, "cuda", prediction, shapes)
        assert peaks[mode]["per_rank_mib"] is not None, (mode, peaks[mode]["error"])
    for mode in LEVER:
        assert max(peaks[mode]["per_rank_mib"]) < max(peaks["none"]["per_rank_mib"]), mode
        assert peaks[mode]["flops_per_step"] == peaks["none"]["flops_per_step"] > 0, mode
