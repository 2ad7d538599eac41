"""The parameters a strategy set up, and what the user's code changed since.

Set-up decides things from the module as it then is: which parameters get a gradient bucket, which
are summed over the pipeline stages, which ZeRO shards. A callback may change the module afterwards:
``BackboneFinetuning`` freezes a backbone when fit starts and unfreezes it at an epoch, and an adapter
may be added in ``on_train_start``. ``ParameterSet.change`` says what changed since the last look: the
parameters that now train or no longer do, and those added, removed or replaced (a module swapped).
It is read once per training batch at the cost of one C-level pass over the parameters kept from the
last look (their ``requires_grad``): a parameter or module registered since on one of the module's own
modules (torch's global registration hooks set a flag) makes it walk the module again, and the names are
read only when something changed. A registration elsewhere does not: a forward that builds a temporary
module (Hugging Face's decoders slice their ``nn.ModuleList`` of layers on every call, which registers
each layer in a new list) would otherwise make every batch walk the whole module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Optional

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

__all__ = ["ParameterChange", "ParameterSet"]

_TRAINS = attrgetter("requires_grad")


@dataclass(frozen=True)
class ParameterChange:
    """What changed in a module's parameters between two looks, by name."""

    trainable: list[str] = field(default_factory=list)  # require grad now, did not before
    frozen: list[str] = field(default_factory=list)  # the reverse
    added: list[str] = field(default_factory=list)  # new parameter objects (added, or replacing others)
    removed: list[str] = field(default_factory=list)  # gone (removed, or replaced)

    @property
    def structural(self) -> bool:
        """Parameters were added, removed or replaced (not only frozen or unfrozen)."""
        return bool(self.added or self.removed)

    def describe(self, shown: int = 6) -> str:
        parts = []
        for what, names in (
            ("unfrozen", self.trainable),
            ("frozen", self.frozen),
            ("added or replaced", self.added),
            ("removed or replaced", self.removed),
        ):
            if names:
                more = f" and {len(names) - shown} more" if len(names) > shown else ""
                parts.append(f"{what}: {', '.join(names[:shown])}{more}")
        return "; ".join(parts)


class ParameterSet:
    """A module's parameters and which of them train, as last seen (``change`` looks again)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._names: dict[int, str] = {}
        self._trains: dict[int, bool] = {}
        self._registered = False  # a parameter or module was registered on one of ours since the last look
        self._owners: set[int] = set()  # ids of the module's own modules (``_look``)
        self._handles = [
            register_module_parameter_registration_hook(self._on_registration),
            register_module_module_registration_hook(self._on_registration),
        ]
        self._look()

    def _on_registration(self, owner: nn.Module, *args: object) -> None:
        if id(owner) in self._owners:
            self._registered = True

    def close(self) -> None:
        """Remove the registration hooks (process-wide)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _look(self) -> None:
        self._registered = False
        named = list(self.module.named_parameters())
        # the modules and parameters are kept, so an id seen here cannot be reused by a new object
        self._modules = list(self.module.modules())
        self._owners = set(map(id, self._modules))
        self._params = [p for _, p in named]
        self._ids = list(map(id, self._params))
        self._flags = list(map(_TRAINS, self._params))
        self._names = {id(p): n for n, p in named}
        self._trains = dict(zip(self._ids, self._flags))

    def change(self) -> Optional[ParameterChange]:
        """What changed since set-up or the last call that found a change (None: nothing)."""
        if not self._registered and list(map(_TRAINS, self._params)) == self._flags:
            return None
        before_names, before_trains = self._names, self._trains
        self._look()
        if self._ids == list(before_names) and self._flags == list(before_trains.values()):
            return None  # something was registered elsewhere (or the same parameter again)
        now = self._names
        return ParameterChange(
            trainable=[
                n for i, n in now.items() if i in before_trains and self._trains[i] and not before_trains[i]
            ],
            frozen=[
                n for i, n in now.items() if i in before_trains and not self._trains[i] and before_trains[i]
            ],
            added=[n for i, n in now.items() if i not in before_names],
            removed=[n for i, n in before_names.items() if i not in now],
        )
