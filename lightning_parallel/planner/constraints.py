"""The layout options a user fixes under ``strategy=auto`` (``strategy.zero_stage=1``): which planned layouts
keep them, and, before anything is measured, whether any layout of the devices can.

A fixed option names a ``ParallelStrategy`` keyword (``ParallelStrategy.layout_options``). A layout keeps it when its
``strategy_options()`` hold that value; a schedule, micro-batch or virtual-stage count is a pipeline's
option, so fixing one keeps only layouts with pipeline stages.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.layouts import candidate_layouts

__all__ = ["keeps", "constraint_problems"]


def keeps(layout: Layout, fixed: Mapping[str, Any]) -> bool:
    """Whether ``layout`` has every option of ``fixed`` at its value."""
    options = layout.strategy_options()
    return all(name in options and options[name] == value for name, value in fixed.items())


def _values(layouts: Iterable[Layout], name: str) -> list[Any]:
    seen = {repr(v): v for layout in layouts for n, v in layout.strategy_options().items() if n == name}
    return sorted(seen.values(), key=repr)


def constraint_problems(fixed: Mapping[str, Any], devices: int, global_batch: int) -> list[str]:
    """Why no layout of ``devices`` can have the options ``fixed`` (one sentence per option a layout never
    has, or one for the combination), or []: what the planner would enumerate, experts and selective
    recompute included, before the model is measured."""
    if not fixed:
        return []
    layouts = list(candidate_layouts(devices, global_batch, experts=True, selective=True))
    out = []
    for name, value in fixed.items():
        if not any(keeps(layout, {name: value}) for layout in layouts):
            out.append(
                f"strategy.{name}={value!r}: no layout of {devices} devices the planner chooses from has it; "
                f"its layouts have {name} in {_values(layouts, name)}"
            )
    if not out and not any(keeps(layout, fixed) for layout in layouts):
        given = " ".join(f"strategy.{n}={v!r}" for n, v in fixed.items())
        out.append(f"{given}: no layout of {devices} devices has all of these together; fix fewer of them")
    return out
