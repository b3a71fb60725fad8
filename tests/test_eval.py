"""``difflm-eval``: the antithetic NELBO estimator's variance reduction, the exact AR NLL, and the CLI on a
briefly trained run. The lm-evaluation-harness adapter is tested when ``lm_eval`` is importable."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from difflm.evaluate import sequence_nelbo
from difflm.objectives import ARObjective, MDLMObjective
from tests.conftest import run_cli
from tests.dlm_helpers import objective_cfg, tiny_model

MASK = 47


class ContextModel(torch.nn.Module):
    """A stand-in for a trained model: it predicts the clean token more surely the more context is visible, so
    the conditional mean of the NELBO integrand varies with t (as for a real trained model; for an untrained
    one it is flat, L log V at every t, and no sampler of t can reduce anything)."""

    def __init__(self, clean: torch.Tensor, vocab: int = 48):
        super().__init__()
        self.clean, self.vocab = clean, vocab
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, logits_mask=None, **kw):
        visible = (input_ids != MASK).float().mean(dim=1)  # [B]
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits.scatter_(2, self.clean.expand_as(input_ids)[..., None], (8.0 * visible)[:, None, None].expand(-1, input_ids.shape[1], 1))
        return logits if logits_mask is None else logits[logits_mask]


def test_antithetic_draws_reduce_variance():
    torch.manual_seed(0)
    tokens = torch.randint(0, 40, (1, 128))
    model = ContextModel(tokens)
    obj = MDLMObjective(objective_cfg(), MASK)
    K, reps = 4, 100
    anti = torch.stack([sequence_nelbo(model, obj, tokens, [0], K, seed).mean() for seed in range(reps)])
    iid = []
    for seed in range(reps):  # K independent (t, mask) draws per estimate
        vals = []
        for d in range(K):
            b = obj.noise(tokens, [0], (seed, 9, d), 1, t_sampling="iid")
            logits = model(b.input_ids, b.loss_mask)
            vals.append((F.cross_entropy(logits, b.targets[b.loss_mask], reduction="none") * b.weights[b.loss_mask]).sum())
        iid.append(torch.stack(vals).mean())
    iid = torch.stack(iid).double()
    # the same expectation (within 4 standard errors) and a clearly smaller variance
    se = (anti.var() / reps + iid.var() / reps).sqrt()
    assert abs(float(anti.mean() - iid.mean())) < 4 * float(se)
    assert float(anti.var()) < 0.5 * float(iid.var()), (float(anti.var()), float(iid.var()))


def test_ar_estimate_is_the_exact_nll():
    model = tiny_model(causal=True)
    tokens = torch.randint(0, 40, (2, 12))
    est = sequence_nelbo(model, ARObjective(objective_cfg(name="ar"), MASK), tokens, [0, 1], 1, 0)
    logits = model(tokens)
    ref = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none").sum(1)
    assert torch.allclose(est[0].float(), ref, rtol=1e-5)


@pytest.mark.parametrize("objective", ["bd3lm"])
def test_eval_cli_on_trained_run(tmp_path, objective):
    text = tmp_path / "held_out.txt"
    text.write_text("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 20)
    run = tmp_path / "run"
    train = run_cli("difflm.train", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
                    "model.num_kv_heads=2", "model.ffn_hidden_size=64", "data.seq_len=32", f"objective={objective}",
                    "objective.block_size=8", "train.max_steps=2", "train.global_batch_size=2",
                    "train.micro_batch_size=2", "train.eval_every=0", "train.save_every=2", "logger.progress_bar=false",
                    "logger.num_samples=0", f"run.dir={run}", f"data.cache_dir={tmp_path / 'cache'}", "device=cpu",
                    timeout=300)
    assert train.returncode == 0, train.stderr[-2000:]
    out = tmp_path / "eval.json"
    res = run_cli("difflm.evaluate", f"run.dir={run}", f"data.path={text}", "eval.mc_samples=2", "eval.max_windows=4",
                  f"eval.output={out}", "device=cpu", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["objective"] == objective and got["windows"] == 4 and got["mc_samples"] == 2
    assert 5 < got["nelbo"] < 15 and got["ppl_bound"] > 1
    assert got["bits_per_byte"] == pytest.approx(got["nats_per_byte"] / 0.6931471805599453)
    # the same text as difflm-preprocess shards: the same windows, hence the same estimate
    from difflm.data.shards import run_preprocess
    from tests.conftest import compose_run

    run_preprocess(compose_run([f"input={text}", f"output={tmp_path / 'shards'}", "workers=1", "progress_bar=false"],
                               config_name="preprocess"))
    res = run_cli("difflm.evaluate", f"run.dir={run}", f"data.path={tmp_path / 'shards'}", "eval.mc_samples=2",
                  "eval.max_windows=4", f"eval.output={tmp_path / 'eval_shards.json'}", "device=cpu", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "eval_shards.json").read_text())["nelbo"] == got["nelbo"]
    bad = run_cli("difflm.evaluate", f"run.dir={tmp_path / 'nope'}", f"data.path={text}", timeout=120)
    assert bad.returncode == 2 and "run.dir=" in bad.stderr
    latin1 = tmp_path / "latin1.txt"  # issue 13 item 9: one line naming the file, the byte and its offset
    latin1.write_bytes(b"caf\xe9\n")
    bad = run_cli("difflm.evaluate", f"run.dir={run}", f"data.path={latin1}", "device=cpu", timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith(
        f"difflm: error: data.path: {latin1} is not UTF-8 text (byte 0xe9 at offset 3): ")
