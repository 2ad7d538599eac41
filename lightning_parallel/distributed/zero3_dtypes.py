"""ZeRO-3's dtypes (``param_dtype``, ``reduce_dtype``), as FSDP2's ``MixedPrecisionPolicy``: the dtype a
unit's parameters are gathered and computed in, and the one its gradients are reduce-scattered in. The
shards (the master weights the optimizer updates, and its state) keep the parameters' own dtype.

Under Lightning's ``bf16-mixed`` / ``16-mixed`` the parameters are float32 and autocast computes in
bfloat16 / float16: by default the units are gathered in that dtype (half the bytes gathered and held,
what autocast would cast them to per op anyway; norms and other float32 ops under autocast then read the
rounded weights, and a gradient is computed in that dtype), and the gradients are reduced in float32
(upcast before the reduce-scatter, as FSDP2 does with ``reduce_dtype=torch.float32``). Under the true
precisions (``32-true``, ``64-true``, ``bf16-true``, ``16-true``) nothing is cast by default; a
``param_dtype`` other than the parameters' own is refused there (no autocast would compute in it), a
``reduce_dtype`` is allowed (the gradients' collective in that dtype, like a compression hook).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["DTYPES", "UnitDtypes", "dtype_option_problem", "unit_dtypes", "unit_dtypes_problem"]

#: the names the options take
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
#: Lightning's precision -> (the parameters' dtype, autocast's compute dtype or None)
_PRECISIONS: dict[str, tuple[torch.dtype, Optional[torch.dtype]]] = {
    "64-true": (torch.float64, None),
    "32-true": (torch.float32, None),
    "bf16-true": (torch.bfloat16, None),
    "16-true": (torch.float16, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "16-mixed": (torch.float32, torch.float16),
}


@dataclass(frozen=True)
class UnitDtypes:
    """What ZeRO-3 casts to: the gathered parameters (``param``) and the reduced gradients (``reduce``);
    None for either: the parameters' own dtype (nothing cast)."""

    param: Optional[torch.dtype] = None
    reduce: Optional[torch.dtype] = None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_option_problem(name: str, value: Any, zero_stage: Any) -> Optional[str]:
    """``value`` of the option ``name`` (``param_dtype`` / ``reduce_dtype``): None, or a name of ``DTYPES``
    with ``zero_stage=3`` (only stage 3 gathers parameters and reduce-scatters them per unit)."""
    if value is None:
        return None
    if value not in DTYPES:
        return (
            f"{name}={value!r} is not supported; use one of {', '.join(map(repr, DTYPES))} or None (default)"
        )
    if zero_stage != 3:
        return (
            f"{name}={value!r} sets the dtype of zero_stage=3's gathered parameters and reduced gradients, and "
            f"zero_stage={zero_stage!r} gathers none: set zero_stage=3 or leave {name} None"
        )
    return None


def unit_dtypes_problem(
    param_dtype: Optional[str], reduce_dtype: Optional[str], precision: Any
) -> Optional[str]:
    """Why ``param_dtype`` / ``reduce_dtype`` mean nothing under Lightning's ``precision`` (a string such as
    "bf16-mixed"), or None."""
    if param_dtype is None and reduce_dtype is None:
        return None
    if precision not in _PRECISIONS:
        return (
            f"param_dtype / reduce_dtype are read against Lightning's precision, and precision={precision!r} is "
            f"not one of {', '.join(map(repr, _PRECISIONS))}: leave them None"
        )
    own, autocast = _PRECISIONS[precision]
    if param_dtype is None or DTYPES[param_dtype] in (own, autocast):
        return None
    fits = [_name(own)] if autocast is None else [_name(autocast), _name(own)]
    why = (
        "no autocast computes in it, so the gathered parameters would meet inputs of another dtype"
        if autocast is None
        else f"autocast computes in {_name(autocast)}"
    )
    return (
        f"param_dtype={param_dtype!r} under precision={precision!r}: {why}; use param_dtype "
        f"{' or '.join(map(repr, fits))}, or None (default: {fits[0]!r})"
    )


def unit_dtypes(param_dtype: Optional[str], reduce_dtype: Optional[str], precision: Any) -> UnitDtypes:
    """The dtypes ZeRO-3 casts to under ``precision`` (``unit_dtypes_problem`` must have found nothing): the
    options where given; else autocast's dtype for the parameters under a mixed precision, and the
    parameters' own dtype for the gradients."""
    own, autocast = _PRECISIONS.get(precision, (None, None))
    param = DTYPES[param_dtype] if param_dtype is not None else autocast
    reduce = DTYPES[reduce_dtype] if reduce_dtype is not None else None
    return UnitDtypes(param=None if param == own else param, reduce=None if reduce == own else reduce)
