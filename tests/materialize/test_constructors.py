"""Deferred initialization of tensors that only a constructor sets (as transformers 4.x's norms: its
``_init_weights`` leaves them alone): built on meta, they get what the module's constructor gives them,
under tp=2 and 1F1B on 2 gloo processes as on one; a tensor that nothing sets still raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.materialize import (
    UninitializedTensorError,
    capture,
    materialize,
    recording_constructors,
)
from tests.helpers.harness import assert_params_close, run_distributed, saved_checkpoint
from tests.helpers.tp_models import SmallGPT

pytestmark = pytest.mark.smoke


class ConstructedNorm(nn.Module):
    """An RMS norm whose weight and bias only the constructor sets (no ``reset_parameters``), with
    values that are not a default (a scale rising over the features)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight + self.bias


class PartlyResetNorm(ConstructedNorm):
    """A ``reset_parameters`` (called by the constructor, as torch's layers do) that sets the bias only: the
    weight stays the constructor's."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.bias, 0.125)


class ConstructedNormGPT(SmallGPT):
    """``SmallGPT`` whose norms are ``ConstructedNorm`` (blocks) and ``PartlyResetNorm`` (the final one)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        width = self.hparams.n_embd
        for block in self.model.blocks:
            block.ln1, block.ln2 = ConstructedNorm(width), ConstructedNorm(width)
        self.model.ln_f = PartlyResetNorm(width)


class Unknowable(nn.Module):
    """A tensor nobody sets: the constructor leaves it empty (its values would come from outside)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))


def _norms(state: dict) -> dict:
    return {k: v for k, v in state.items() if ".ln" in k}


def test_a_tensor_only_the_constructor_sets_gets_the_constructors_value():
    normal = ConstructedNormGPT(n_embd=8).double()
    with torch.device("meta"), recording_constructors():
        deferred = ConstructedNormGPT(n_embd=8).double()
    materialize(deferred, capture(deferred), torch.device("cpu"), torch.get_rng_state())
    expected = _norms(normal.state_dict())
    assert expected and torch.equal(expected["model.ln_f.bias"], torch.full((8,), 0.125, dtype=torch.double))
    for name, value in _norms(deferred.state_dict()).items():
        assert torch.equal(value, expected[name]), name


def test_what_no_initializer_or_constructor_sets_still_raises():
    with torch.device("meta"), recording_constructors():
        module = Unknowable(3)
    with pytest.raises(UninitializedTensorError, match=r"Unknowable.*\['weight'\]"):
        materialize(module, capture(module), torch.device("cpu"), torch.get_rng_state())


def _case(name: str, strategy: str, kwargs: dict, steps: int) -> dict:
    return {
        "name": name,
        "model": "tests.materialize.test_constructors:ConstructedNormGPT",
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 8},
        "dp_size": 1,
        "empty_init": True,
        "trainer": {"precision": "64-true", "max_steps": steps},
        "strategy": {"class": f"lightning_parallel:{strategy}", "kwargs": kwargs},
        "save_checkpoint": True,
    }


def _built_in_float64() -> dict:
    """The state of the model built normally, as ``precision="64-true"`` builds it (float64 default)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return ConstructedNormGPT().state_dict()
    finally:
        torch.set_default_dtype(before)


@pytest.mark.timeout(600)
def test_constructor_values_on_meta_train_alike_under_tp2_and_1f1b(tmp_path):
    run_distributed(
        [_case("initial", "DDPStrategy", {}, 0), _case("ddp1", "DDPStrategy", {}, 3)], 1, tmp_path, 300
    )
    layouts = [
        _case("tp2", "TensorParallelStrategy", {"plan": "auto"}, 3),
        _case("1f1b", "PipelineParallelStrategy", {"schedule": "1f1b", "num_microbatches": 2}, 3),
    ]
    two = run_distributed(layouts, 2, tmp_path, 300)
    initial = saved_checkpoint(tmp_path, 1, "initial")["state_dict"]
    for name, value in _norms(_built_in_float64()).items():
        assert torch.equal(initial[name], value), name
    reference = saved_checkpoint(tmp_path, 1, "ddp1")["state_dict"]
    for layout in ("tp2", "1f1b"):
        assert (
            len(two[layout][0]["losses"]) == 3
            and torch.isfinite(torch.tensor(two[layout][0]["losses"])).all()
        )
        assert_params_close(saved_checkpoint(tmp_path, 2, layout)["state_dict"], reference, atol=1e-10)
