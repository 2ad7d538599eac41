"""ParameterSet: what the user's code changed in a module's parameters since the last look."""

from torch import nn

from lightning_parallel.parameter_set import ParameterSet


def test_frozen_unfrozen_added_and_replaced_parameters_are_named():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].requires_grad_(False)
    seen = ParameterSet(model)
    try:
        assert seen.change() is None
        nn.Linear(3, 3)  # registered elsewhere: looked at again, nothing of this module changed
        assert seen.change() is None
        model[0].weight.requires_grad_(True)
        model[1].bias.requires_grad_(False)
        change = seen.change()
        assert change.trainable == ["0.weight"] and change.frozen == ["1.bias"] and not change.structural
        assert seen.change() is None  # reported once
        model[1] = nn.Linear(2, 2)  # a module swapped
        change = seen.change()
        assert change.structural and set(change.added) == set(change.removed) == {"1.weight", "1.bias"}
        assert "added or replaced: 1.weight, 1.bias" in change.describe()
    finally:
        seen.close()
    model[0].bias.requires_grad_(True)
    assert seen.change().trainable == ["0.bias"]  # closed: still answers, from the flags


def test_close_removes_the_process_wide_hooks():
    seen = ParameterSet(nn.Linear(2, 2))
    seen.close()
    nn.Linear(2, 2)
    assert not seen._registered
