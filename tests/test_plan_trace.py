"""difflm-plan's memory model against the peak of a real training step traced under fake tensors
(:mod:`difflm.plan.trace`): the same planned parts, within 10 %, across checkpointing, objectives and accumulation."""
from __future__ import annotations

import pytest

from conftest import compose_run

# the 125m block width at two blocks and a short sequence: fake tensors cost host time per operator only
SMALL = ["model=125m", "model.vocab_size=50304", "precision=bf16", "data.seq_len=256", "train.micro_batch_size=4",
         "train.global_batch_size=8"]
CASES = {
    "mdlm": [],
    "mdlm-full-ac": ["parallel.activation_checkpointing=full"],
    "mdlm-selective-ac-antithetic": ["parallel.activation_checkpointing=selective", "objective.t_sampling=antithetic"],
    "bd3lm-one-micro-batch": ["objective=bd3lm", "train.global_batch_size=4"],
    "bd3lm-full-ac": ["objective=bd3lm", "parallel.activation_checkpointing=full"],
    "ar": ["objective=ar"],
    # without Transformer Engine: F.cross_entropy's FP32 copies of the logits, traced and planned
    "mdlm-unfused-cross-entropy": ["model.fused_cross_entropy=false", "train.global_batch_size=4"],
    "mdlm-full-ac-unfused-cross-entropy": ["model.fused_cross_entropy=false", "parallel.activation_checkpointing=full"],
}


def _cfg(overrides):
    cfg = compose_run([*SMALL, "model.num_layers=2", *overrides])
    cfg.model.head_dim = cfg.model.hidden_size // cfg.model.num_heads
    return cfg


@pytest.mark.parametrize("name", list(CASES))
def test_planned_peak_is_within_ten_percent_of_the_traced_step(name):
    from difflm.plan.cli import layout_of
    from difflm.plan.memory import plan_memory
    from difflm.plan.shapes import model_params
    from difflm.plan.trace import traced_peak

    cfg = _cfg(CASES[name])
    layout = layout_of(cfg, 1)
    n_micro = int(cfg.train.global_batch_size) // layout.micro_batch
    plan = plan_memory(cfg, model_params(cfg.model, 50304), layout, n_micro)
    traced = traced_peak(cfg)
    assert traced.parts["Parameter"] == plan.parts["parameters"]  # the persistent parts are exact
    assert traced.parts["Optstate"] == pytest.approx(plan.parts["optimizer"], abs=64 * 4)  # the step scalars
    assert plan.total == pytest.approx(traced.peak_bytes, rel=0.10), (plan.phase, plan.parts, traced)


def test_the_fused_cross_entropy_keeps_no_fp32_logits():
    """TE's fused cross-entropy (its twin in the trace) against F.cross_entropy's FP32 copies: at a 50,304 vocabulary
    and few blocks the logits dominate, and the unfused step's peak is higher by at least the FP32 [N, V] copies
    that coexist at the log-softmax backward, planned and traced alike."""
    from difflm.plan.cli import layout_of
    from difflm.plan.memory import peak_loss_fraction, plan_memory
    from difflm.plan.shapes import model_params
    from difflm.plan.trace import traced_peak

    peaks, plans = {}, {}
    for fused in (True, False):
        cfg = _cfg(["train.global_batch_size=4", f"model.fused_cross_entropy={str(fused).lower()}"])
        layout = layout_of(cfg, 1)
        plans[fused] = plan_memory(cfg, model_params(cfg.model, 50304), layout, 1)
        peaks[fused] = traced_peak(cfg).peak_bytes
    # unfused, the peak is the loss's FP32 copies: 2 + 12 bytes a logit at the loss rows; fused, the logits fall
    # below the gradients the backward's end holds
    rows = plans[False].parts["logits"] / (50304 * (2 + 12))
    assert plans[False].phase == "loss" and plans[True].phase == "backward end"
    assert rows == pytest.approx(4 * 256 * peak_loss_fraction(_cfg([]).objective, 4, 4, 256))
    assert peaks[False] - peaks[True] == pytest.approx(plans[False].total - plans[True].total, rel=0.15)
    assert peaks[False] - peaks[True] > 0.15 * peaks[True]


@pytest.mark.parametrize("overrides, says", [
    (["precision=fp8"], "precision=fp8"),
    (["model=moe-tiny", "model.vocab_size=1000"], "model.moe.num_experts"),
])
def test_untraceable_runs_are_refused_in_one_line(overrides, says):
    from difflm.errors import DifflmError
    from difflm.plan.trace import traced_peak

    with pytest.raises(DifflmError, match=says) as err:
        traced_peak(compose_run([*SMALL, *overrides]))
    assert "\n" not in str(err.value)
