"""The version shims (``lightning_parallel.compat``): no other module of the package reaches a private torch
name, and each shim gives the same answer on every torch of the range (this file is in the smoke set)."""

from __future__ import annotations

import re
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_parallel import compat

pytestmark = pytest.mark.smoke

PACKAGE = Path(compat.__file__).parent
#: torch's private modules and functions, and names that arrived after the floor (torch 2.5)
PRIVATE = re.compile(
    r"torch\._(?!_version__)|torch\.utils\._|torch\.distributed\._|_top_saved_tensors|\.op_output\b"
)


def test_only_compat_reaches_private_torch_names():
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "compat.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line.split("#")[0])
    ]
    assert not found, "import these through lightning_parallel.compat:\n" + "\n".join(found)


class Cache:  # transformers' base class of key/value caches, by name
    pass


class DynamicCache(Cache):
    pass


def test_a_layers_cache_is_not_passed_on():
    hidden = torch.ones(2)
    assert compat.without_layer_caches((hidden, DynamicCache()))[1] is None
    assert compat.without_layer_caches((hidden, DynamicCache()))[0] is hidden
    assert compat.without_layer_caches(hidden) is hidden
    plain = (hidden, None)
    assert compat.without_layer_caches(plain) is plain


def test_selective_policy_outputs_as_a_tuple_or_none_before_torch_2_13():
    out = torch.zeros(1)
    assert compat.selective_op_outputs(SimpleNamespace(op_output=out)) == (out,)
    assert compat.selective_op_outputs(SimpleNamespace(op_output=[out, out])) == (out, out)
    assert compat.selective_op_outputs(SimpleNamespace(is_recompute=False)) == ()


def test_saved_tensor_hooks_read_where_torch_can():
    with torch.autograd.graph.saved_tensors_hooks(abs, abs):
        top = compat.top_saved_tensors_hooks()
    assert top is None or top == (abs, abs)
    assert compat.top_saved_tensors_hooks() is None


def test_agent_store_environment_names_a_restart_count(monkeypatch):
    monkeypatch.delenv(compat.RESTART_COUNT_ENV, raising=False)
    assert compat.agent_store_env("SWITCH") == {"SWITCH": "True", compat.RESTART_COUNT_ENV: "0"}
    monkeypatch.setenv(compat.RESTART_COUNT_ENV, "3")
    assert compat.agent_store_env("SWITCH")[compat.RESTART_COUNT_ENV] == "3"


def test_a_nodes_saved_tensors_are_dropped():
    hidden = torch.randn(3, requires_grad=True) * 1
    out = torch.nn.functional.gelu(hidden)  # saves its input
    saved = weakref.ref(hidden)
    compat.drop_saved_tensors(out.grad_fn)
    del hidden
    assert saved() is None
    with pytest.raises(RuntimeError, match="dropped after the input part"):
        out.sum().backward()
