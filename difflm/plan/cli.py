"""``difflm-plan``: memory, step time, tokens/s and MFU of a run on N GPUs, before renting them.

    difflm-plan model=8b parallel=fsdp data.seq_len=4096 train.global_batch_size=256 train.micro_batch_size=2 \\
        precision=bf16 --gpus 64 --gpu H100
    difflm-plan model=8b data.seq_len=4096 train.global_batch_size=256 precision=bf16 --gpus 64 --search --top 10
    difflm-plan model=1.7b data.seq_len=4096 --calibrate h200.json     # on the GPU: measure its rates
    difflm-plan ... --calibration h200.json                             # plan with measured rates

The overrides are ``difflm-train``'s (the same config tree, composed and checked the same way; ``--config-dir
my_conf`` adds your own presets as it does for difflm-train); ``parallel.*``
gives the layout, ``-1`` filling the GPUs left (``parallel=fsdp``). ``--search`` ignores ``parallel`` and
``train.micro_batch_size`` and ranks every layout that fits (:mod:`difflm.plan.search`). ``model.*=auto`` kernels
are planned as they resolve on a CUDA GPU with the te, flash and quack extras installed
(:mod:`difflm.plan.activations`); the plan prints the kernel set it counted.
"""
from __future__ import annotations

import argparse
import sys

from difflm.errors import DifflmError
from difflm.plan.from_config import layout_of, vocab_size  # noqa: F401 (also read from here)
from difflm.plan.memory import GIB
from difflm.plan.rates import Rates, calibrate, default_rates


def active_params(cfg) -> int:
    """N for MFU: the parameters without the input embedding, less the routed experts a token skips."""
    from difflm.model import build_model, resolve_model_config
    from difflm.model.moe import moe_inactive_params

    import torch

    from difflm.model.auto_kernels import cpu_kernels

    m = cpu_kernels(cfg.model, keep_explicit=False)  # a copy
    resolve_model_config(m, int(cfg.model.vocab_size))
    m.compile = False
    model = build_model(m, causal=False, device=torch.device("cpu"), seed=None, meta=True)
    return model.num_params() - moe_inactive_params(m)


def _fit_hint(cand, rates: Rates) -> str:
    """What would make the smallest plan ``cand`` fit: where its weights, gradients and optimizer state alone exceed
    a GPU, only more GPUs (to shard them) or a smaller model; else also a shorter sequence."""
    state = sum(cand.memory.parts.get(k, 0) for k in ("parameters", "gradients", "optimizer"))
    if state > (rates.memory_gib - rates.reserve_gib) * GIB:
        return (f"its weights, gradients and optimizer state alone take {state / GIB:.1f} GiB: use more GPUs (FSDP "
                "shards them) or a smaller model")
    return "use more GPUs, a shorter data.seq_len or a smaller model"


def fits_memory(cand, rates: Rates) -> bool:
    """Whether the plan ``cand`` fits a GPU of ``rates``: its peak within the memory less the reserve."""
    return cand.memory.total <= (rates.memory_gib - rates.reserve_gib) * GIB


def render(cand, rates: Rates, gpus: int) -> str:
    """The plan of one candidate as text: memory by part, step time by part, tokens/s and MFU."""
    lay, mem, step = cand.layout, cand.memory, cand.step
    lines = [f"layout {lay.name()} on {gpus} x {rates.gpu}: micro-batch {lay.micro_batch} x {cand.n_micro} "
             f"accumulation steps, activation checkpointing {lay.activation_checkpointing}",
             f"kernels: {mem.kernels}",
             f"memory per GPU (GiB, the most loaded rank, at the {mem.phase}):"]
    lines += [f"  {k:<12} {v / GIB:9.2f}" for k, v in mem.parts.items()]
    fits = "fits" if fits_memory(cand, rates) else "DOES NOT FIT"
    lines.append(f"  {'total':<12} {mem.total / GIB:9.2f}   of {rates.memory_gib:.0f} GiB "
                 f"({rates.reserve_gib:.0f} reserved): {fits}")
    lines.append("step time (ms):")
    lines += [f"  compute {k:<22} {v * 1e3:9.1f}" for k, v in step.compute.items()]
    lines += [f"  comm    {k:<22} {v * 1e3:9.1f}" for k, v in step.comm.items()]
    if step.bubble:
        lines.append(f"  pipeline bubble                {step.bubble * 1e3:9.1f}")
    lines.append(f"  {'step':<30} {step.seconds * 1e3:9.1f}")
    lines.append(f"tokens/s {step.tokens_per_s:,.0f} ({step.tokens_per_s / gpus:,.0f} per GPU), "
                 f"MFU {100 * step.mfu:.1f} % of {rates.peak_tflops:.0f} TFLOP/s")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one ``DifflmError`` line (a bad flag value, a flag without its value)."""

    def error(self, message: str):
        raise DifflmError(f"{message} (difflm-plan --help lists the flags)")


FLAGS = ("--gpus", "--gpu", "--calibration", "--calibrate", "--search", "--top", "--config-dir")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the planner's own flags, the ``difflm-train`` overrides) of a command line.

    Raises: DifflmError for a flag the planner does not have (naming the closest one), a bad flag value, or
    ``--top`` below 1."""
    import difflib

    parser = _Parser(prog="difflm-plan", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="exit status: 0 the plan fits the GPU's memory, 1 it does not (the plan is printed), "
                            "2 a refused command line")
    parser.add_argument("--gpus", type=int, default=1, help="number of GPUs (default 1)")
    parser.add_argument("--gpu", default="H200", help="GPU model with shipped rates: H200 (default) or H100")
    parser.add_argument("--calibration", help="a rates file written by --calibrate (overrides --gpu)")
    parser.add_argument("--calibrate", metavar="FILE", help="measure this GPU's rates at the run's shapes into FILE")
    parser.add_argument("--search", action="store_true", help="rank every layout, micro-batch and checkpointing that fits")
    parser.add_argument("--top", type=int, default=5, help="with --search: how many to print (default 5)")
    parser.add_argument("--config-dir", help="a folder of your own presets laid out like conf/ (model/mine.yaml), "
                                             "as difflm-train's --config-dir")
    args, overrides = parser.parse_known_args(argv)
    for word in overrides:
        if word.startswith("-") and word not in ("-m", "--multirun"):  # -m: refused with its own line
            flag = word.split("=")[0]
            close = difflib.get_close_matches(flag, FLAGS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise DifflmError(f"{flag} is not a difflm-plan flag; {hint}(flags: {', '.join(FLAGS)}; the rest of the "
                              "command line is difflm-train's key=value overrides)")
    if args.top < 1:
        raise DifflmError(f"--top {args.top}: pass how many of the fitting layouts to print, 1 or more")
    return args, overrides


def check_plan(cfg, gpus: int, search: bool) -> None:
    """``difflm-train``'s checks of the run ``cfg`` on ``gpus`` GPUs of the kind planned for (a CUDA GPU with FP8 and
    the te, flash and quack extras: ``model.*=auto`` resolved on a copy as :func:`difflm.plan.activations.kernel_set`
    does), so a run ``difflm-train`` would refuse is refused here in its one line, not planned: every check the config
    decides (:func:`difflm.config.validate.check_config`: the keys, the model, the run's length, the data, objective,
    optimizer and schedule keys, ``lora.*``) and the MoE expert kernels against the layout. Without ``--search``
    (which picks the layout and micro-batch itself and keeps only those difflm-train takes) the layout is checked
    against the model, the batch and the data. The corpus is not needed: a recipe that leaves ``data.path`` to the
    user is planned on the embedded one. Raises: DifflmError."""
    import torch

    from difflm.config import asset_path
    from difflm.config.schema import EMBEDDED_CORPUS
    from difflm.config.validate import check_config, check_moe_kernels
    from difflm.model.auto_kernels import FULL_INSTALL, choose_kernels
    from difflm.parallel.mesh import LaunchSizeMismatch, ParallelDims

    run = cfg.copy()
    choose_kernels(run, torch.device("cuda"), gpus, installed=FULL_INSTALL)
    d = run.data
    if not (d.path or d.hf_dataset or d.get("blend")):  # the step and memory do not depend on which corpus
        d.path = asset_path(EMBEDDED_CORPUS)
    gbs = run.train.global_batch_size
    if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1:
        raise DifflmError(f"train.global_batch_size={gbs} must be positive")
    if search:  # the layout is the search's: every other check, on one GPU's layout
        run.parallel.update({"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1})
        run.train.micro_batch_size = 1
        check_config(run, 1)
        return
    try:
        check_config(run, gpus)
    except LaunchSizeMismatch as err:
        raise gpu_count_error(err, run, gpus) from None
    check_moe_kernels(run, ParallelDims.from_config(run.parallel, gpus), device=None)


def check_gpu_count(cfg, gpus: int) -> None:
    """Refuse a layout (``parallel.*``) whose degrees do not fit ``gpus`` GPUs, before anything is sized for them.
    Raises: DifflmError (:func:`gpu_count_error`)."""
    from difflm.parallel.mesh import LaunchSizeMismatch, ParallelDims

    try:
        ParallelDims.from_config(cfg.parallel, gpus)
    except LaunchSizeMismatch as err:
        raise gpu_count_error(err, cfg, gpus) from None


def gpu_count_error(err, cfg, gpus: int) -> DifflmError:
    """:class:`difflm.parallel.mesh.LaunchSizeMismatch` worded for the planner, which launches nothing: the fix is
    ``--gpus``, a layout for that many GPUs, or ``--search``."""
    name = cfg.parallel.get("name", "?")
    need = f"a multiple of {err.runs_on}" if err.multiple else str(err.runs_on)
    return DifflmError(f"parallel={name} runs on {need} GPU(s), not --gpus {gpus}: pass --gpus {need}, a layout for "
                       f"{gpus} GPUs (parallel=fsdp fills them: dp_shard=-1), or --search to rank the layouts that fit")


def main(argv=None) -> int:
    """Entry point of ``difflm-plan``. Returns the exit status (2 with one ``difflm: error:`` line on bad input)."""
    from difflm.cli import _say

    try:
        args, overrides = parse_args(sys.argv[1:] if argv is None else list(argv))
        return _run(args, overrides)
    except DifflmError as e:
        _say(f"difflm: error: {e}")
        return 2


def _run(args, overrides: list[str]) -> int:
    from difflm.cli import refuse_multirun
    from difflm.config.compose import compose_train_config
    from difflm.plan.search import evaluate, search
    from difflm.plan.shapes import model_params

    if args.gpus < 1:
        raise DifflmError(f"--gpus {args.gpus}: pass a positive number of GPUs")
    refuse_multirun(overrides, "difflm-plan")  # Hydra's grammar would refuse -m as an override, naming no fix
    cfg = compose_train_config(overrides, config_dir=args.config_dir)
    cfg.model.vocab_size = vocab_size(cfg)
    if cfg.model.head_dim is None:
        cfg.model.head_dim = int(cfg.model.hidden_size) // int(cfg.model.num_heads)
    check_plan(cfg, args.gpus, search=True)  # the model and the keys; the layout once the micro-batch is known
    rates = Rates.from_json(args.calibration) if args.calibration else default_rates(args.gpu)
    if args.calibrate:
        from difflm.training.auto_batch import is_auto

        if is_auto(cfg):
            raise DifflmError("train.micro_batch_size=auto with --calibrate: the rates are measured at the run's "
                              "micro-batch; give train.micro_batch_size a number (the size difflm-plan prints for "
                              "auto without --calibrate)")
        measured = calibrate(cfg.model, int(cfg.data.seq_len), int(cfg.train.micro_batch_size), rates)
        measured.to_json(args.calibrate)
        print(f"wrote {args.calibrate}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                    for k, v in vars(measured).items()))
        return 0
    params = model_params(cfg.model, int(cfg.model.vocab_size))
    n_active = active_params(cfg)
    from difflm.model.auto_kernels import unresolved

    still = unresolved(cfg)
    if still:  # the plan prints the kernel set it counted (render's "kernels:" line)
        torch_hint = "; model.backend=torch model.attention_backend=sdpa plans the torch kernels"
        hint = torch_hint if "model.backend" in still else ""
        print(f"{', '.join(k + '=auto' for k in still)} planned as chosen on a CUDA GPU with difflm's te, flash and "
              f"quack extras installed (difflm.plan.activations){hint}")
    from difflm.training.auto_batch import choose_micro_batch, is_auto

    if not args.search:
        check_gpu_count(cfg, args.gpus)
    if is_auto(cfg) and not args.search:  # the size difflm-train would plan on this GPU (its whole memory free)
        if cfg.train.get("auto_batch_budget_gib") is None:
            cfg.train.auto_batch_budget_gib = rates.memory_gib - rates.reserve_gib
        import torch

        print(choose_micro_batch(cfg, torch.device("cuda"), args.gpus))
    if not args.search:
        check_plan(cfg, args.gpus, search=False)
        layout = layout_of(cfg, args.gpus)
        planned = evaluate(cfg, params, n_active, layout, rates)
        print(render(planned, rates, args.gpus))
        return 0 if fits_memory(planned, rates) else 1
    given = sorted({o.lstrip("+~").split("=")[0] for o in overrides if o.lstrip("+~").startswith("parallel")})
    if given:  # the search ranks every layout; the user's would read as a constraint it does not apply
        print(f"--search ranks every layout: {', '.join(given)} given on the command line "
              f"{'is' if len(given) == 1 else 'are'} not kept (plan one layout without --search)")
    refused: list = []
    fits, every = search(cfg, params, n_active, args.gpus, rates, refused)
    if not every and refused:  # layouts split the model and the batch, and difflm-train refuses each of them
        simplest, why = refused[0]  # the fewest model-parallel degrees: the search's first
        raise DifflmError(f"--gpus {args.gpus}: difflm-train refuses every layout that splits this run over "
                          f"{args.gpus} GPUs, e.g. {simplest.name()}: {why}")
    if not every:
        raise DifflmError(f"--gpus {args.gpus}: no layout splits model.num_heads={cfg.model.num_heads} and "
                          f"train.global_batch_size={cfg.train.global_batch_size} over {args.gpus} GPUs; pick a GPU "
                          "count whose data-parallel part divides the global batch")
    if not fits:
        small = every[0]
        raise DifflmError(f"nothing fits {args.gpus} x {rates.gpu} ({rates.memory_gib:.0f} GiB): the smallest plan, "
                          f"{small.layout.name()} micro-batch {small.layout.micro_batch} with activation checkpointing "
                          f"{small.layout.activation_checkpointing}, needs {small.memory.total / GIB:.1f} GiB a GPU; "
                          f"{_fit_hint(small, rates)}")
    print(f"{len(fits)} of {len(every)} candidates fit {args.gpus} x {rates.gpu}; the fastest {min(args.top, len(fits))}:")
    print(f"{'rank':>4}  {'layout':<22} {'mb':>3} {'ac':<9} {'GiB/GPU':>8} {'step ms':>9} {'tok/s/GPU':>10} {'MFU %':>6}")
    for i, c in enumerate(fits[:args.top], 1):
        print(f"{i:>4}  {c.layout.name():<22} {c.layout.micro_batch:>3} {c.layout.activation_checkpointing:<9} "
              f"{c.memory.total / GIB:>8.1f} {c.step.seconds * 1e3:>9.1f} {c.step.tokens_per_s / args.gpus:>10,.0f} "
              f"{100 * c.step.mfu:>6.1f}")
    print()
    print(render(fits[0], rates, args.gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
