"""ParameterSet: what the user's code changed in a module's parameters since the last look."""

from torch import nn

from lightning_parallel.parameter_set import ParameterSet


def test_frozen_unfrozen_added_and_replaced_parameters_are_named():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].requires_grad_(False)
    seen = ParameterSet(model)
    try:
        assert seen.change() is None
        nn.Linear(3, 3)  # registered elsewhere, on none of this module's modules
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


def test_a_module_built_elsewhere_does_not_make_the_next_look_walk_the_module():
    """A Hugging Face decoder slices its ``nn.ModuleList`` of layers in every forward (a new list that
    registers each layer): the per-batch look stays one pass over the flags, not a walk of the module."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    seen = ParameterSet(model)
    walks = []
    look = seen._look
    seen._look = lambda: walks.append(1) or look()
    try:
        model[1][:1]  # a temporary list holding one of the model's layers
        nn.Linear(3, 3)
        assert seen.change() is None and walks == []
        model[1][0].extra = nn.Parameter(model[1][0].weight.detach().clone())  # on one of its modules
        assert seen.change().added == ["1.0.extra"] and len(walks) == 1
        block = nn.Sequential(nn.Linear(2, 2))  # built apart, then attached
        block.add_module("more", nn.Linear(2, 2))
        assert seen.change() is None
        model[1].append(block)
        assert set(seen.change().added) == {f"1.2.{n}" for n, _ in block.named_parameters()}
        block[0].weight = nn.Parameter(block[0].weight.detach().clone())  # replaced inside the attached block
        assert seen.change().added == ["1.2.0.weight"]
    finally:
        seen.close()
