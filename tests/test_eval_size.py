"""The trainer's default evaluation size: 64 windows on a GPU; on a CPU sized to about a quarter of the training
between two evaluations (difflm.training.eval_size)."""
import pytest
from omegaconf import OmegaConf

from conftest import compose_run
from difflm.config.validate import check_run
from difflm.errors import DifflmError
from difflm.training.eval_size import eval_windows


def train_cfg(**keys):
    return OmegaConf.merge(compose_run([]).train, keys)


def test_the_default_is_sized_to_the_run_on_cpu_and_64_on_gpu():
    assert compose_run([]).train.eval_windows is None
    make_train = train_cfg(eval_every=100, global_batch_size=8, eval_mc_samples=4)
    assert eval_windows(make_train, "mdlm", "cpu") == 100 * 8 // (5 * 4 * 4) == 10
    assert eval_windows(make_train, "ar", "cpu") == 40  # one draw per window: exact NLL
    assert eval_windows(train_cfg(eval_every=10, global_batch_size=8), "mdlm", "cpu") == 8  # never below 8
    assert eval_windows(train_cfg(eval_every=1000, global_batch_size=64), "mdlm", "cpu") == 64  # nor above 64
    assert eval_windows(make_train, "mdlm", "cuda") == 64
    assert eval_windows(train_cfg(eval_windows=3), "mdlm", "cpu") == 3  # an explicit value is kept
    assert eval_windows(train_cfg(eval_windows=100), "mdlm", "cuda") == 100


def test_an_explicit_eval_windows_is_still_checked():
    with pytest.raises(DifflmError, match=r"train.eval_windows=0 must be >= 1"):
        check_run(compose_run(["train.eval_windows=0"]))
