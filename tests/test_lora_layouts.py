"""LoRA under pipeline, context and expert parallelism (docs/lora.md "Layouts"): 2 gloo ranks against one process:
losses, each rank's optimizer, the adapters' checkpoint, an exact resume (pp2) and the merged export.

CP has no CPU attention kernel (PyTorch's ring attention runs the CUDA SDPA kernels only,
:mod:`difflm.parallel.context_parallel`), so the CP run swaps in :func:`cpu_cp_context`: the same contiguous sequence
chunks, sharded in place, with each rank's queries attending to the all-gathered keys and values (exact attention).
The rest of the CP layout (sequence-sharded batches, FSDP2 over dp_shard x cp, the gradients of the adapters) is
difflm's own."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import spawn_ranks
from test_lora_parallel import LORA, MOE, losses, run_trainers
from torch.overrides import TorchFunctionMode

from difflm.model.lora import is_adapter
from difflm.training.trainer import Trainer

CPU = torch.device("cpu")


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim -2 over ``group``; backward sums the gradient over the ranks and keeps this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=-2)[dist.get_rank(ctx.group)], None


class _GatheredKeysValues(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` of this rank's queries against every CP rank's keys and values."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        assert kwargs.get("attn_mask") is None and not kwargs.get("is_causal")  # bidirectional, unmasked only
        q, k, v = args[:3]
        return func(q, _GatherSequence.apply(k, self.group), _GatherSequence.apply(v, self.group), *args[3:], **kwargs)


def cpu_cp_context(cp_mesh, buffers, seq_dims, causal):
    """CPU stand-in of :func:`difflm.parallel.context_parallel.torch_cp_context` for bidirectional attention."""
    n, r = cp_mesh.size(), cp_mesh.get_local_rank()
    for buf, dim in zip(buffers, seq_dims):
        size = buf.shape[dim] // n
        buf.set_(buf.narrow(dim, r * size, size).clone())
    return _GatheredKeysValues(cp_mesh.get_group())


def _worker(rank: int, world: int, port: int, out: str) -> None:
    """pp2: 2 steps, saved, resumed by a new Trainer to step 4; cp2 (CPU stand-in) 4 steps; ep2 with adapted experts
    2 steps; each saved at its last step."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import FAST

    import difflm.parallel.context_parallel as context_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    context_parallel.cp_unavailable_reason = lambda *_: None
    context_parallel.torch_cp_context = cpu_cp_context
    common = [*FAST, *LORA, f"data.cache_dir={out}/cache"]
    pp = ["parallel=pp2", "train.max_steps=4", "train.save_every=2"]
    runs = [("pp", pp, 2), ("pp", pp, 0), ("cp", ["parallel=cp2", "train.max_steps=4", "train.save_every=4"], 0),
            ("ep", ["parallel=ep2", *MOE, "train.max_steps=2", "train.save_every=2"], 0)]
    run_trainers(runs, common, out, rank)


def _assert_same_adapters(run, ref_run, step):
    """The adapters of checkpoint ``step`` of ``run`` (read by one process) are those of ``ref_run``'s."""
    from difflm.generate import load_run

    _, ref, _, _ = load_run(str(ref_run), step, CPU)
    _, got, _, _ = load_run(str(run), step, CPU)
    want = {k: v for k, v in ref.state_dict().items() if is_adapter(k)}
    have = {k: v for k, v in got.state_dict().items() if is_adapter(k)}
    assert sorted(have) == sorted(want) and any(v.abs().sum() > 0 for k, v in want.items() if k.endswith("lora_B"))
    for k in want:
        torch.testing.assert_close(have[k], want[k], atol=1e-5, rtol=1e-5, msg=k)
    return ref


@pytest.mark.slow
def test_pp2_cp2_ep2_adapters_equal_one_process(fast_cfg, tmp_path):
    """Each pp2 stage trains the adapters of its own blocks (only those in its optimizer), cp2 and ep2 (routed
    experts' adapters sharded with the experts) give one process's losses; their checkpoints hold the single-process
    adapters, pp2 resumes exactly and exports the single-process merged model."""
    from safetensors.torch import load_file

    from difflm.interop.export import export_checkpoint
    from difflm.model.lora import merged_state_dict

    cache = f"data.cache_dir={tmp_path / 'cache'}"
    single = fast_cfg(*LORA, "train.max_steps=4", "train.save_every=4", f"run.dir={tmp_path / 'single'}", cache)
    Trainer(single, single.run.dir, CPU).fit()
    moe = fast_cfg(*LORA, *MOE, "train.max_steps=2", "train.save_every=2", f"run.dir={tmp_path / 'single_moe'}", cache)
    Trainer(moe, moe.run.dir, CPU).fit()
    ranks = spawn_ranks(_worker, 2, tmp_path)
    stage0, stage1 = ranks[0]["pp"], ranks[1]["pp"]
    assert stage0 and all(n.startswith("layers.0.") for n in stage0) and all(n.startswith("layers.1.") for n in stage1)
    for r in ranks:
        assert all(r[f"{run}_optimizer_is_adapters"] for run in ("pp", "cp", "ep")) and r["pp_resumed_from"] == 2
        assert sorted(stage0 + stage1) == r["cp"] and all(is_adapter(n) for n in r["cp"])
        assert any("experts.lora" in n for n in r["ep"]) and all(is_adapter(n) for n in r["ep"])
    one, pp = losses(tmp_path / "single"), losses(tmp_path / "pp")
    assert sorted(pp) == [3, 4] and one[1] != one[4]  # the steps the resumed Trainer logged
    assert [pp[s] for s in (3, 4)] == pytest.approx([one[s] for s in (3, 4)], rel=1e-5, abs=1e-6)
    cp, ep, one_moe = losses(tmp_path / "cp"), losses(tmp_path / "ep"), losses(tmp_path / "single_moe")
    assert [cp[s] for s in range(1, 5)] == pytest.approx([one[s] for s in range(1, 5)], rel=1e-5, abs=1e-6)
    assert [ep[s] for s in (1, 2)] == pytest.approx([one_moe[s] for s in (1, 2)], rel=1e-5, abs=1e-6)

    _assert_same_adapters(tmp_path / "cp", tmp_path / "single", 4)
    _assert_same_adapters(tmp_path / "ep", tmp_path / "single_moe", 2)
    ref = _assert_same_adapters(tmp_path / "pp", tmp_path / "single", 4)
    out, step = export_checkpoint(tmp_path / "pp", tmp_path / "merged")
    exported, merged = load_file(str(out / "model.safetensors")), merged_state_dict(ref)
    assert step == 4 and set(exported) <= set(merged) and exported
    for k, v in exported.items():
        torch.testing.assert_close(v, merged[k], atol=1e-5, rtol=1e-5, msg=k)
