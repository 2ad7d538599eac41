"""A rank's share of a model, set up without ever holding the whole model on the device.

``capture`` takes a module's tensors out of it (meta tensors left in their place, ties kept), with the
real values of a normally built model or, for a model built on the meta device, the initializer of each
module (``initializers``; a tensor that only its constructor sets: the constructor run again,
``constructors``). The strategy then parallelizes the meta module (cuts layers, drops other stages'
blocks), and ``materialize`` allocates what the rank keeps on its device and fills it one module at a time
from the full values, generated on the host with one random state that every rank shares: the same seed
gives the same full weights in any layout.
"""

from lightning_parallel.materialize.constructors import recording_constructors
from lightning_parallel.materialize.initializers import UninitializedTensorError, initializer_for
from lightning_parallel.materialize.share import Cut, Place, describe_loaded, materialize, shared_rng_state
from lightning_parallel.materialize.tensors import Captured, Slot, capture, has_meta_tensors
from lightning_parallel.materialize.weights import WeightSource, open_weights

__all__ = [
    "Captured",
    "Cut",
    "Place",
    "Slot",
    "UninitializedTensorError",
    "WeightSource",
    "capture",
    "describe_loaded",
    "has_meta_tensors",
    "initializer_for",
    "materialize",
    "open_weights",
    "recording_constructors",
    "shared_rng_state",
]
