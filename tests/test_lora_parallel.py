"""LoRA under DTensor tensor parallelism (difflm.parallel.tp_adapters, docs/lora.md "Layouts"): 2 gloo ranks against
one process: losses, the adapters' checkpoint, an exact resume and the merged export; the refusals of the rest."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import spawn_ranks
from omegaconf import OmegaConf

from difflm.config.schema import LoraConfig
from difflm.errors import DifflmError
from difflm.model.lora import check_lora_layout, is_adapter
from difflm.training.trainer import Trainer

CPU = torch.device("cpu")
LORA = ["lora=attn_mlp", "lora.rank=4", "lora.alpha=8", "objective.random_length_prob=0", "train.eval_every=0",
        "logger.log_every=1", "optim.lr=1e-2", "schedule.warmup_steps=0"]
MOE = ["model=moe-tiny", "lora.moe=adapt_experts"]  # routed and shared experts adapted, replicated over TP


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}


def run_trainers(runs, common: list[str], out: str, rank: int) -> None:
    """Each ``(name, overrides, stop_at)`` of ``runs`` as a Trainer in this rank's process group (one group for all:
    the trainer keeps an initialised one), then the group is destroyed. ``stop_at`` > 0: that many steps, then a save
    (the next Trainer of the same name resumes it); 0: ``fit``. Writes ``rank{rank}.pt`` under ``out``: per run, its
    trainable names, whether the optimizer holds exactly the adapters, and the step it resumed from."""
    import torch.distributed as dist
    from conftest import compose_run

    seen = {}
    for name, extra, stop_at in runs:
        cfg = compose_run([*common, *extra, f"run.dir={out}/{name}"])
        trainer = Trainer(cfg, cfg.run.dir, CPU)
        named = [(n, p) for part in trainer.model_parts for n, p in part.named_parameters()]
        seen[name] = sorted(n for n, p in named if p.requires_grad)
        optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
        seen[name + "_optimizer_is_adapters"] = optimized == {id(p) for n, p in named if is_adapter(n)}
        seen[name + "_resumed_from"] = trainer.resumed_from
        if stop_at:
            for _ in range(stop_at):
                trainer.train_step()
            trainer.save()
        else:
            trainer.fit()
        del trainer
    dist.destroy_process_group()
    torch.save(seen, Path(out) / f"rank{rank}.pt")


def _tp_worker(rank: int, world: int, port: int, out: str) -> None:
    """tp2 with sequence parallelism: 2 steps, saved, resumed by a new Trainer to step 4; then tp2 without it, and an
    MoE model with adapted experts under tp2."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import FAST

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    common = [*FAST, *LORA, "parallel=tp2", f"data.cache_dir={out}/cache"]
    steps = ["train.max_steps=4", "train.save_every=2"]
    runs = [("tp", steps, 2), ("tp", steps, 0),
            ("tp_nosp", ["train.max_steps=2", "train.save_every=0", "parallel.sequence_parallel=false"], 0),
            ("tp_moe", [*MOE, "train.max_steps=2", "train.save_every=0"], 0)]
    run_trainers(runs, common, out, rank)


@pytest.mark.slow
def test_tp2_adapters_equal_one_process_resume_and_export(fast_cfg, tmp_path):
    """The adapters' column/row layout gives one process's losses under tp2 (with and without sequence parallelism;
    an MoE model with adapted experts too),
    a TP checkpoint holds the single-process adapters, resumes exactly and exports the single-process merged model."""
    from safetensors.torch import load_file

    from difflm.generate import load_run
    from difflm.interop.export import export_checkpoint
    from difflm.model.lora import merged_state_dict

    single = fast_cfg(*LORA, "train.max_steps=4", "train.save_every=4", f"run.dir={tmp_path / 'single'}",
                      f"data.cache_dir={tmp_path / 'cache'}")
    Trainer(single, single.run.dir, CPU).fit()
    moe = fast_cfg(*LORA, *MOE, "train.max_steps=2", "train.save_every=0", f"run.dir={tmp_path / 'single_moe'}",
                   f"data.cache_dir={tmp_path / 'cache'}")
    Trainer(moe, moe.run.dir, CPU).fit()
    ranks = spawn_ranks(_tp_worker, 2, tmp_path)
    for r in ranks:
        assert r["tp"] and all(is_adapter(n) for n in r["tp"])  # the base stays frozen through the TP styles
        assert all(r[f"{run}_optimizer_is_adapters"] for run in ("tp", "tp_nosp", "tp_moe"))
        assert any("experts.lora" in n for n in r["tp_moe"]) and not any("router" in n for n in r["tp_moe"])
        assert r["tp_resumed_from"] == 2
    one, tp, nosp = losses(tmp_path / "single"), losses(tmp_path / "tp"), losses(tmp_path / "tp_nosp")
    assert sorted(tp) == [3, 4] and one[1] != one[4]  # the steps the resumed Trainer logged
    assert [tp[s] for s in (3, 4)] == pytest.approx([one[s] for s in (3, 4)], rel=1e-5, abs=1e-6)
    assert [nosp[s] for s in (1, 2)] == pytest.approx([one[s] for s in (1, 2)], rel=1e-5, abs=1e-6)
    one_moe, tp_moe = losses(tmp_path / "single_moe"), losses(tmp_path / "tp_moe")
    assert [tp_moe[s] for s in (1, 2)] == pytest.approx([one_moe[s] for s in (1, 2)], rel=1e-5, abs=1e-6)

    _, ref, _, _ = load_run(str(tmp_path / "single"), 4, CPU)
    _, got, _, _ = load_run(str(tmp_path / "tp"), 4, CPU)  # the TP checkpoint read by one process
    want = {k: v for k, v in ref.state_dict().items() if is_adapter(k)}
    have = {k: v for k, v in got.state_dict().items() if is_adapter(k)}
    assert sorted(have) == sorted(want) and any(v.abs().sum() > 0 for k, v in want.items() if k.endswith("lora_B"))
    for k in want:
        torch.testing.assert_close(have[k], want[k], atol=1e-5, rtol=1e-5, msg=k)
    out, step = export_checkpoint(tmp_path / "tp", tmp_path / "merged")
    exported = load_file(str(out / "model.safetensors"))
    merged = merged_state_dict(ref)
    assert step == 4 and set(exported) <= set(merged)
    for k, v in exported.items():
        torch.testing.assert_close(v, merged[k], atol=1e-5, rtol=1e-5, msg=k)


def test_layout_refusals_are_one_line():
    from difflm.parallel.mesh import ParallelDims

    def dims(**degrees):
        p = OmegaConf.create(dict(dict(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1, ep=1), **degrees))
        return ParallelDims.from_config(p, 2)

    lora = OmegaConf.structured(LoraConfig(rank=4, alpha=8.0))
    for key in ("pp", "cp"):  # accepted: tests/test_lora_layouts.py
        check_lora_layout(lora, dims(**{key: 2}), OmegaConf.create({"backend": "torch"}))
    check_lora_layout(lora, dims(tp=2), OmegaConf.create({"backend": "torch"}))  # accepted
    with pytest.raises(DifflmError, match=r"^LoRA \(lora.rank 4\) with parallel.tp=2 and model.backend=te: .*set model.backend"):
        check_lora_layout(lora, dims(tp=2), OmegaConf.create({"backend": "te"}))
    lora.dropout = 0.1
    with pytest.raises(DifflmError, match=r"^lora.dropout=0.1 with parallel.tp=2: .*set lora.dropout=0"):
        check_lora_layout(lora, dims(tp=2))
