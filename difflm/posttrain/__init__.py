"""Post-training of masked-diffusion LMs: sequence log-likelihood estimators, GRPO (online RL), DPO with VRPO
(offline preferences) and rewards. Each piece is a small pure function; :mod:`difflm.rl` runs them.

Layout (one file per algorithm per concern):
  * :mod:`difflm.posttrain.loglik`: the pluggable log-likelihood estimators (``one_step``, ``coupled``, ``mc_elbo``);
  * :mod:`difflm.posttrain.grpo`: group-normalised advantages and the clipped GRPO loss with a k3 KL;
  * :mod:`difflm.posttrain.dpo`: DPO on ELBO estimates (VRPO's shared noise);
  * :mod:`difflm.posttrain.forward`: the estimators' model forward in the init run's layout (bd3lm: ``[x_t ; x_0]``);
  * :mod:`difflm.posttrain.rollout`: group rollouts from difflm's samplers;
  * :mod:`difflm.posttrain.reference`: the frozen reference model;
  * :mod:`difflm.posttrain.layout`: the run's parallel layout (FSDP2, TP) and how a step is split over ranks;
  * :mod:`difflm.posttrain.rewards`: the ``reward`` config group's functions.
"""
