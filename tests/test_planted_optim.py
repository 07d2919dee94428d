"""Gaps a planted-bug round found in the whole-step entries' tests: an optimizer group whose
parameters are swapped at an unchanged count, and a parameter re-created after capture. Each
is re-captured (weights equal eager's) or refused naming the cause; never a graph stepping the
old parameters."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from fail_closed_models import (
    D,
    assert_same_params,
    eager_run,
    full_iteration_run,
    make_adamw,
    optimizer_graph_run,
)


def make_twin_layers(device) -> nn.Sequential:
    """Two layers of one shape (0 and 2): their parameters can take each other's place."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 1)
    ).to(device)


class SwapParams:
    """At step 4, training moves from layer 0 to layer 2: the optimizer's group keeps its
    length and shapes, its first two parameters are replaced by layer 2's."""

    at = 4
    make_model = staticmethod(make_twin_layers)

    def start(self, model, device):
        model[2].requires_grad_(False)
        return make_adamw([*model[0].parameters(), *model[4].parameters()], device)

    def __call__(self, i, model, opt):
        if i == self.at:
            model[0].requires_grad_(False)
            model[2].requires_grad_(True)
            params = opt.param_groups[0]["params"]
            params[0], params[1] = model[2].weight, model[2].bias


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
def test_parameters_swapped_at_an_equal_count_are_followed(backend, device, entry):
    """``opt.param_groups[0]['params'][i] = other`` (same shape, same count) after capture: the
    step is captured again and steps the new parameters as eager does, or a RuntimeError names
    the change."""
    want = eager_run(device, SwapParams())
    run = optimizer_graph_run if entry == "optimizer_graph" else full_iteration_run
    try:
        got = run(backend, device, SwapParams())
    except RuntimeError as exc:
        assert re.search("param group", str(exc)), exc
    else:
        assert_same_params(got, want)


class Recreate:
    """At step 4 the model re-creates a parameter (``module.weight = nn.Parameter(...)``);
    ``opt_too``: the optimizer's group is handed the new one too."""

    at = 4

    def __init__(self, opt_too: bool) -> None:
        self.opt_too = opt_too

    def start(self, model, device):
        return make_adamw(model.parameters(), device)

    def __call__(self, i, model, opt):
        if i == self.at:
            model[0].weight = nn.Parameter(model[0].weight.detach().clone())
            if self.opt_too:
                opt.param_groups[0]["params"][0] = model[0].weight


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
@pytest.mark.parametrize("opt_too", [True, False], ids=["optimizer_too", "model_only"])
def test_a_recreated_parameter_is_followed_or_named(backend, device, entry, opt_too):
    """Handed to the optimizer too, the new parameter is stepped as eager steps it. Left out of
    the optimizer, eager silently stops stepping it; the optimizer graph, which would step the
    old one, refuses naming the cause (not only "a .grad is None")."""
    want = eager_run(device, Recreate(opt_too))
    run = optimizer_graph_run if entry == "optimizer_graph" else full_iteration_run
    if entry == "optimizer_graph" and not opt_too:
        with pytest.raises(ValueError, match=r"re-created it .*give the optimizer the new"):
            run(backend, device, Recreate(opt_too))
        return
    assert_same_params(run(backend, device, Recreate(opt_too)), want)
