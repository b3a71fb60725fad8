"""Vocab-parallel LM head and cross-entropy (difflm.parallel.vocab_parallel) on CPU with gloo, tp = 2.

* The cross-entropy from vocabulary slices equals ``F.cross_entropy`` on the full logits within 1e-6, gradients too.
* A whole model under tp2 (torch kernels with DTensor TP, TE kernels on the CPU stand-in, with and without sequence
  parallelism): each rank's logits are its [N, V/tp] slice, and the weighted loss (``weighted_ce_sum``) and every
  parameter's gradient (in single-process form) equal one process's within 1e-6; ``gather_logits`` gives the full
  logits for sampling.
* TE comm/GEMM overlap wiring: with ``ub_tokens`` the TE kernels create the userbuffers once, before the modules, with
  the token x hidden shape and the FP8 + BF16 buffers of an FP8 run, and pass TransformerLayer's ``ub_*`` arguments.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import compose_run, spawn_ranks
from fixtures.fake_te_env import fake_te  # noqa: F401  (pytest fixture)
from difflm.errors import DifflmError

TP, N, V = 2, 13, 64
MODEL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=64", "model.qk_norm=true", "data.seq_len=8", "train.global_batch_size=2",
         "train.micro_batch_size=2", "device=cpu", "train.seed=9", "parallel=tp2"]
KINDS = {"torch_sp": ("torch", True), "torch_no_sp": ("torch", False), "te_sp": ("te", True),
         "te_no_sp": ("te", False)}
FAKE_TE = str(Path(__file__).resolve().parent / "fixtures" / "fake_te")


def ce_inputs():
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(N, V, generator=gen)
    targets = torch.randint(0, V, (N,), generator=gen)
    upstream = torch.rand(N, generator=gen)
    return logits, targets, upstream


def model_config(backend: str, sp: bool):
    cfg = compose_run([*MODEL, f"model.backend={backend}", f"parallel.sequence_parallel={str(sp).lower()}"])
    cfg.model.vocab_size, cfg.model.head_dim = V, 8
    return cfg


def batch():
    from difflm.objectives import NoisedBatch

    gen = torch.Generator().manual_seed(1)
    b, s = 2, 8
    mask = torch.rand(b, s, generator=gen) < 0.6
    weights = torch.where(mask, 1 + torch.rand(b, s, generator=gen), torch.zeros(b, s))
    return NoisedBatch(input_ids=torch.randint(0, V, (b, s), generator=gen),
                       targets=torch.randint(0, V, (b, s), generator=gen), loss_mask=mask, weights=weights,
                       t=torch.zeros(b), num_tokens=torch.full((b,), float(s)))


def build(backend: str, sp: bool, ub_tokens=None):
    """The tp2 model of ``backend`` on this rank, built on meta and materialised (build_parallel_model's steps)."""
    from difflm.model import Transformer
    from difflm.model.te_kernels import TEKernels
    from difflm.parallel.materialize import materialize
    from difflm.parallel.mesh import ParallelDims, build_mesh, te_process_groups
    from difflm.parallel.parallelize import build_parallel_model, parallelize

    cfg = model_config(backend, sp)
    dims = ParallelDims.from_config(cfg.parallel, TP)
    mesh = build_mesh(dims, "cpu")
    if backend == "torch":
        parts, _, _, _ = build_parallel_model(cfg, mesh, dims, torch.device("cpu"), causal=False, n_microbatches=1)
        return parts, mesh
    groups = te_process_groups(mesh, dims, sp)
    if ub_tokens is not None:
        groups["ub_tokens"] = ub_tokens
    model = Transformer(cfg.model, kernels=TEKernels(cfg.model, "meta", cfg.precision, **groups))
    parts, _ = parallelize(model, mesh, dims, cfg, torch.device("cpu"), 1)
    return materialize(parts, torch.device("cpu"), cfg.model, cfg.train.seed), mesh


def full_grads(parts, group, sp: bool, te: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient in single-process form (full tensors, [gate; up], TP partial sums added)."""
    from torch.distributed.tensor import DTensor

    from difflm.parallel.te_tensor_parallel import all_reduce_partial_grads
    from difflm.parallel.tensor_parallel import canonical_layouts, canonical_state_dict, clean_fqn

    if te:
        all_reduce_partial_grads(parts, group, sp)
    grads = {}
    for name, p in parts[0].named_parameters():
        g = p.grad
        if isinstance(g, DTensor):
            g = g.redistribute(p.device_mesh, p.placements).full_tensor()
        grads[clean_fqn(name)] = g
    canonical_state_dict(grads, None, canonical_layouts(parts))
    return grads


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sys.path.insert(0, FAKE_TE)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from difflm.objectives import weighted_ce_sum
        from difflm.parallel.vocab_parallel import gather_logits, vocab_parallel_cross_entropy

        group = dist.group.WORLD
        results = {}
        logits, targets, upstream = ce_inputs()
        local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
        ce = vocab_parallel_cross_entropy(local, targets, group)
        (ce * upstream).sum().backward()
        results["ce"], results["ce_grad"] = ce.detach(), local.grad
        for kind, (backend, sp) in KINDS.items():
            import transformer_engine.pytorch.module.base as ub

            ub.destroy_ub()
            ub.calls.clear()
            parts, mesh = build(backend, sp, ub_tokens=16 if kind == "te_sp" else None)
            model, noised = parts[0], batch()
            logits = model(noised.input_ids, noised.loss_mask)
            loss = weighted_ce_sum(logits, noised, "token", 2, vocab_group=mesh["tp"].get_group())
            loss.backward()
            with torch.no_grad(), gather_logits(parts):
                full = model(noised.input_ids, noised.loss_mask)
            results[kind] = {"logits_shape": tuple(logits.shape), "loss": loss.detach(), "full_logits": full,
                             "grads": full_grads(parts, mesh["tp"].get_group(), sp, backend == "te")}
            if kind == "te_sp":
                qkv = model.layers[0].attention.qkv
                results[kind]["ub_calls"] = [dict(c, quantization_modes=[m.name for m in c["quantization_modes"]])
                                             for c in ub.calls]  # plain data: the test process has no TE
                results[kind]["ub_args"] = {"qkv": qkv.ub_args, "proj": model.layers[0].attention.proj.ub_args,
                                            "mlp": model.layers[0].mlp.ub_args}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab_parallel")
    return spawn_ranks(_worker, TP, out)


@pytest.fixture(scope="module")
def single():
    """One process, torch kernels: loss, logits and gradients of the same batch."""
    from difflm.model import build_model
    from difflm.objectives import weighted_ce_sum

    cfg = model_config("torch", True)
    model = build_model(cfg.model, causal=False, device=torch.device("cpu"), seed=cfg.train.seed)
    noised = batch()
    logits = model(noised.input_ids, noised.loss_mask)
    loss = weighted_ce_sum(logits, noised, "token", 2)
    loss.backward()
    return {"loss": loss.detach(), "logits": logits.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_vocab_parallel_cross_entropy_matches_one_process(tp2):
    logits, targets, upstream = ce_inputs()
    full = logits.clone().requires_grad_()
    reference = F.cross_entropy(full, targets, reduction="none")
    (reference * upstream).sum().backward()
    for rank, res in enumerate(tp2):
        torch.testing.assert_close(res["ce"], reference.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(res["ce_grad"], full.grad.chunk(TP, dim=-1)[rank], rtol=0, atol=1e-6)


@pytest.mark.slow  # its fixture starts processes: make test-fast leaves it out
@pytest.mark.parametrize("kind", list(KINDS))
def test_tp2_model_loss_and_gradients_match_one_process(kind, tp2, single):
    for res in tp2:
        got = res[kind]
        n = int(batch().loss_mask.sum())
        assert got["logits_shape"] == (n, V // TP)  # no rank holds full-vocabulary logits
        assert abs(float(got["loss"]) - float(single["loss"])) < 1e-6
        torch.testing.assert_close(got["full_logits"], single["logits"], rtol=0, atol=1e-5)
        assert set(got["grads"]) == set(single["grads"])
        for name, grad in single["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=f"{kind}: {name}")


@pytest.mark.slow  # its fixture starts processes: make test-fast leaves it out
def test_te_userbuffers_are_created_once_and_passed_to_the_modules(tp2):
    got = tp2[0]["te_sp"]
    assert got["ub_calls"] == [dict(shape=[16, 32], tp_size=TP, quantization_modes=["NONE"],
                                    dtype=torch.bfloat16, bootstrap_backend="nccl")]
    assert got["ub_args"]["qkv"] == dict(ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True, ub_name="qkv")
    assert got["ub_args"]["proj"] == dict(ub_overlap_rs=True, ub_overlap_ag=True, ub_name="proj")
    assert got["ub_args"]["mlp"] == dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_bulk_dgrad=True,
                                         ub_bulk_wgrad=True)



def test_fp8_runs_get_fp8_and_bf16_userbuffers_once(fake_te, monkeypatch):
    import transformer_engine.pytorch.module.base as ub

    from difflm.model import te_kernels

    monkeypatch.setattr(te_kernels, "_UB_SHAPE", None)
    monkeypatch.delenv("UB_SKIPMC", raising=False)
    ub.destroy_ub()
    ub.calls.clear()
    te_kernels.initialize_userbuffers(64, 32, 2, fp8=True)
    assert [m.name for m in ub.calls[0]["quantization_modes"]] == ["FP8", "NONE"]  # BF16 blocks of an FP8 run too
    assert os.environ["UB_SKIPMC"] == "1"  # CUDA IPC, never NVLink multicast
    te_kernels.initialize_userbuffers(64, 32, 2, fp8=True)  # the same buffers: nothing new
    assert len(ub.calls) == 1
    with pytest.raises(DifflmError, match="userbuffers exist"):
        te_kernels.initialize_userbuffers(128, 32, 2, fp8=True)
    monkeypatch.setattr(te_kernels, "_UB_SHAPE", None)  # TE refuses (buffers made elsewhere): one line
    with pytest.raises(DifflmError, match="could not create its userbuffers .UB communicators are already"):
        te_kernels.initialize_userbuffers(64, 32, 2, fp8=False)
    ub.destroy_ub()
