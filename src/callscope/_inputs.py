"""Dynamic inputs of a compiled step: patch values and histogram ranges.

A value that changes from one call to the next but keeps its shape must not be a
constant of the compiled step, or each call would compile its own. The key holds
its name, shape and dtype only; the value enters each step:

- JAX: as an extra argument of the jitted step. The run wraps each batch the step
  takes as `{INPUTS: values, DATA: batch}` (`wrapped`), and the step closure takes
  it apart (`unwrap`). Batches are not donated, so the values are placed on the
  device once per run.
- TensorFlow, torch: in a hidden variable per (name, shape, dtype), the model's
  `slots`, assigned before the compiled call. A run assigns them when it takes
  the turn from another run (or another kind of step), never per step.

Names: `patch|<owner id>|<point>|<value>` and `range|<capture index>|<key>`.
"""

from __future__ import annotations

import contextlib
import weakref

import keras
import numpy as np

INPUTS = "__callscope_inputs__"
DATA = "__callscope_data__"
_JAX = keras.backend.backend() == "jax"


def kind(dtype) -> str | None:
    """"bool", "int" or "float" for a numpy, Keras or backend dtype; None for others."""
    try:
        name = keras.backend.standardize_dtype(dtype)
    except ValueError:  # strings, objects
        return None
    if name == "bool":
        return "bool"
    return "int" if "int" in name else "float" if "float" in name else None


def may_hold(wanted, given) -> bool:
    """Whether a `given`-dtype value cast to `wanted` keeps its value up to rounding:
    bools into any kind, ints into ints and floats, floats only into floats
    (2.7 -> 2 and 2 -> True would change it). Complex and other kinds never."""
    held = {"bool": ("bool",), "int": ("bool", "int"), "float": ("bool", "int", "float")}
    return kind(given) in held.get(kind(wanted), ())


def holds(array: np.ndarray, dtype) -> bool:
    """Whether numeric `dtype` holds every value of `array` (a kind `may_hold`
    allows) up to rounding: integers by range (a round trip passed int8 -1 as
    uint8: 255, and back, -1), floats by staying finite (1e6 as float16 is inf)."""
    if not array.size:
        return True
    if kind(dtype) == "int":
        limits = np.iinfo(dtype)
        return limits.min <= int(array.min()) and int(array.max()) <= limits.max
    if kind(dtype) == "float":  # (an int too: 70000 as float16 is inf)
        with np.errstate(over="ignore", invalid="ignore"):
            return np.array_equal(np.isfinite(array.astype(dtype)), np.isfinite(array))
    return True


def cast_loss(wanted) -> str:
    """How a cast to `wanted` that `may_hold` refuses would change a value, for
    error messages."""
    return "2.7 -> 2" if kind(wanted) == "int" else "2 -> True"


def patch_name(owner: int, point: str, value: str) -> str:
    return f"patch|{owner}|{point}|{value}"


def range_name(index: int, key: str) -> str:
    return f"range|{index}|{key}"


def of_run(run, kind: str) -> dict[str, np.ndarray]:
    """The dynamic inputs of `run`'s `kind` steps: its own patches' arrays, and the
    histogram ranges its captures found from the first batch, as `[lo, bin width]`
    (float32, computed in float64 as a constant range would be)."""
    values = {}
    for owner, point, fn in run.patches:
        for name, array in getattr(fn, "values", {}).items():
            values[patch_name(owner, point, name)] = array
    for index, call in enumerate(run.calls):
        spec = call.spec
        if not spec.finds_ranges():
            continue
        for key, (lo, hi) in spec.ranges.found.get(kind, {}).items():
            values[range_name(index, key)] = np.array([lo, (hi - lo) / spec.bins], "float32")
    return values


class Reader:
    """What a traced step reads its dynamic inputs from; notes each name it read
    (`used`), so that a later run of the same compiled step is checked to give it.
    The names go in a set of its own, which the step joins into its key's set
    when it returns (`_scope.join_after`): under torch.compile, a set from before
    the trace changed inside it breaks the graph at every later layer call (as a
    dict does, see `_record._Fresh`)."""

    def __init__(self, model, values: dict | None):
        self.model, self.values, self.used = model, values, set()

    def names(self) -> frozenset:
        if self.values is not None:
            return frozenset(self.values)
        return self.model._cs.provided

    def get(self, name: str, shape: tuple, dtype) -> object:
        self.used.add(name)
        if self.values is not None:
            return self.values[name]
        return self.model._cs.slots[(name, tuple(shape), str(dtype))].value


def unwrap(model, args: tuple) -> tuple[tuple, Reader]:
    """(the step's arguments with its batch unwrapped, the reader of its inputs)."""
    if _JAX and len(args) > 1 and isinstance(args[1], dict) and INPUTS in args[1]:
        data = args[1]
        return (args[0], data[DATA], *args[2:]), Reader(model, data[INPUTS])
    return args, Reader(model, None)


def wrapped(iterator, values: dict):
    """JAX: each batch the jitted step takes, with the run's inputs beside it."""
    return ({INPUTS: values, DATA: data} for data in iterator)


def placed(values: dict) -> dict:
    """JAX: the values on the device, once per run (replicated over the mesh of a
    `keras.distribution`, where one is set)."""
    import jax

    distribution = keras.distribution.distribution()
    sharding = None
    if distribution is not None:
        mesh = distribution.device_mesh.backend_mesh
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return {name: jax.device_put(array, sharding) for name, array in values.items()}


def assign(model, run, kind: str, values: dict) -> None:
    """TF, torch: the slots of `values` hold them (made at first use). Called with
    the model's `dynamic_lock` held; skipped when this run's `kind` steps assigned
    them last, so a run's steps assign once, not per step."""
    state = model._cs
    holder = state.slot_holder
    if holder is not None and holder[0]() is run and holder[1] == kind:
        return
    for name, array in values.items():
        slot = (name, array.shape, str(array.dtype))
        variable = state.slots.get(slot)
        if variable is None:
            strategy = getattr(model, "distribute_strategy", None)
            scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
            with scope:
                # (Not autocast: read inside a mixed-precision layer's call, a
                # float32 patch array or value was read as float16 there, 1e6 as inf.)
                variable = keras.Variable(array, dtype=str(array.dtype), trainable=False,
                                          autocast=False, name="callscope_input")
            state.slots[slot] = variable
        variable.assign(array)
        state.assigned += 1
    state.provided = frozenset(values)
    state.slot_holder = (weakref.ref(run), kind)


def check_used(entry, kind: str, values: dict) -> None:
    """A compiled step reads the inputs its trace named: a later run must give them."""
    missing = sorted(entry.inputs.get(kind, set()) - set(values))
    if missing:
        raise ValueError(
            "This call's compiled step reads histogram ranges found for points that "
            "this call's first batch did not reach (its points differ from the call "
            "that compiled the step, e.g. a data-dependent branch). Pass `hist_range=` "
            f"to `cs.capture` to fix the ranges. Received: missing ranges {missing}"
        )
