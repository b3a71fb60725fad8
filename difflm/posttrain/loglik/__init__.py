"""Sequence log-likelihood estimators of masked-diffusion LMs, a pluggable choice (``estimator.name``):

  * ``one_step``: d1's one forward with the completion masked and the prompt randomly masked
    (:mod:`~difflm.posttrain.loglik.one_step`);
  * ``coupled``: DiffuCoder's complementary mask pair (:mod:`~difflm.posttrain.loglik.coupled`);
  * ``mc_elbo``: the Monte-Carlo ELBO with antithetic t, VRPO's estimator (:mod:`~difflm.posttrain.loglik.mc_elbo`).

Every estimator is called as ``est(logits_fn, x, completion, mask_id=, key=, sample_ids=, prompt=None)`` and returns
per-position terms [B, S] float32 whose row sums estimate log pi(completion | prompt); ``est.forwards`` is its number
of forward passes per sequence. ``logits_fn`` is the model's forward in the layout the run trained with
(:mod:`difflm.posttrain.forward`): on a bd3lm run, BD3-LM's ``[x_t ; x_0]`` forward with one t per block
(:mod:`~difflm.posttrain.loglik.base`).
"""
from difflm.errors import DifflmError
from difflm.posttrain.loglik.base import EstimateKey, LogitsFn, target_logprobs
from difflm.posttrain.loglik.coupled import CoupledEstimator
from difflm.posttrain.loglik.mc_elbo import MCELBOEstimator
from difflm.posttrain.loglik.one_step import OneStepEstimator

ESTIMATORS = {"one_step": OneStepEstimator, "coupled": CoupledEstimator, "mc_elbo": MCELBOEstimator}
_KEYS = {"one_step": ("prompt_mask_prob",), "coupled": ("t_min", "t_max", "full_mask_weight"),
         "mc_elbo": ("num_t", "eps", "antithetic")}


def build_estimator(cfg):
    """The estimator named by ``cfg.name`` with its keys (an ``estimator`` config or dict).

    Raises: DifflmError for an unknown name or an out-of-range value (naming the key)."""
    get = cfg.get if hasattr(cfg, "get") else (lambda k, d=None: getattr(cfg, k, d))
    name = get("name")
    if name not in ESTIMATORS:
        raise DifflmError(f"estimator={name!r} is unknown: choose one of {', '.join(ESTIMATORS)}")
    kwargs = {k: v for k in _KEYS[name] if (v := get(k, None)) is not None}
    try:
        return ESTIMATORS[name](**kwargs)
    except ValueError as e:
        raise DifflmError(str(e)) from None


__all__ = ["CoupledEstimator", "ESTIMATORS", "EstimateKey", "LogitsFn", "MCELBOEstimator", "OneStepEstimator",
           "build_estimator", "target_logprobs"]
