"""MegaDLMs' ``--moe-router-type``: read by its ``pretrain_difflm.py``, defined by none of its parsers (our shim, not
their code).

For every run with ``--num-experts``, MegaDLMs' ``pretrain_difflm.py`` (``model_provider``) builds the block spec with

    get_difflm_decoder_block_spec(config, ..., moe_router_type=args.moe_router_type)

and ``megatron/core/models/difflm/moe_module_specs.py`` (``get_moe_module_spec``) takes ``"topk"`` (Megatron-Core's
``MoELayer``: ``TopKRouter``, token choice) or ``"expert_choice"`` (MegaDLMs' ``MoELayerExpertChoice``, the default
of every spec function). Neither ``megatron/training/arguments.py`` nor ``custom_args/difflm.py`` adds the argument,
so an MoE run stops with ``AttributeError: 'Namespace' object has no attribute 'moe_router_type'``. :func:`install`
wraps ``custom_args.difflm.extra_args_provider`` (the parser hook ``pretrain_difflm.py`` hands to Megatron) when that
module is first imported, so that it also adds ``--moe-router-type {topk,expert_choice}`` (default ``expert_choice``,
the specs' default) unless the parser already has it. Dense runs never read it.
"""
from __future__ import annotations

import megadlms_te_compat

TARGET = "custom_args.difflm"
FLAG = "--moe-router-type"
CHOICES = ("topk", "expert_choice")


def add_router_type(parser):
    """Add ``--moe-router-type`` to the argparse ``parser`` unless it has it; returns the parser."""
    if not any(FLAG in action.option_strings for action in parser._actions):
        group = parser.add_argument_group(title="MoE router type (scripts/megadlms_shim)")
        group.add_argument(FLAG, type=str, default="expert_choice", choices=CHOICES,
                           help="MoE layer of MegaDLMs' spec: topk = Megatron-Core's MoELayer with TopKRouter "
                                "(token choice); expert_choice = MegaDLMs' MoELayerExpertChoice")
    return parser


def patch(module) -> list[str]:
    """Wrap ``module.extra_args_provider`` so that it also adds ``--moe-router-type``; returns the flags added."""
    provider = getattr(module, "extra_args_provider", None)
    if provider is None or getattr(provider, "adds_moe_router_type", False):
        return []

    def extra_args_provider(parser):
        out = provider(parser)
        return add_router_type(out if out is not None else parser)

    extra_args_provider.adds_moe_router_type = True
    extra_args_provider.__wrapped__ = provider
    extra_args_provider.__doc__ = provider.__doc__
    module.extra_args_provider = extra_args_provider
    return [FLAG]


def install() -> None:
    """Patch ``custom_args.difflm`` now if it is already imported, else when it is (idempotent)."""
    megadlms_te_compat.install_hook(TARGET, patch)
