"""The collector that runs inside a step: point names, `sow`, layer wrappers, patches.

A *point* is named by where its layer sits in the call tree: the point of the
layer that calls it, `/`, and its own `name` (the root is the model's name). So
`mlp/block/dense` is the Dense that the layer `block` calls inside the model
`mlp`, whatever the build history, in-process and after `load_model`, weightless
layers included. A sown value is `<layer point>/<name>`; an element of a tuple,
list or dict output is `<layer point>/<index or key>`. Two layer instances are
never one point: a second instance that would get a taken name gets `#1`, `#2`,
and so does an element whose key names a sublayer of its layer.

While a capture or patch runs, the per-key step closure opens a `Collector` on
the thread *inside* the traced step; `sow` and the `call` wrappers name points,
apply patches and record what the specs select (for `grad`, they also mark
gradient sources), and `finalize` turns the records into the step's extra
outputs. Outside a capture or patch, `sow` is one context lookup and the
compiled graph has no extra outputs.

A layer called inside a loop body or a branch (an RNN's cell, `keras.ops.scan`,
`fori_loop`, `while_loop`, `map`, `vectorized_map`, `cond`, `switch`) or a
checkpoint's body (`keras.remat`, `jax.checkpoint`, `tf.recompute_grad`) is not a
point: its values cannot leave the body.
Globs skip it; naming it exactly, or patching it, raises `LoopPointError`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import keras
import ml_dtypes
import numpy as np
from keras import ops

from callscope import _backend, _inputs, _keras_compat, _recompute, _reduce, _scope
from callscope._points import (CALL_KINDS, RESERVED, Spec, escaped, found_key, key_name,
                               held_once, local_name, naming_basis, sublayer_basis,
                               sublayer_parts, tree_ranks)

SOWN = "__callscope_sown__"
OUTPUTS = "__callscope_outputs__"
ROWS = "__callscope_rows__"  # a step's batch size, for patches that take the batch
TRACE = "__callscope_trace__"  # the number of the trace a patched step ran
LOST = "__callscope_lost__"  # per narrowing cast of a patch: did a value not fit?
LOOP = object()  # the tree's value for a point inside a loop
_TORCH = keras.backend.backend() == "torch"
_TF = keras.backend.backend() == "tensorflow"


class _Active(threading.local):
    """The collector and patches of the step or eager call running in this thread.

    Thread-local, not a `ContextVar`: both are set around synchronous code only,
    and torch.compile traces an attribute read where `ContextVar.get` breaks the
    graph (torch 2.13). Set in `__init__` (each thread's first use): an
    attribute that is first a class default, then the instance's own, fails a
    compiled step's guard once."""

    def __init__(self):
        self.collector: Collector | None = None
        self.patches: Patches | None = None


_ACTIVE = _Active()


class LoopPointError(ValueError):
    """A capture or patch named a point that runs inside a loop body.

    A layer called inside a loop (an RNN's cell, `keras.ops.scan`) or inside a
    checkpoint (`keras.remat`) makes values that cannot leave it; capture the
    layer that runs the loop or makes the checkpoint instead.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> model = cs.Sequential([keras.Input((3, 2)), keras.layers.SimpleRNN(2, name="rnn")],
    ...                       name="m")
    >>> try:
    ...     with cs.capture(model, "m/rnn/simple_rnn_cell"):
    ...         _ = model.predict(np.ones((1, 3, 2)), verbose=0)
    ... except cs.LoopPointError:
    ...     print("capture m/rnn instead")
    capture m/rnn instead
    """


class _Frame(NamedTuple):
    point: str
    layer: Any
    marker: Any  # _backend.trace_marker() when the layer's call started
    in_loop: bool  # the layer itself runs inside a loop body
    runs_loop: bool  # an RNN: what it calls runs inside its loop


# --------------------------------------------------------------------------
# The in-step collector
# --------------------------------------------------------------------------
class Resolved:
    """What a key's steps resolve once and look up after: which specs select a
    point, and each key's histogram range.

    A point's name comes from the call stack at run time, but for one key (its
    specs are part of it) the same point of the same layer always selects the
    same way, so the globs (or a `select` callable) run once per point, not once
    per step: torch runs a step's Python every step. A compiled step's trace
    runs them once anyway.
    """

    def __init__(self):
        # (point, kind, id(layer), sown, parent, id(root)) -> (layer, ((index,
        # point as the spec names it, records it, grad source), ...))
        self.selection: dict[tuple, tuple] = {}
        # id(layer) -> (layer, its sublayer_basis, naming_basis, sublayer_parts);
        # `checked`: the ids whose basis was checked in `run` (a weak reference:
        # a run holds its captures' values), the run whose steps use them now
        self.sublayers: dict = {}
        self.checked: set[int] = set()
        self.run = None
        self.noted = False  # the points of a step were noted (`_cs_note_points`)

    def begin(self, run) -> None:
        """A step of `run`: the first of that run checks each cached numbering
        against the parents' attributes again (`Collector._sublayer_parts`). Once a
        run, not once a step: that reads every attribute of a parent whose
        sublayers are named by attribute (about 20 µs each); the sublayers
        themselves are checked every step."""
        if self.run is None or self.run() is not run:
            self.run = weakref.ref(run) if run is not None else None
            self.checked.clear()


class _Fresh:
    """A dict attribute made at its first use, not with its object.

    torch.compile traces Keras's torch `train_step` as a frame of its own (it
    breaks the graph at `backward()`), entered with the step's collector made.
    Had the collector's dicts been made with it, the first record would change a
    dict from before the trace, after which dynamo refuses every mappingproxy
    (Keras reads `inspect.signature(...).parameters` in each layer call): a graph
    break per layer. A dict made inside the trace may change freely.
    """

    def __set_name__(self, owner, name):
        self.name = f"_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = getattr(obj, self.name, None)
        if value is None:
            value = {}
            setattr(obj, self.name, value)
        return value

    def __set__(self, obj, value):
        setattr(obj, self.name, value)


class Collector:
    """Names points and records what the active specs select, during one step or
    one eager call."""

    records = _Fresh()  # "index|point|kind" -> values
    # The run of its layer each value of a layer's record is from (`@i` in its key:
    # by position, `input/key` given in runs 0 and 2 read as runs 0 and 1), the
    # point whose runs count, and each layer point's calls begun in this step.
    runs = _Fresh()  # "index|point|kind" -> run numbers, beside `records`
    counted = _Fresh()  # "index|point|kind" -> the layer's point
    calls = _Fresh()  # a layer's point -> its calls begun
    grad_runs = _Fresh()  # "index|point|n" of a gradient source -> (run, layer's point)
    owners = _Fresh()  # point -> id(layer): instances never share
    loops = _Fresh()  # point inside a loop -> the layer running it
    grad_sources = _Fresh()  # "index|point|grad" -> gradient sources
    versions = _Fresh()  # torch: id(record) -> (point, record, its version when recorded)
    batch_axes = _Fresh()  # "index|point" -> a sown value's batch axis, 0 included
    parts = _Fresh()  # id(layer) -> (layer, sublayer_parts) for this step; `_tree_ranks`

    def __init__(self, specs: tuple[Spec, ...], kind: str = "call",
                 resolved: Resolved | None = None):
        self.specs = specs
        self.kind = kind  # train, test, predict or call: which histogram ranges apply
        self.resolved = resolved if resolved is not None else Resolved()
        self.stack: list[_Frame] = []
        self.tree: list[tuple] = []  # (depth, point, layer, value, sown) for summary
        # One point, one value, where a sow names a call's output (`sow`): a layer
        # call's tensor output by point, a sown value by point, and the pairs
        # already taken as one.
        self.outputs: dict[str, tuple] = {}
        self.sown: dict[str, Any] = {}
        self.sown_axes: dict[str, int | None] = {}  # a sown point -> its `batch_axis`
        self.same: set[tuple] = set()
        self.names_checked = -1  # the tree's length when `check_sown_names` last ran
        self.wants_inputs = any("input" in spec.kinds for spec in specs)
        self.wants_grads = any("grad" in spec.kinds for spec in specs)
        self.perturbations: dict | None = None
        self.loss = None  # set by the loss hook, for TensorFlow's outer tape
        self.grad_hooks = None  # torch: gradients taken by the step's own backward()
        self.manual = False  # cs.intermediate_grads takes the gradients itself
        # cs.intermediate_grads outside any step: (its model's name, the open
        # patches it applied as (owner id, point)); see `_grad.check_scopes_applied`.
        self.scopes_applied = None
        self.took_grads_inside = False  # a cs.intermediate_grads ran inside this step
        # JAX's cs.intermediate_grads: the trace marker where `loss_fn` runs. The
        # model's own call under another (a jax.vmap, jax.jit or jax.checkpoint)
        # makes values that cannot leave that transformation, as a loop's cannot.
        self.base = None
        self.discovery = False  # cs.points / cs.summary: any value is listed as it is
        self.rows = None  # the root call's batch size (patches that take the batch)
        # torch: point -> the patch applied there, eagerly (for a checkpoint's
        # recompute: `_recompute`, `RecordingCall.replay`)
        self.applied = {} if _TORCH else None
        self.inputs = None  # _inputs.Reader in a compiled step: ranges found are inputs
        # Makes a gradient source differentiable (TF: tape.watch; torch: a leaf
        # that requires grad) and returns the value the forward pass goes on with.
        self.on_grad_source = _differentiable_source()

    # -- naming ------------------------------------------------------------
    def name(self, layer, local: str | None = None) -> str:
        """The point of `layer` called now: its caller's point, `/`, its own name
        (`local`, see `_points.local_name`; the root: the model's name)."""
        own = local or escaped(layer.name)
        if not self.stack:
            return self._owned(own, layer)
        caller = self.stack[-1]
        # A sublayer of its caller takes its part there and its `#n` among those of
        # that part from where its caller holds it (`sublayer_parts`), whichever
        # runs first (its own `local` is its first holder's). A layer its caller
        # does not hold comes after those (`_unheld_rank`).
        counts, places = self._sublayer_parts(caller.layer)
        held = places.get(id(layer))
        if held is not None:
            own, n = held
        else:
            n = counts.get(own, 0) + self._unheld_rank(layer, own, places)
        return self._owned(f"{caller.point}/{own}", layer, n)

    def _unheld_rank(self, layer, own: str, held) -> int:
        """The place of `layer`, which its caller does not hold, among those of
        its part: first the layers of the caller's own tree that it does not hold,
        in their order; then those of the nearest calling layer's tree that holds
        `layer`, outside the caller's. Never the order they run in."""
        caller = self.stack[-1].layer
        counts, ranks, seen = self._tree_ranks(caller, frozenset(held))
        if id(layer) in ranks:
            return ranks[id(layer)]
        for frame in reversed(self.stack[:-1]):
            outer = self._tree_ranks(frame.layer, seen | frozenset(held), caller)[1]
            if id(layer) in outer:
                return counts.get(own, 0) + outer[id(layer)]
        return counts.get(own, 0)

    def element(self, point: str, path: tuple, layer) -> str:
        """The point of the element at `path` of `layer`'s output, `layer` called at
        `point`: `<layer point>/<index or key>`, with `#n` on the key where sublayers
        of `layer` have that name (a Functional's output `{"o1": o1}` beside its
        layer `o1`, `{"proj": p * 2}` beside `self.proj`), so that the two are never
        one point, patched twice. `n` counts those sublayers, whether they ran in
        this call or not: the name does not depend on which ran first."""
        key, *rest = (escaped(str(part)) for part in path)
        n = self._sublayer_parts(layer)[0].get(key, 0)
        base = f"{point}/{key}"
        return self._owned(base, layer, n, "".join(f"/{part}" for part in rest))

    def _tree_ranks(self, top, skip, caller=None) -> tuple:
        """`_points.tree_ranks(top, ..., skip)`, by each layer's own part as its
        calls name it (`RecordingCall.local`, else its name), kept by this step
        (for `caller`, where `top` is an outer layer). Only by this one: it
        depends on every layer under `top`, which a later step could only check
        by walking them again (it serves the rare layer its caller does not hold)."""
        key = ("ranks", id(top), id(caller))
        hit = self.parts.get(key)
        if hit is not None and hit[0] is top:
            return hit[1]

        def own_part(layer):
            wrapper = _keras_compat.get_instance_attribute(layer, "call")
            local = wrapper.local if isinstance(wrapper, RecordingCall) else None
            return local or escaped(layer.name)

        ranks = tree_ranks(top, own_part, skip)
        self.parts[key] = (top, ranks)
        return ranks

    def _sublayer_parts(self, layer) -> tuple:
        """`_points.sublayer_parts(layer)`, kept for the calls that follow: by this
        step (a trace names every sublayer of a model of many in turn), and by the
        key's steps, checked against what they were made from: the sublayers'
        ids and names every step (`sublayer_basis`), the attributes too in each
        run's first (`naming_basis`). torch runs a step's Python every step: a
        sublayer replaced, added, removed or renamed since the last call, or one
        removed by a callback within a call, or an attribute deleted, is named as
        `cs.points` names it."""
        hit = self.parts.get(id(layer))
        if hit is not None and hit[0] is layer:
            return hit[1]
        resolved = self.resolved
        if _backend.is_tracing_now():
            # A trace names its layers once; kept by it alone (see `_selection`),
            # and with no check or cache, whose reads torch.compile would guard on.
            kept = (layer, None, None, sublayer_parts(layer))
        else:
            kept = resolved.sublayers.get(id(layer))
            cheap = sublayer_basis(_keras_compat.child_layers(layer))  # (every step)
            if kept is None or kept[0] is not layer or kept[1] != cheap \
                    or id(layer) not in resolved.checked:
                basis = naming_basis(layer)
                if kept is None or kept[0] is not layer or kept[2] != basis:
                    kept = (layer, cheap, basis, sublayer_parts(layer))
                resolved.sublayers[id(layer)] = kept
                resolved.checked.add(id(layer))
        self.parts[id(layer)] = (layer, kept[-1])
        return kept[-1]

    def _owned(self, base: str, layer, n: int = 0, tail: str = "") -> str:
        """`base` (then `tail`), or `base#n`: a name no other layer instance has
        (two are never one point)."""
        while True:
            point = f"{base}#{n}{tail}" if n else f"{base}{tail}"
            if self.owners.setdefault(point, id(layer)) == id(layer):
                return point
            n += 1

    def sown_point(self, layer, name: str) -> str:
        for frame in reversed(self.stack):
            if frame.layer is layer:
                return f"{frame.point}/{name}"
        return f"{self.name(layer)}/{name}"

    def relative(self, point: str, owner: int, layer=None, own: str | None = None):
        """`point` as the capture or patch of the model `owner` (an id) names it:
        from that model down, whatever model the run called. None: not inside it.
        `layer` and `own` (its point) name a layer's own output after its call."""
        if not owner or not self.stack or id(self.stack[0].layer) == owner:
            if not self.stack and layer is not None and id(layer) != owner and owner:
                return None  # the root's own output, for an inner model's scope
            return point
        if layer is not None and id(layer) == owner:
            return escaped(layer.name) + point[len(own or point):]
        for frame in self.stack:
            if id(frame.layer) == owner:
                tail = point[len(frame.point):]
                if point.startswith(frame.point) and tail[:1] in ("", "/"):
                    return escaped(frame.layer.name) + tail
                return None
        return None

    def in_loop(self, marker) -> bool:
        """Is a value made now, under `marker`, inside a loop of the layer calling?"""
        if not self.stack:
            # A call at the top of the step inside a loop body, or the re-run of
            # a checkpoint's body in TF's backward pass (`keras.remat`): that of
            # layers seen inside a loop in the forward pass, never the model's own.
            return _backend.marks_loop(marker) or (self.base is not None
                                                   and marker != self.base)
        top = self.stack[-1]
        return top.in_loop or top.runs_loop or top.marker != marker

    def enclosing(self) -> str:
        return next((f.point for f in reversed(self.stack) if not f.in_loop), "")

    def check_loop_point(self, point: str, patches) -> None:
        """A point inside a loop: remembered; an exact selection or a patch raises."""
        enclosing = self.loops.setdefault(point, self.enclosing())
        named = [p for spec in self.specs
                 for p in [self.relative(point, spec.owner)] if spec.names(p)]
        if named or (patches is not None and patches.find(point, self) is not None):
            raise LoopPointError(loop_message(point, enclosing, named))

    # -- recording ---------------------------------------------------------
    def record(self, point: str, layer: Any, kind: str, value: Any, sown: bool,
               parent: str | None = None, skip=(), batch_axis: int | None = 0) -> Any:
        """Records `value` for every spec that selects it; returns the value to use.

        `kind` is `output`, `input` or `input/<argument>`. `parent` is the layer's
        point when `point` is one element of its output: selecting either selects
        the element. `batch_axis` is a sown value's (`sow`). For a `grad` spec the
        value is also a gradient source: with a
        perturbation active (JAX), the returned value is `value + perturbation`, so
        the gradient with respect to the perturbation is d loss / d value. A value
        that is not floating point is no gradient source (`_not_floating`). The
        specs numbered in `skip` recorded it already.
        """
        kept = None  # what the records keep: `value` as it is now (`as_recorded`)
        layout = ()  # (not looked up yet)
        for index, named, records, grads in self._selection(point, layer, kind, sown, parent):
            if index in skip:
                continue
            if sown:
                self._note_batch_axis(f"{index}|{named}", point, batch_axis)
            if layout == ():
                layout = _backend.layout(value)
            if records and layout == "ragged" and self.specs[index].stats is None:
                raise ValueError(_ragged_in_full(named, kind))
            if records:
                if kept is None:
                    # (Sparse: as the dense value it stands for, on every backend: JAX
                    # stacked its BCOO arrays as Python objects, TF's statistics failed.)
                    kept = _backend.as_recorded(
                        ops.convert_to_tensor(value, sparse=False) if layout == "sparse"
                        else value, self.kind)
                    version = _backend.version(kept)
                    if version is not None:
                        self.versions[id(kept)] = (point, kept, version)
                self.records.setdefault(f"{index}|{named}|{kind}", []).append(kept)
                if not sown:
                    self.counted[f"{index}|{named}|{kind}"] = parent or point
                    self.runs.setdefault(f"{index}|{named}|{kind}", []).append(
                        self.calls.get(parent or point, 1) - 1)
            if grads and (isinstance(value, keras.Variable) or not _floating(value)
                          or layout is not None):
                # No gradient there: a glob leaves the point out of `grad`.
                if self.specs[index].names(named):
                    raise ValueError(_not_floating(named, value))
                continue
            if grads:
                sources = self.grad_sources.setdefault(f"{index}|{named}|grad", [])
                name = f"{index}|{named}|{len(sources)}"
                if not sown:
                    self.grad_runs[name] = (self.calls.get(parent or point, 1) - 1,
                                            parent or point)
                if self.perturbations is not None and name in self.perturbations:
                    value = value + self.perturbations[name]
                if self.on_grad_source is not None:
                    value = self.on_grad_source(value)
                    if _reentrant_forward():
                        raise LoopPointError(
                            f"d loss / d `{point}` cannot be taken: the point runs inside "
                            "a reentrant torch checkpoint (`torch.utils.checkpoint(..., "
                            "use_reentrant=True)`), whose forward pass runs without "
                            "gradients, so its gradient would read 0. Checkpoint with "
                            "`use_reentrant=False` (torch's recommendation), or take the "
                            "gradient of the layer that makes the checkpoint."
                        )
                sources.append(value)
        return value

    def note_batch_axes(self, point: str, layer, axis: int | None, parent=None) -> None:
        """`axis` for the records of `layer`'s output at `point` (a sown value that
        is a sublayer's output, or an element of the sowing layer's own output,
        `parent`'s: one point, `sow`)."""
        for index, named, _, _ in self._selection(point, layer, "output", False, parent):
            self._note_batch_axis(f"{index}|{named}", point, axis)

    def _note_batch_axis(self, name: str, point: str, axis: int | None) -> None:
        noted = self.batch_axes.setdefault(name, axis)
        if noted != axis:
            raise ValueError(
                f"`{point}` is sown twice in one step with different batch axes: its "
                "runs are one point's, stacked alike. Sow them under two names, or "
                f"with one `batch_axis`. Received: batch_axis={noted!r} and "
                f"batch_axis={axis!r}")

    def selects(self, point: str, layer, kind: str, sown: bool) -> bool:
        """Whether a spec records `point` (or takes it as a gradient source)."""
        return bool(self._selection(point, layer, kind, sown, None))

    def selecting(self, point: str, layer, sown: bool) -> set[int]:
        """The numbers of the specs that select `layer`'s output at `point` (as a
        sown value or as a call's output): those that took a point named both ways
        there (`record(..., skip=)`)."""
        return {found[0] for found in self._selection(point, layer, "output", sown, None)}

    def _selection(self, full: str, layer, kind: str, sown: bool, parent) -> tuple:
        """((spec index, point as it names it, records it, grad source), ...) of the
        specs that select `full`; resolved once per key (`Resolved`)."""
        root = id(self.stack[0].layer) if self.stack else 0
        cache_key = (full, kind, id(layer), sown, parent, root)
        hit = self.resolved.selection.get(cache_key)
        if hit is not None and hit[0] is layer:
            return hit[1]
        base_kind = kind.partition("/")[0]
        found = []
        for index, spec in enumerate(self.specs):
            point = self.relative(full, spec.owner, None if sown else layer, parent or full)
            if point is None:
                continue
            whole = None if parent is None else point[:len(point) - len(full) + len(parent)]
            if not (spec.selects(point, layer, sown)
                    or (whole is not None and spec.selects(whole, layer, sown))):
                continue
            grads = kind == "output" and "grad" in spec.kinds
            if base_kind in spec.kinds or grads:
                found.append((index, point, base_kind in spec.kinds, grads))
        if not _backend.is_tracing_now():
            # (A trace runs this once anyway; under torch.compile, a dict from
            # before the trace must not change while layers run, see
            # `_scope.ScopeVar`.)
            self.resolved.selection[cache_key] = (layer, tuple(found))
        return tuple(found)

    def grad_source_list(self) -> list[tuple[str, Any]]:
        """(`index|point|n`, tensor) for every gradient source, in call order."""
        return [(f"{name.rsplit('|', 1)[0]}|{n}", v)
                for name, values in self.grad_sources.items() for n, v in enumerate(values)]

    def add_grads(self, grads: Mapping[str, Any]) -> None:
        """Files gradients (keyed `index|point|n`) as `grad` records."""
        for name, grad in grads.items():
            index, point, _ = split_record(name)
            self.records.setdefault(f"{index}|{point}|grad", []).append(grad)
            if (found := self.grad_runs.get(name)) is not None:
                self.runs.setdefault(f"{index}|{point}|grad", []).append(found[0])
                self.counted[f"{index}|{point}|grad"] = found[1]

    def merge(self, records: Mapping[str, list]) -> None:
        for name, values in records.items():
            self.records.setdefault(name, []).extend(values)

    def finalize(self) -> dict[str, Any]:
        """The step's extra outputs: `"index|key"` to a tensor or to partials."""
        self._check_unchanged()
        self.check_sown_names()
        out = {}
        self.unbatched = set()  # the keys of values without a batch axis
        for name, values in self.records.items():
            index, point, kind = split_record(name)
            spec = self.specs[int(index)]
            axis = self._axis(name, values)
            runs, count = self.runs.get(name), len(values)
            if runs is None or len(runs) != count or len(set(runs)) != count:
                runs = range(count)  # (sown values: by position)
            else:
                count = max(count, self.calls.get(self.counted[name], 0))
            for i, value in zip(runs, values):
                key = key_name(point, kind, i, count)
                if axis is None:
                    self.unbatched.add(f"{index}|{key}")
                if spec.stats:
                    _check_real(key, value)
                    out[f"{index}|{key}"] = _reduce.partials(
                        value, spec.stats, spec.bins, self.hist_range(int(index), key)
                    )
                else:
                    out[f"{index}|{key}"] = _batch_first(value, axis)
        if self.rows is not None:
            out[ROWS] = self.rows
        return out

    def unbatched_records(self) -> list[str]:
        """The records of values without a batch axis (`sow`, a layer's 0-d input)."""
        return [name for name, values in self.records.items()
                if self._axis(name, values) is None]

    def _axis(self, name: str, values: list) -> int | None:
        """The batch axis of the record `name`: a sown value's (`batch_axis`), none
        for a layer's 0-d argument (a context value, a scale: one for the whole
        batch, which several replicas must agree on, not one row per replica),
        else 0."""
        kind = split_record(name)[2]
        if kind in _AXED:
            return self.batch_axes.get(name.rsplit("|", 1)[0], 0) if self.batch_axes else 0
        if kind.startswith("input") and all(not len(v.shape) for v in values):
            return None
        return 0

    def output_of(self, point: str, value):
        """The layer whose call at `point` returned `value` itself, or None."""
        found = self.outputs.get(point)
        return found[0] if found is not None and found[1] is value else None

    def first_as_one(self, point: str, value) -> bool:
        """Notes `value` at `point` as one with a call's output; False if it was."""
        pair = (point, id(value))
        if pair in self.same:
            return False
        self.same.add(pair)
        return True

    def check_sown_names(self) -> None:
        """Raises where a `cs.sow` name is also the point of a sublayer's output or
        of an element of its layer's output, with a value that is not that output
        itself (that one is one point: `sow`), a sublayer's several tensors
        included: the two would be one point, read as `@0` and `@1` as if one
        layer ran twice, and patched twice. (Not in a loop: no such point is
        recorded.)"""
        if self.names_checked == len(self.tree):  # (finalize, then collecting_for)
            return
        self.names_checked = len(self.tree)
        sown = {entry[1]: entry[2] for entry in self.tree if entry[4] and entry[3] is not LOOP}
        if not sown:
            return
        for _, point, layer, value, was_sown in self.tree:
            if was_sown or point not in sown or value is LOOP:
                continue
            raise ValueError(_sown_name_clash(point, sown[point], layer))

    def _check_unchanged(self) -> None:
        """Raises where a torch op changed a recorded tensor in place after it was
        recorded: its record, read at the step's end, would show the new values."""
        for point, value, version in self.versions.values():
            if value._version != version:
                raise ValueError(
                    f"`{point}` was changed in place after callscope recorded it, by a "
                    "later op of the call (torch: `x += 1`, `x.mul_(2)`, `x[i] = v` on "
                    "the same tensor or a view of it), so its capture would show the "
                    "changed values. Make that op out-of-place (`x = x + 1`), or record "
                    "a copy (`cs.sow(self, name, keras.ops.copy(x))`). Received: "
                    f"version {version} when recorded, {value._version} at the step's end"
                )

    def hist_range(self, index: int, key: str):
        """`(lo, hi)` where constant (given, or eager: the spec's own found range);
        in a compiled step, a found range is the step's input `[lo, bin width]`."""
        spec = self.specs[index]
        given = spec.given_range(key.rpartition(":")[2].partition("/")[0])
        if self.inputs is None or given is not None or spec.ranges is None \
                or not spec.stats or "hist" not in spec.stats:
            return spec.range_for(key, self.kind)
        prefix = _inputs.range_name(index, "")
        found = {n[len(prefix):] for n in self.inputs.names() if n.startswith(prefix)}
        name = found_key(key, found)
        if name is None:
            return (-1.0, 1.0)
        return self.inputs.get(prefix + name, (2,), "float32")


_AXED = ("output", "grad")  # the kinds of a sown value's records (`sow`'s batch_axis)


def split_record(name: str) -> tuple[str, str, str]:
    """`index|point|kind` (a point may hold any character but `|`)."""
    index, rest = name.split("|", 1)
    point, kind = rest.rsplit("|", 1)
    return index, point, kind


def loop_message(point: str, enclosing: str, named=()) -> str:
    received = f"select={list(named)!r}" if named else f"patches={{{point!r}: ...}}"
    if not enclosing:  # the model's own call runs inside it
        return (
            f"`{point}` runs where the model's call runs inside a loop body or a "
            "transformation (keras.ops.scan/map/vectorized_map around the model, or, "
            "in cs.intermediate_grads's `loss_fn` on JAX, a jax.vmap, jax.jit or "
            "jax.checkpoint of the model's call): a value made there cannot leave it "
            "as it is, so callscope "
            "cannot capture, patch or differentiate with respect to it. Call the "
            "model directly (in `loss_fn`, or jit the function that calls "
            f"cs.intermediate_grads). Received: {received}")
    return (
        f"`{point}` runs inside a loop body in `{enclosing}` (an RNN's "
        "cell, or keras.ops.scan/fori_loop/while_loop/map/vectorized_map, a branch "
        "of keras.ops.cond/switch, a checkpoint: keras.remat, jax.checkpoint, "
        "tf.recompute_grad, or a function given to keras.ops.custom_gradient): "
        "a value made inside one cannot leave it, so "
        "callscope cannot capture or patch it. Capture "
        f"or patch `{enclosing}` instead (its output "
        "holds every step of the loop), or compute the value outside the loop. "
        f"Received: {received}"
    )


def _differentiable_source():
    if _TORCH:
        return lambda v: v if v.requires_grad else v.detach().requires_grad_()
    return None


def _reentrant_forward() -> bool:
    """torch: is this gradient source made where no graph is recorded, inside a
    reentrant checkpoint's forward pass (`LoopPointError`)? Elsewhere under no_grad
    (evaluate, predict) there is no gradient to take, and none is asked for."""
    import torch

    return not torch.is_grad_enabled() and _keras_compat.in_reentrant_checkpoint_forward()


def active_collector() -> Collector | None:
    return _ACTIVE.collector


@contextlib.contextmanager
def collecting_for(specs: tuple[Spec, ...], kind: str = "call",
                   resolved: Resolved | None = None) -> Iterator[Collector]:
    """Opens a collector for `specs` in this context (inside a `kind` step, or
    eagerly); `resolved` is what the key's earlier steps resolved."""
    collector = Collector(specs, kind, resolved)
    outer = activate(collector, _ACTIVE.patches)
    try:
        yield collector
        collector.check_sown_names()
    finally:
        activate(*outer)


def activate(collector: Collector | None, patches: Patches | None) -> tuple:
    """Makes `collector` and `patches` this thread's active ones; returns the ones
    before, to `activate` again after. (A compiled step uses this in `try`/`finally`
    rather than `collecting_for` and `patching`: see `_scope.push`.)"""
    outer = (_ACTIVE.collector, _ACTIVE.patches)
    _ACTIVE.collector, _ACTIVE.patches = collector, patches
    return outer


class Collected:
    """What `collecting()` recorded: pass `.values` out of a differentiated function."""

    def __init__(self):
        self.values: dict[str, list] = {}


@contextlib.contextmanager
def collecting() -> Iterator[Collected]:
    """Records sown values into a dict of its own, for a user's stateless JAX step.

    Values sown inside `jax.value_and_grad` belong to the differentiated trace and
    cannot leave it except through the function's outputs. Wrap the forward pass,
    return `sown.values` in the aux output, and hand them to `cs.emit` outside:

        def compute_loss_and_updates(self, tv, ntv, x, y, training=False):
            with cs.collecting() as sown:
                y_pred, ntv = self.stateless_call(tv, ntv, x, training=training)
            return self.compute_loss(x, y, y_pred), (ntv, sown.values)

        # in train_step, after grad_fn(...):  cs.emit(sown_values)

    Outside a capture it collects nothing and `sown.values` is `{}`.

    Example:

    >>> import callscope as cs
    >>> with cs.collecting() as sown:
    ...     pass
    >>> sown.values
    {}
    """
    outer = active_collector()
    result = Collected()
    if outer is None:
        yield result
        return
    with collecting_for(outer.specs, outer.kind, outer.resolved) as inner:
        # One naming for the whole step: the same stack, owners and loop points.
        inner.stack, inner.owners, inner.loops = list(outer.stack), outer.owners, outer.loops
        inner.tree = outer.tree
        inner.calls, inner.runs, inner.counted = outer.calls, outer.runs, outer.counted
        inner.grad_runs = outer.grad_runs
        inner.perturbations = outer.perturbations
        inner.batch_axes = outer.batch_axes
        inner.scopes_applied = outer.scopes_applied
        yield result
    result.values = inner.records
    if inner.rows is not None:
        outer.rows = inner.rows
    for name, sources in inner.grad_sources.items():  # shapes for JAX's eval_shape probe
        outer.grad_sources.setdefault(name, []).extend(sources)


def emit(values: Mapping[str, list]) -> None:
    """Hands values recorded by `collecting()` to the capture of the running step.

    Example:

    >>> import callscope as cs
    >>> cs.emit({})  # outside a capture: nothing to do
    """
    collector = active_collector()
    if collector is not None and values:
        collector.merge(values)


_CHECKED_NAMES: set[str] = set()


SOW_SYMBOLIC = (
    "`cs.sow` was given a symbolic KerasTensor: that runs while a functional model is "
    "being built, outside any layer's `call`, and calling the model never runs that "
    "line again, so the point would record nothing (and take no patch). Sow inside a "
    "layer's `call` (a small layer of your own around the value), or capture the output "
    "of the layer that makes it (`cs.capture(model, \"<its point>\")`). Received: "
    "name={name!r}, value={value!r}")


def check_sow_name(name) -> None:
    """A sown name is one path element: keys reserve `/ : @ | #` and glob
    characters, and `%` starts what `_points.escaped` encodes."""
    if name in _CHECKED_NAMES:
        return
    if not isinstance(name, str) or not name or any(c in name for c in ("%", *RESERVED)):
        raise ValueError(
            "`cs.sow` takes a non-empty name without the characters "
            f"{' '.join(RESERVED)} %: keys use them (`point:kind`, `@i`, `/` between "
            "layers, `%` in the names of layers that hold the others) and `select` "
            "globs match them. Use letters, digits, `_`, `-` or "
            f"`.`, e.g. 'pre_act'. Received: name={name!r}"
        )
    _CHECKED_NAMES.add(name)


def sow(layer: keras.layers.Layer, name: str, value: Any, *,
        batch_axis: int | None = 0) -> Any:
    """Records `value` as the point `<layer's point>/<name>`, and returns it.

    It records only while a `cs.capture` that selects the point is running (a
    `cs.patch` of the point replaces the value); otherwise it costs one context
    lookup and adds nothing to the compiled graph. Call it inside a layer's `call`.
    `name` is one path element: letters, digits, `_`, `-`, `.`.

    Go on with the value it returns (`h = cs.sow(self, "h", h)`): a patch
    replaces that value, and a gradient capture takes d loss / d it. The value
    passed in is not the one returned: where the layer goes on with it, a patch
    of the point changes nothing and its gradient reads 0.

    `batch_axis` says which axis of `value` holds the batch's rows: a capture
    joins batches (and, under `tf.distribute`, replicas) along it, and records the
    value with that axis first (`batch_axis=1` for a time-major `(T, batch, F)`
    value records `(batch, T, F)`). `None`: the value has no batch axis (a
    scalar, a value of the weights alone); each call records one row, stacked on
    a new first axis, and under several replicas, which must agree on it, one
    replica's is kept (its gradient is their sum). A scalar (0-d) value has no
    axis to join, so it records one row per call whatever the axis; under
    `tf.distribute` sow it with `batch_axis=None`, so that its replicas count once.
    Statistics do not depend on it.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> class Block(keras.layers.Layer):
    ...     def call(self, x):
    ...         h = cs.sow(self, "pre_act", x * 2.0)
    ...         return keras.ops.relu(h)
    >>> model = cs.Sequential([keras.Input((2,)), Block(name="block")], name="mlp")
    >>> with cs.capture(model) as cap:
    ...     _ = model.predict(np.array([[1.0, -1.0]]), verbose=0)
    >>> cap["mlp/block/pre_act:output"]
    array([[ 2., -2.]], dtype=float32)

    A value without a batch axis, one row per batch:

    >>> class Scaled(keras.layers.Layer):
    ...     def call(self, x):
    ...         cs.sow(self, "scale", keras.ops.ones((3,)), batch_axis=None)
    ...         return x
    >>> model = cs.Sequential([keras.Input((2,)), Scaled(name="scaled")], name="s")
    >>> with cs.capture(model) as cap:
    ...     _ = model.predict(np.zeros((4, 2)), batch_size=2, verbose=0)
    >>> cap["s/scaled/scale:output"].shape
    (2, 3)
    """
    check_sow_name(name)
    if isinstance(value, keras.KerasTensor):
        raise ValueError(SOW_SYMBOLIC.format(name=name, value=value))
    collector = active_collector()
    patches = active_patches()
    checkpoint = None  # torch: the checkpoint pass this call is part of (`_recompute`)
    if _TORCH and (collector is not None or _recompute.live()) and (
            not _backend.is_tracing_now()):
        checkpoint = _recompute.where(patched=patches is not None, enclosing=_ENCLOSING)
        if checkpoint is not None and checkpoint[1] is not None:  # its recompute
            noted = _recompute.replayed(checkpoint, _recompute.sown(layer, name))
            if noted is None or noted[1] is None:
                return value
            return _masked_like(noted[0].run(noted[1], _one_tensor(noted[1][1], value)), value,
                                fresh=False)
    if collector is None or _keras_compat.in_symbolic_scope():  # (see `_symbolic`)
        return value
    point = collector.sown_point(layer, name)
    depth = len(collector.stack)
    called = collector.output_of(point, value) if _notes_one_points() else None
    if called is not None:
        # The output of the sublayer whose point this is (`self.gate` sown as
        # "gate"): one point, one value. That call applied its patch and recorded
        # it for the captures that select it; the others (the default selects sown
        # points) record it here, once.
        if checkpoint is not None:
            _recompute.note(checkpoint, _recompute.sown(layer, name), (patches, None))
        if not collector.first_as_one(point, value):
            return value
        taken = collector.selecting(point, called, sown=False)
        batch_axis = _axis_of(point, value, batch_axis)
        if batch_axis != 0:  # also for the records the call made
            collector.note_batch_axes(point, called, batch_axis)
            if patches is not None:
                _check_called_patch(patches, point, collector, called, batch_axis)
        recorded = collector.record(point, layer, "output", value, sown=True, skip=taken,
                                    batch_axis=batch_axis)
        return _masked_like(recorded, value, fresh=True)
    found = None if patches is None else patches.find(point, collector)
    if checkpoint is not None:
        _recompute.note(checkpoint, _recompute.sown(layer, name), (patches, found))
    if collector.in_loop(_backend.trace_marker()):
        collector.check_loop_point(point, patches)
        collector.tree.append((depth, point, layer, LOOP, True))
        return value
    patched = found is not None
    given = value
    if not collector.discovery and (patched or collector.selects(point, layer, "output",
                                                                 sown=True)):
        value = _one_tensor(point, value)  # (what is not recorded nor patched may be any)
        batch_axis = _axis_of(point, value, batch_axis)
    if patched:
        value = _masked_like(patches.apply(point, value, batch_axis=batch_axis), given,
                             fresh=False)
    recorded = _masked_like(collector.record(point, layer, "output", value, sown=True,
                                             batch_axis=batch_axis), value, fresh=True)
    collector.tree.append((depth, point, layer, recorded, True))
    # The caller goes on with its own value (a capture must not change the model),
    # unless a patch replaced it or a gradient is taken with respect to it.
    returned = recorded if patched or recorded is not value else given
    if _notes_one_points():
        collector.sown[point] = returned
        collector.sown_axes[point] = batch_axis  # (for its layer's output, `_record_outputs`)
    return returned


def _sown_name_clash(point: str, owner, layer) -> str:
    """`Collector.check_sown_names`' error: `owner` sowed at `point`, which is also
    `layer`'s output (`owner`'s own: an element of it)."""
    name = point.rpartition("/")[2]
    other = ("an element of its output" if layer is owner
             else f"the output of the sublayer there (`{layer.name}`)")
    # (`check_sown_names` raises it after a torch.compile'd step, where it cannot
    # tell whether the step was compiled: torch's message names both cases.)
    compiled = (" (or, under torch.compile, `jit_compile=True`, any value: layers "
                "cannot note there which value is which)" if _TORCH else "")
    return (
        f"`cs.sow(self, {name!r}, ...)` in `{owner.name}` names the point "
        f"`{point}`, which is also {other}, with a value that is not that "
        f"output itself{compiled}: the two would be one point, read as `@0` and `@1` "
        "as if one layer ran twice. Give the sown value another name (a sublayer's "
        "output itself may be sown under its point"
        f"{', but not under torch.compile' if _TORCH else ''}). Received: name={name!r}"
    )


def _check_called_patch(patches, point: str, collector, called, batch_axis) -> None:
    """Raises where a patch that takes the batch replaced a sublayer's output that
    is then sown under its point with another batch axis: the sublayer's call
    patched it with its first axis as the rows, before `sow` gave the axis."""
    found = patches.find(point, collector, called, point)
    if found is None or not getattr(found[2], "takes_batch", False):
        return
    name = found[1]  # as the patch names it
    own = (f"Sow the value under a name of its own (e.g. `cs.sow(self, "
           f"{name.rpartition('/')[2] + '_rows'!r}, ..., batch_axis={batch_axis!r})`) "
           "and patch that point, or patch with `fn(value)`" if batch_axis is not None
           else f"A value sown with batch_axis=None has no rows: patch it {_BY_VALUE}")
    raise _batch_patch_error(
        name, f"and `{name}` is the output of the sublayer `{called.name}`, sown there "
        f"with batch_axis={batch_axis!r}: the sublayer's call patched it first, taking "
        f"its first axis as the rows, before `cs.sow` gave the batch axis. {own}")


_BY_VALUE = "with `fn(value)` (e.g. `lambda v: v * 0`)"  # a patch that needs no rows


def _batch_patch_error(name: str, why: str) -> ValueError:
    """A patch that takes the batch, where the point's value has no rows to give."""
    return ValueError(
        f"The patch of `{name}` takes the batch (`fn(value, batch)` or an array of the "
        f"data's rows), {why}. Received: a patch that takes the batch")


def _axis_of(point: str, value, batch_axis: int | None) -> int | None:
    """`batch_axis` of `value` sown at `point` (recorded or patched), counted from
    the front."""
    if batch_axis is None or (type(batch_axis) is int and batch_axis == 0):
        return batch_axis
    if isinstance(batch_axis, bool) or not isinstance(batch_axis, (int, np.integer)):
        raise TypeError(
            "`cs.sow`'s `batch_axis` is the axis of the value that holds the batch's "
            "rows (an int), or None for a value without one (a scalar, a value of the "
            f"weights). Received: batch_axis={batch_axis!r}")
    rank = len(value.shape)
    if not -rank <= batch_axis < rank:
        raise ValueError(
            f"`{point}` is sown with batch_axis={batch_axis}, but its value has "
            f"{rank} axes. Give an axis of the value, or batch_axis=None for a value "
            f"without a batch axis. Received: batch_axis={batch_axis}, a value of shape "
            f"{tuple(value.shape)}")
    return int(batch_axis) % rank


def _batch_first(value, axis: int | None):
    """A full record as a capture stacks it: its batch axis first (`sow`); a value
    without one (or a scalar) as one row."""
    if axis is None or not len(value.shape):
        return ops.expand_dims(value, 0)
    return ops.moveaxis(value, axis, 0) if axis else value


def _notes_one_points() -> bool:
    """Whether a sown value may be told as a call's own output (`Collector.outputs`,
    `Collector.sown`): not under torch.compile, where a dict written while layers
    run is guarded on, and the step recompiles at every layer."""
    return not (_TORCH and _backend.is_tracing_now())


def _one_tensor(point: str, value: Any) -> Any:
    """A sown value is one tensor (a number or numpy array becomes one, a float64
    array as floatx, as Keras converts its inputs: the same dtype on every
    backend): its rows are what a capture stacks, and its elements what a
    statistic reduces."""
    if isinstance(value, keras.Variable) or ops.is_tensor(value):
        return value
    # (numpy's scalars first: np.float64 is a Python float too, and TF kept its
    # float64 where JAX and torch gave float32.)
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.kind in "biuf":
            floatx = array.dtype == np.float64
            tensor = ops.convert_to_tensor(array, keras.backend.floatx() if floatx else None)
            if array.dtype.kind in "iu" and array.size:
                _check_ints_held(point, array, tensor)
            return tensor
    elif isinstance(value, (bool, int, float)):
        return ops.convert_to_tensor(value)  # Keras's rule: int32, float32
    several = isinstance(value, (tuple, list, dict))
    dtype = getattr(value, "dtype", None)
    received = (f"{type(value).__name__} of dtype {dtype}" if dtype is not None
                else type(value).__name__)
    raise TypeError(
        f"cs.sow records one tensor, and `{point}` was given a {received}"
        + (": sow each of its tensors under a name of its own, e.g. "
           "`cs.sow(self, 'h_0', h[0])`" if several else
           ": it converts Python and numpy bools, ints and floats; convert other "
           "values to a tensor first (`keras.ops.convert_to_tensor`), or sow a number "
           "that stands for them")
        + f". Received: value={received}")


def _check_real(key: str, value) -> None:
    """Statistics are of real numbers: a complex value's imaginary part was
    dropped without a word (every statistic of `1j * x` read 0), and a TF string
    failed inside the step with a bare `UnimplementedError`."""
    dtype = keras.backend.standardize_dtype(value.dtype)
    if dtype.startswith("complex") or dtype == "string":
        stands = ("(`keras.ops.abs(v)`, `keras.ops.real(v)`)" if dtype != "string"
                  else "(a length, a count)")
        raise TypeError(
            f"cs.capture(reduce=...) computes statistics of real numbers, and "
            f"`{key}` holds {dtype} values. Sow a real value that stands for them "
            f"{stands}, or capture this point in full (`reduce=None`, or leave it out "
            f"of `select`). Received: `{key}` of dtype {dtype}")


def _check_ints_held(point: str, array: np.ndarray, tensor) -> None:
    """Integers the backend narrowed (JAX without `jax_enable_x64` holds int64 and
    uint64 as 32-bit) are refused where they do not fit: 2**40 + 1 read 1."""
    held = keras.backend.standardize_dtype(tensor.dtype)
    if not _inputs.holds(array, held):
        low, high = array.min(), array.max()
        raise ValueError(
            f"cs.sow of `{point}` was given {array.dtype} values from {low} to {high}, "
            f"and {keras.backend.backend()} holds them as {held}, which cannot (JAX has no "
            "64-bit integers unless `jax_enable_x64` is set): they would be recorded "
            "wrapped around. Sow values within that range, or as floats. Received: "
            f"value of dtype {array.dtype}, min={low}, max={high}")


# --------------------------------------------------------------------------
# Wrapping the `call` of every layer, once
# --------------------------------------------------------------------------
def install_wrappers(model) -> None:
    """Puts a recording wrapper in the instance attributes `call` and
    `quantized_call` of every layer, once.

    `Operation.__call__` calls `self.call`, or `self.quantized_call` for a
    quantized layer, so an instance attribute shadows the method. The wrapper
    stays: it consults the collector and patches of the run in effect, and costs
    one context lookup when there are none. Installing again is a no-op for
    wrapped layers, so a nested call never wraps twice. The wrapper holds the
    layer's bound method (deep copies rebind it) and exposes its signature, so
    Keras code that inspects `layer.call` sees the real one.
    """
    _keras_compat.mark_loops()
    for parent in _keras_compat.flatten_layers(model):
        if isinstance(parent, keras.layers.InputLayer):
            continue
        children = _keras_compat.child_layers(parent)
        attributes = held_once(parent, children)
        for layer in [parent, *children]:
            for name in ("call", "quantized_call"):
                wrapper = _keras_compat.get_instance_attribute(layer, name)
                if not isinstance(wrapper, RecordingCall):
                    wrapper = RecordingCall(layer, getattr(layer, name))
                    _keras_compat.set_instance_call(layer, wrapper, name)
                if layer is not parent and wrapper.local is None:  # named by its holder
                    wrapper.local = local_name(parent, layer, attributes)


class RecordingCall:
    """The recording wrapper of one layer's `call` (see `install_wrappers`)."""

    def __init__(self, layer, original):
        self.layer = layer
        self.__wrapped__ = original
        self.local = None  # its own part of its point (`_points.local_name`)
        self._parameters = None

    @property
    def __signature__(self):
        if self._parameters is None:  # Keras inspects `layer.call`: made once
            self._parameters = inspect.signature(self.__wrapped__)
        return self._parameters

    def __call__(self, *args, **kwargs):
        original = self.__wrapped__
        collector = _ACTIVE.collector
        patches = _ACTIVE.patches
        if _TORCH and (collector is not None or _recompute.live()) and (
                not _backend.is_tracing_now()):
            # torch: the checkpoint pass this call is part of (`_recompute`). Not
            # under torch.compile: a write there recompiles per layer, and
            # AOTAutograd's backward reruns no Python. (Unbound until `where`
            # answers, so that its walk of the stack passes this frame by.)
            checkpoint = _recompute.where(patched=patches is not None, enclosing=_ENCLOSING)
            if checkpoint is not None and checkpoint[1] is not None:
                return self.replay(checkpoint, args, kwargs)
        else:
            checkpoint = None
        if collector is None or _symbolic(args, kwargs):
            if checkpoint is not None:
                _recompute.note(checkpoint, self, None)
            elif collector is None and not (_TORCH and _backend.is_tracing_now()) and (
                    _scope.records_open() and not _symbolic(args, kwargs)):
                # (Not under torch.compile: dynamo cannot read a ContextVar, and a
                # model call it compiles is refused under a capture or patch.)
                _check_inside_a_call(self.layer)
            return original(*args, **kwargs)
        layer = self.layer
        if collector.stack and collector.stack[-1].layer is layer:  # call <-> quantized_call
            if checkpoint is not None:
                _recompute.note(checkpoint, self, None)
            return original(*args, **kwargs)
        point = collector.name(layer, self.local)
        collector.calls[point] = collector.calls.get(point, 0) + 1
        if checkpoint is not None:
            _recompute.note(checkpoint, self, (patches, point, collector.applied))
        marker = _backend.trace_marker()
        depth = len(collector.stack)
        if collector.in_loop(marker):
            collector.check_loop_point(point, patches)
            collector.stack.append(_Frame(point, layer, marker, True, False))
            try:
                outputs = original(*args, **kwargs)
            finally:
                collector.stack.pop()
            collector.tree.append((depth, point, layer, LOOP, False))
            return outputs
        if not collector.stack and patches is not None and patches.takes_batch:
            collector.rows = _batch_rows(args, kwargs)
        if collector.wants_inputs:
            self._record_inputs(collector, point, args, kwargs)
        runs_loop = isinstance(layer, keras.layers.RNN)
        collector.stack.append(_Frame(point, layer, marker, False, runs_loop))
        made = len(collector.tree)  # the call's own entries follow
        try:
            outputs = original(*args, **kwargs)
        finally:
            collector.stack.pop()
        return _record_outputs(collector, patches, point, layer, outputs, depth, made)

    def replay(self, checkpoint, args, kwargs):
        """The layer's call again in a torch checkpoint's recompute (`_recompute`):
        the patches the same call applied in the forward pass apply again, at the
        same points, so that the recompute, from which torch takes the gradients,
        is the forward pass. Nothing is recorded (the forward pass was)."""
        noted = _recompute.replayed(checkpoint, self)
        outputs = self.__wrapped__(*args, **kwargs)
        if noted is None:
            return outputs
        patches, point, applied = noted
        if patches is None or not applied:
            return outputs
        called = outputs
        if point in applied:
            outputs = patches.run(applied[point], outputs)
        if _is_tensor(outputs):
            return _masked_like(outputs, called, fresh=False)
        flat = keras.tree.flatten_with_path(outputs)
        values = [v for _, v in flat]
        if outputs is not called:
            before = keras.tree.flatten(called)
            if len(before) == len(values):
                values = [_masked_like(v, b, fresh=False) for v, b in zip(values, before)]
        for i, (path, value) in enumerate(flat):
            found = applied.get((point, path))  # an element's patch, as `_record_outputs` noted it
            if found is not None and _is_tensor(value):
                values[i] = _masked_like(patches.run(found, values[i]), values[i], fresh=False)
        return keras.tree.pack_sequence_as(outputs, values)

    def _record_inputs(self, collector, point, args, kwargs):
        named = self._arguments(args, kwargs)
        if len(named) == 1:
            collector.record(point, self.layer, "input", named[0][1], sown=False)
            return
        for label, leaf in named:
            collector.record(point, self.layer, f"input/{label}", leaf, sown=False)

    def _arguments(self, args, kwargs) -> list[tuple[str, Any]]:
        """(argument name[/element], tensor) for every tensor the call received."""
        signature = self.__signature__
        try:
            bound = signature.bind(*args, **kwargs).arguments
            kinds = {n: p.kind for n, p in signature.parameters.items()}
        except TypeError:
            bound, kinds = {**{str(i): a for i, a in enumerate(args)},
                            **{escaped(k): v for k, v in kwargs.items()}}, {}
        named = []
        for name, value in bound.items():
            if name == "training":
                continue
            if kinds.get(name) is inspect.Parameter.VAR_KEYWORD:
                items = [(escaped(key), item) for key, item in value.items()]
            elif kinds.get(name) is inspect.Parameter.VAR_POSITIONAL:
                items = [(f"{name}/{i}", v) for i, v in enumerate(value)]
            else:
                items = [(name, value)]
            for label, item in items:
                for path, leaf in keras.tree.flatten_with_path(item):
                    if _is_tensor(leaf):
                        # (Keys escaped as output elements' are: `{"p/q": a, "p":
                        # {"q": b}}` read as one label, two runs of a layer run once.)
                        parts = [label, *(escaped(str(part)) for part in path)]
                        named.append(("/".join(parts), leaf))
        return named


# A layer call's checkpoint place, in its `__call__`'s local `checkpoint`: the
# stack walk of a call inside it stops there (`_keras_compat.torch_checkpoint`).
_ENCLOSING = (RecordingCall.__call__.__code__, "checkpoint")


def _is_tensor(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(
        value, np.generic)


def _floating(value) -> bool:
    """Is `value` floating point, the only kind of value a gradient is taken at?"""
    return keras.backend.is_float_dtype(value.dtype)


def _not_floating(point: str, value) -> str:
    """The error for a gradient asked of a point by its exact name, at a value that
    is not floating point (an argmax, a mask, token ids), or at a variable sown as
    it is: a glob leaves it out."""
    if layout := _backend.layout(value):
        # (TF's tape refused a SparseTensor as a source; JAX's value_and_grad a BCOO.)
        dense = ("keras.ops.convert_to_tensor(x, sparse=False)" if layout == "sparse"
                 else "x.to_tensor()")
        return (
            f"d loss / d `{point}` is not taken: the value of `{point}` is a {layout} "
            "tensor, at which callscope takes no gradient. Take it at a dense point "
            f"next to it, or sow the dense value (`cs.sow(self, 'dense', {dense})`) and "
            f"take it there (a glob such as `*` leaves {layout} points out of `grad`). "
            "Received: "
            f"select={point!r} with kinds including 'grad', at a {type(value).__name__}")
    if isinstance(value, keras.Variable):
        # Measured (keras 3.15.1): JAX and torch raised inside their autodiff, and
        # TF gave the weight's gradient, through every read of the variable, where
        # a sown tensor's gradient is through the value `sow` returns.
        return (
            f"d loss / d `{point}` is not taken: `{point}` is a variable sown as it is "
            f"({value.path!r}), whose gradient would be the weight's, through every use "
            "of the variable, not through the value `cs.sow` returns. Sow the value the "
            "layer computes with (e.g. `w = cs.sow(self, 'kernel', self.kernel * 1.0)`, "
            "then compute with `w`), or capture it "
            f"with kinds=('output',). Received: select={point!r} with kinds including "
            f"'grad', at a {type(value).__name__}")
    dtype = keras.backend.standardize_dtype(value.dtype)
    return (
        f"d loss / d `{point}` is not defined: a gradient is taken only at a "
        f"floating-point value, and the value of `{point}` is {dtype}. Take "
        "gradients at floating-point points only (a glob such as `*` leaves points "
        "whose values are not floating point out of `grad`, and records their other "
        f"kinds), or capture `{point}` with kinds=('output',). Received: "
        f"select={point!r} with kinds including 'grad', at a value of dtype {dtype}"
    )


def _logits_kept(new, returned):
    """`new`, made of what a patch `returned` (TF's shape check in the graph makes
    a new tensor), with the logits Keras keeps on `returned` where it has them: a
    patch that returns a sigmoid's output as it is (`lambda h: h`) left the loss
    computed from clipped probabilities, 10.73 for 26.04."""
    if new is returned or not _is_tensor(new) or not _is_tensor(returned):
        return new
    logits = _keras_compat.keras_logits(returned)
    if logits is not None and _keras_compat.keras_logits(new) is None:
        _keras_compat.set_keras_logits(new, logits)
    return new


def _ragged_in_full(point: str, kind: str) -> str:
    return (
        f"`{point}:{kind}` is a ragged tensor, whose rows differ in length: a full capture "
        "stacks rows of one shape, and padding them would add zeros that read as values. "
        f"Capture its statistics (`reduce=`), or sow a dense value made from it (its "
        "`flat_values`, or `x.to_tensor()` beside its `row_lengths()`). Received: a "
        f"{kind} of type RaggedTensor for a capture with reduce=None")


def _masked_like(new, old, fresh: bool):
    """`new`, which goes on in the model in place of `old` (a patch's value, or
    the tensor a gradient is taken at), with `old`'s Keras mask where it has
    none: a model that masks its padding goes on masking it. (Keras sets no
    mask again on a layer output that carries one, nor on a sown value.) A
    patch's value may be a tensor the patch keeps (a constant), so unless it
    is `fresh` the mask goes on a copy, never on the patch's own tensor."""
    if new is old or not _is_tensor(new):
        return new
    mask = _keras_compat.keras_mask(old)
    if mask is None or _keras_compat.keras_mask(new) is not None:
        return new
    if not fresh:
        new = ops.copy(new)
    _keras_compat.set_keras_mask(new, mask)
    return new


OUTSIDE_A_CALL = (
    "{what} of `{model}` is open, and its layer `{layer}` ran in `{method}` of "
    "`{owner}`, outside any call of the model, where nothing is recorded or patched "
    "(keras_hub's `generate` calls the layers itself). Captures and patches apply "
    "to the model's calls: `fit`, `evaluate`, `predict`, the `*_on_batch` methods "
    "and `model(x)` (and the calls of callscope models inside it). Call the model "
    "inside the scope, or run `{method}` outside it. Received: `{layer}` called in "
    "`{owner}.{method}`")
_STACK_LIMIT = 256  # frames looked at for the method that runs (a deep decode loop)


def _check_inside_a_call(layer) -> None:
    """Refuses a layer's call made in a method of the captured (or patched) model,
    or of a callscope model holding it, outside any call of a callscope model: keras_hub's
    `generate` calls the layers itself, and would record nothing and take no
    patch, without a word. A layer called otherwise (on its own, in another model
    that shares it, in a shape-only trace) is no call of the model, and records
    nothing by design. (Inside a call whose capture does not take it, the run was
    checked when it began.) Between a call's steps (its callbacks: a `generate`
    there) the call's own entry point is a method of the model too: a layer that
    only it is found running (a callback that calls the layer itself) is one
    called on its own."""
    if not _outside_every_call():
        return
    for what, model in _open_scopes():
        if id(layer) not in _keras_compat.layers_held(model):
            continue
        frame = inspect.currentframe()
        for _ in range(_STACK_LIMIT):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                break
            code = frame.f_code  # a method's first argument (`self`, by any name)
            owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
            if owner is None or not _is_method_of(owner, code):
                continue
            if owner is model or (isinstance(owner, keras.Model) and hasattr(owner, "_cs")
                                  and id(model) in _keras_compat.layers_held(owner)):
                method = code.co_name.removeprefix("tf__")  # (autograph's copy)
                if method in CALL_KINDS or method.startswith("_cs_"):
                    break  # (a call's callback, between its steps)
                raise RuntimeError(OUTSIDE_A_CALL.format(
                    what=what, model=model.name, layer=layer.name, method=method,
                    owner=owner.name))


def _outside_every_call() -> bool:
    """Not in a shape-only trace, nor in a step or a direct call of a run in
    progress here (O(runs): per layer call)."""
    return not _keras_compat.in_symbolic_scope() and not any(
        _scope.calling(run) for run in _scope.runs_here())


def _open_scopes() -> list:
    """`(what, model)` of each capture and patch open here."""
    return [("A `cs.capture`", c.model) for c in _scope.open_captures()] + [
        ("A `cs.patch`", model) for model, _ in _scope.open_patches()]


OWN_LOOP = (
    "{what} of `{model}` is open, and `{owner}.{method}` runs the layers in a loop "
    "of its own (keras_hub's generation loop), outside any call of the model, where "
    "nothing is recorded or patched; once compiled, that loop never even calls them "
    "again. Captures and patches apply to the model's calls: `fit`, `evaluate`, "
    "`predict`, the `*_on_batch` methods and `model(x)`. Run `{method}` outside the "
    "scope, or call the model inside it. Received: `{owner}.{method}` called inside "
    "the scope")


def refusing_under_scopes(method, shown: str):
    """`method` of a callscope model that makes the loop of its own that `shown`
    runs the layers in (keras_hub's `make_generate_function`, which `generate`
    calls first), refused under a capture or patch of that model or of one it
    holds. Its layers' wrappers refuse it while the loop traces
    (`_check_inside_a_call`), but a loop compiled by an earlier call runs without
    them: the scope recorded and patched nothing, and only warned as it exited."""
    if getattr(method, "_cs_refuses_under_scopes", False):
        return method

    @functools.wraps(method)
    def refusing(self, *args, **kwargs):
        if _scope.records_open() and _outside_every_call():
            held = _keras_compat.layers_held(self)
            for what, model in _open_scopes():
                if id(model) in held:
                    raise RuntimeError(OWN_LOOP.format(
                        what=what, model=model.name, owner=self.name, method=shown))
        return method(self, *args, **kwargs)

    refusing._cs_refuses_under_scopes = True
    return refusing


def _is_method_of(owner, code) -> bool:
    """Whether `code` runs a method of `owner`'s class (not a function that takes
    the model first: `embed(model, x)`). TF's autograph runs a converted copy,
    `tf__<name>`, of a method of that name."""
    converted = code.co_name.startswith("tf__")
    method = inspect.getattr_static(type(owner), code.co_name.removeprefix("tf__"), None)
    method = getattr(method, "__func__", method)  # (a classmethod, a staticmethod)
    if not callable(method):
        return False
    return converted or getattr(inspect.unwrap(method), "__code__", None) is code


def _symbolic(args, kwargs) -> bool:
    """A shape-only call: on KerasTensors (torch: meta tensors), or any call inside
    Keras's `compute_output_spec`. That one may run on a step's own tensors: the
    first step of an unbuilt subclassed model builds it there (`_maybe_build`),
    and what it records belongs to no step (TF: tensors of a scratch graph; torch:
    meta tensors, from weights it makes there)."""
    if _keras_compat.in_symbolic_scope():
        return True
    # The common call, one tensor and flags: no tree walk (torch runs this every step).
    if len(args) == 1 and _is_tensor(args[0]) and not any(
            isinstance(v, list | tuple | dict) or _is_tensor(v) for v in kwargs.values()):
        return _backend.is_symbolic(args)
    return _backend.is_symbolic(_leaves((args, kwargs)))


def _batch_rows(args, kwargs):
    leaf = next((v for v in _leaves((args, kwargs)) if _is_tensor(v) and len(v.shape)), None)
    if leaf is None:
        return None
    rows = leaf.shape[0]
    rows = ops.shape(leaf)[0] if rows is None else rows
    return ops.reshape(ops.cast(rows, "int32"), (1,))


def _leaves(value, into=None) -> list:
    """The leaves of nested lists, tuples and dicts in `value`, in the order of
    `keras.tree.flatten`. A walk of its own for the layer calls of a step: under
    torch.compile, `keras.tree.flatten` changes a dict that dynamo watches, which
    breaks the graph at every later layer call (a model with an `Add` layer, or a
    patch that takes the batch, compiled a frame per layer, up to the recompile
    limit)."""
    into = [] if into is None else into
    if isinstance(value, dict):
        keys = list(value)
        if not isinstance(value, collections.OrderedDict):  # kept in order, as there
            try:
                keys.sort()
            except TypeError:  # keys that do not compare (Enum members): as given
                pass
        for key in keys:
            _leaves(value[key], into)
    elif isinstance(value, list | tuple):
        for item in value:
            _leaves(item, into)
    else:
        into.append(value)
    return into


def _record_outputs(collector, patches, point, layer, outputs, depth, made):
    """Patches and records a layer's output, element by element for a structure;
    returns the value the model goes on with (patched, or perturbed for JAX grads),
    with the call's Keras masks (`_masked_like`). `collector.tree[made:]` is what
    the call noted."""
    called = outputs
    if patches is not None:
        outputs = patches.apply(point, outputs, layer, point)
    if _is_tensor(outputs):
        outputs = _masked_like(outputs, called, fresh=False)
        outputs = _masked_like(collector.record(point, layer, "output", outputs, sown=False),
                               outputs, fresh=True)
        collector.tree.append((depth, point, layer, outputs, False))
        if _notes_one_points():
            collector.outputs[point] = (layer, outputs)
        return outputs
    flat = keras.tree.flatten_with_path(outputs)
    leaves = [i for i, (_, v) in enumerate(flat) if _is_tensor(v)]
    values = [v for _, v in flat]
    if outputs is not called:  # a patch of the whole structure: masks element by element
        before = keras.tree.flatten(called)
        if len(before) == len(values):
            values = [_masked_like(v, b, fresh=False) for v, b in zip(values, before)]
    if len(leaves) == 1:
        value = values[leaves[0]]
        values[leaves[0]] = _masked_like(
            collector.record(point, layer, "output", value, False), value, fresh=True)
        if _notes_one_points():
            collector.outputs[point] = (layer, values[leaves[0]])  # the point's one tensor
    else:
        for i in leaves:
            path = flat[i][0]
            child = collector.element(point, path, layer)
            value = values[i]
            # (With `#n`, sublayers have the element's name: a value sown under it
            # is their clash, `check_sown_names`.)
            plain = child == "/".join([point, *map(str, path)])
            if plain and patches is not None and collector.sown.get(child) is not value and any(
                    entry[4] and entry[1] == child and entry[3] is not LOOP
                    for entry in collector.tree[made:]):
                # Sown in the call under this element's point, with another value (or
                # under torch.compile, where no one-point note is made: `sow`):
                # `check_sown_names` raises after the step; raised here where a patch
                # of the point would run a second time, with its first axis as rows.
                raise ValueError(_sown_name_clash(child, layer, layer))
            if plain and collector.sown and collector.sown.get(child) is value:
                # Sown inside the call under this element's point (`cs.sow(self,
                # "h", h)` then `return {"h": h}`): one point, one value. The sow
                # applied its patch and recorded it for the captures of sown points.
                if collector.first_as_one(child, value):
                    taken = collector.selecting(child, layer, sown=True)
                    selected = collector._selection(child, layer, "output", False, point)
                    for found in selected:
                        if found[3] and found[0] not in taken and _floating(value):
                            raise ValueError(_sown_element_grad(child, point))
                    axis = collector.sown_axes.get(child, 0)
                    if selected and axis != 0:  # its records here, as the sow's
                        collector.note_batch_axes(child, layer, _axis_of(child, value, axis),
                                                  parent=point)
                    values[i] = _masked_like(
                        collector.record(child, layer, "output", value, False, parent=point,
                                         skip=taken), value, fresh=True)
                continue
            if patches is not None:
                value = _masked_like(patches.apply(child, value, layer, point,
                                                   noted=(point, path)),
                                     value, fresh=False)
            values[i] = _masked_like(
                collector.record(child, layer, "output", value, False, parent=point), value,
                fresh=True)
            collector.tree.append((depth + 1, child, layer, values[i], False))
    if not leaves:
        return outputs
    outputs = keras.tree.pack_sequence_as(outputs, values)
    collector.tree.append((depth, point, layer, outputs, False))
    return outputs


def _sown_element_grad(child: str, point: str) -> str:
    return (
        f"`{child}` is sown inside `{point}`'s call and returned as an element of its "
        "output: one point, whose gradient is taken where it is sown (every use "
        "counts, those inside the call too). A selection of the layer's output "
        "elements would take it at the output. Select the sown point itself, or "
        "sow the value under another name. Received: a gradient capture that "
        f"selects `{point}`'s elements and not `{child}`"
    )


# --------------------------------------------------------------------------
# Patches (interventions): replace a point's output inside every call
# --------------------------------------------------------------------------
class Batch(NamedTuple):
    """Where the batch a patch runs on sits in the call's data.

    Attributes:
        start: the row offset of this batch: a scalar int32 tensor (batches of a
            `predict` or `evaluate` come in order, so row `start + i` of the data
            is row `i` of the batch).
        rows: the number of rows in this batch (an int, or a scalar tensor where
            the batch size is unknown while tracing).

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> model = cs.Sequential([keras.Input((1,)), keras.layers.Identity(name="x")], name="m")
    >>> def row_index(value, batch):  # each row becomes its row number in the data
    ...     rows = keras.ops.arange(batch.rows) + batch.start
    ...     return keras.ops.cast(keras.ops.reshape(rows, (-1, 1)), value.dtype)
    >>> with cs.patch(model, {"m/x": row_index}):
    ...     model.predict(np.zeros((5, 1)), batch_size=2, verbose=0)[:, 0]
    array([0., 1., 2., 3., 4.], dtype=float32)
    """

    start: Any
    rows: Any


class Patches:
    """The active patches of a run, `(owner id, point, fn)`; notes which were hit.

    A patch opened on a model inside the called one names its points from that
    model down (`Collector.relative`)."""

    def __init__(self, functions: tuple, offset=None, inputs=None):
        self.owners: dict[int, dict[str, Any]] = {}
        for owner, point, fn in functions:
            self.owners.setdefault(owner, {})[point] = fn
        self.hits: set[tuple[int, str]] = set()
        # "point\tgiven\twanted" -> a traced bool: a patch's value that the
        # point's dtype cannot hold (read on the host when the call ends)
        self.lost: dict[str, Any] = {}
        self.offset = offset  # a keras.Variable: rows before this batch
        self.inputs = inputs  # _inputs.Reader in a compiled step; None: eager
        self.takes_batch = any(getattr(fn, "takes_batch", False)
                               for _, _, fn in functions)

    def find(self, point: str, collector, layer=None, own=None):
        """(owner, point as the owner names it, fn) of the patch of `point`, or None.
        Scopes on two models (one inside the other) that patch one layer are
        refused: one would be lost."""
        found = None
        for owner, functions in self.owners.items():
            name = collector.relative(point, owner, layer, own)
            if name is not None and name in functions:
                if found is not None:
                    raise ValueError(_scope.TWO_PATCHES.format(
                        what=f"`{point}` (one layer, named `{found[1]}` and `{name}` "
                             "by the models they were opened on)",
                        received=f"points={[found[1], name]}"))
                found = owner, name, functions[name]
        return found

    def apply(self, point: str, value: Any, layer=None, own=None, batch_axis=0,
              noted=None) -> Any:
        """`value` patched where a patch names `point`; a torch recompute
        (`RecordingCall.replay`) finds the patch again by `noted` (default: `point`)."""
        collector = _ACTIVE.collector
        found = self.find(point, collector, layer, own)
        if found is None:
            return value
        if (collector is not None and collector.applied is not None
                and not _backend.is_tracing_now()):
            collector.applied[point if noted is None else noted] = found
        return self.run(found, value, batch_axis)

    def run(self, found: tuple, value: Any, batch_axis=0) -> Any:
        """`value` patched by `found` (`find`'s answer). A patch that takes the batch
        sees a sown value batch-first, as a capture records it (`sow`'s
        `batch_axis`), and the value goes on in its own layout."""
        owner, name, fn = found
        self.hits.add((owner, name))
        if _backend.layout(value) == "ragged":  # (TF's error named neither)
            raise ValueError(
                f"The patch of `{name}` would replace a ragged tensor, whose rows differ "
                "in length, which callscope does not patch. Patch a dense point beside it "
                "(the layer that makes it, or one after it). Received: a value of type "
                f"RaggedTensor at `{name}`")
        dynamic = self._values(owner, name, fn)
        if getattr(fn, "takes_batch", False):
            if self.offset is None:
                raise ValueError(
                    f"The patch of `{name}` takes the batch (`fn(value, batch)` or an "
                    "array), which only `predict`, `evaluate` and the *_on_batch methods "
                    "give (each call's data starts at row 0). Received: a direct model(x) "
                    "call"
                )
            if batch_axis is None:
                raise _batch_patch_error(name, "but the point is sown with batch_axis=None: "
                                         f"its value has no rows. Patch it {_BY_VALUE}")
            if not _is_tensor(value):
                first = "/".join(map(str, keras.tree.flatten_with_path(value)[0][0]))
                raise _batch_patch_error(
                    name, f"but the layer's output there is a {type(value).__name__} of "
                    "tensors, whose rows are its elements'. Patch each element at its own "
                    f"point (`{name}/{first}`, ...), or the whole output with `fn(value)`")
            if getattr(value, "ndim", None) == 0:
                raise _batch_patch_error(name, "but the point's value is a scalar: it has "
                                         f"no rows. Patch it {_BY_VALUE}")
            if batch_axis:
                first = ops.moveaxis(value, batch_axis, 0)
                out = self.run(found, first)
                return ops.moveaxis(out, 0, batch_axis)
            rows = value.shape[0] if value.shape[0] is not None else ops.shape(value)[0]
            batch = Batch(ops.cast(self.offset.value, "int32"), rows)
            out = fn(value, batch) if dynamic is None else _with_values(fn, name, value,
                                                                        batch, dynamic)
        elif dynamic is not None:
            out = _with_values(fn, name, value, None, dynamic)
        else:
            out = fn(value)
        rows = (" It took the value's first axis as the batch's rows: a value whose rows "
                "are on another axis is patched where it is sown, with "
                "`cs.sow(..., batch_axis=)`." if getattr(fn, "takes_batch", False) else "")
        checked = _backend.check_same_shape(
            out, value,
            f"The patch of `{name}` returned a value of shape {{got}}, but the point's "
            f"value has shape {{want}}: a patch must keep the shape. For a patch that "
            "depends on the batch, take `fn(value, batch)` and use `batch.start` and "
            f"`batch.rows`, or pass the full-data array itself as the patch.{rows} "
            f"Received: a value of shape {{got}} for `{name}`"
        )
        return _logits_kept(_in_dtypes_of(name, checked, value, self.lost), out)


    def _values(self, owner, name, fn):
        """A `DynamicPatch`'s values as tensors: the step's inputs when compiled
        (the key's patch holds shapes only), its own arrays when eager."""
        arrays = getattr(fn, "values", None)
        if arrays is None:
            return None
        if self.inputs is None:
            return {n: ops.convert_to_tensor(a) for n, a in arrays.items()}
        return {n: self.inputs.get(_inputs.patch_name(owner, name, n), a.shape, a.dtype)
                for n, a in arrays.items()}


def _with_values(fn, name: str, value, batch, values: dict):
    """`fn(value, batch, values)`. TensorFlow's arithmetic refuses tensors of two
    dtypes where JAX and torch promote (`value * values["s"]` with `s=2` held as
    int32 at a float32 point): its error then names the values and the fix."""
    try:
        return fn(value, batch, values)
    except Exception as error:
        want = getattr(value, "dtype", None)
        other = {n: keras.backend.standardize_dtype(v.dtype) for n, v in values.items()
                 if want is not None and _inputs.kind(v.dtype) != _inputs.kind(want)}
        # (Only TF's own dtype error: `values["position"]` of int32 is legit
        # where it is an index, and the patch's own errors stay as they are.)
        text = str(error)
        if not (_TF and other and any(d in text for d in other.values())
                and ("does not match type" in text or "was expected to be a" in text)):
            raise
        # (A new error: Keras's layer call makes its own of the same class, and
        # drops notes; TF's own classes cannot be made from a message.)
        raise TypeError(
            f"The patch of `{name}` raised {type(error).__name__}: {error}\nIt was given "
            f"values of dtypes {other}, and the point's value is "
            f"{keras.backend.standardize_dtype(want)}: TensorFlow does not promote "
            "dtypes in arithmetic. Use keras.ops (`keras.ops.multiply(value, s)`), cast "
            "(`keras.ops.cast(s, value.dtype)`), or pass floats (2.0, not 2). Received: "
            f"values with dtypes {other}") from error


def active_patches() -> Patches | None:
    return _ACTIVE.patches


def _in_dtypes_of(name: str, out, value, lost: dict):
    """A patch's result in the dtypes of the point's value: the layers after it got
    whatever dtype it returned, and read it each backend its own way (a float32
    result at an int32 point: one_hot gave zeros on JAX, a truncation on TF and
    torch). A cast that would change values beyond rounding (floats to ints,
    numbers to bools) is refused; one that may not hold every value (int32 to
    uint8 wraps 300 to 44, float32 to float16 overflows 1e6 to inf) is checked
    (`_unheld`)."""
    outs, wants = keras.tree.flatten(out), keras.tree.flatten(value)
    cast = []
    for got, want in zip(outs, wants):
        got_dtype, want_dtype = getattr(got, "dtype", None), getattr(want, "dtype", None)
        if got_dtype is None or want_dtype is None or got_dtype == want_dtype:
            cast.append(got)
            continue
        got_dtype, want_dtype = (keras.backend.standardize_dtype(d) for d in (got_dtype,
                                                                             want_dtype))
        if got_dtype == want_dtype:
            cast.append(got)
        elif _inputs.may_hold(want_dtype, got_dtype):
            _unheld(name, got, got_dtype, want_dtype, lost)
            cast.append(ops.cast(got, want_dtype))
        else:
            raise TypeError(
                f"The patch of `{name}` returned {got_dtype} values, and the point's value "
                f"is {want_dtype}: casting them back would change them ("
                f"{_inputs.cast_loss(want_dtype)}), "
                f"and the layers after it take {want_dtype}. Return the point's dtype "
                f"(e.g. `keras.ops.cast(keras.ops.round(out), {want_dtype!r})`). Received: a "
                f"value of dtype {got_dtype} for a point of dtype {want_dtype}")
    if all(c is o for c, o in zip(cast, outs)):
        return out
    return keras.tree.pack_sequence_as(out, cast)


def _limits(dtype: str) -> tuple | None:
    """(lowest, highest) value of a numeric dtype; None for bool and others."""
    kind = _inputs.kind(dtype)
    if kind not in ("int", "float"):
        return None
    info = (np.iinfo if kind == "int" else ml_dtypes.finfo)(dtype)
    return info.min.item() if kind == "float" else int(info.min), (
        info.max.item() if kind == "float" else int(info.max))


# (Looked up, never computed, inside a step: under torch.compile, `ml_dtypes.finfo`
# broke the graph into a frame per layer.)
_LIMITS = {name: _limits(name) for name in (
    "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "bfloat16", "float32", "float64")}


def _narrows(given: str, wanted: str) -> bool:
    """Whether some value of dtype `given` is out of `wanted`'s range."""
    held, into = _LIMITS.get(given), _LIMITS.get(wanted)
    return held is not None and into is not None and (
        held[0] < into[0] or held[1] > into[1])


def _unheld(name: str, got, given: str, wanted: str, lost: dict) -> None:
    """Checks that the values of a patch's `got` fit in the point's dtype, where the
    cast may not hold them all: an error at once in an eager step; in a compiled
    one a flag the step returns, read when the call ends (`Run.check_casts`)."""
    if not _narrows(given, wanted):
        return
    if _inputs.kind(wanted) == "int":
        # By range, in the given dtype (which holds each bound it is checked
        # against): a round trip passed int8 -1 as uint8, 255, and back, -1.
        (low, high), (held_low, held_high) = _LIMITS[wanted], _LIMITS[given]
        flag = None
        for past, bound in ((ops.less, low), (ops.greater, high)):
            if held_low < bound < held_high:  # (else no given value is past it)
                beyond = ops.any(past(got, ops.convert_to_tensor(bound, dtype=given)))
                flag = beyond if flag is None else ops.logical_or(flag, beyond)
        if flag is None:
            return
    else:
        finite = ops.isfinite(got) if _inputs.kind(given) == "float" else True
        flag = ops.any(ops.logical_and(finite, ops.logical_not(ops.isfinite(
            ops.cast(got, wanted)))))
    if _backend.is_tracing_now():
        key = f"{name}\t{given}\t{wanted}"  # (a layer called twice: either call's)
        lost[key] = flag if key not in lost else ops.logical_or(lost[key], flag)
    elif bool(ops.convert_to_numpy(flag)):
        raise ValueError(unheld_message(name, given, wanted))


def unheld_message(name: str, given: str, wanted: str) -> str:
    if _inputs.kind(wanted) == "int":
        limits = np.iinfo(wanted)
        past = f"holds [{limits.min}, {limits.max}], and a value past that wraps around"
    else:
        past = f"holds finite values up to {ml_dtypes.finfo(wanted).max:g}; past that, inf"
    return (
        f"The patch of `{name}` gave {given} values that the point's dtype, {wanted}, "
        f"cannot hold ({wanted} {past}): the layers after it would have taken other "
        f"values. Give values within {wanted}'s range (`keras.ops.clip`). Received: "
        f"{given} values out of {wanted}'s range for `{name}`")


@contextlib.contextmanager
def patching(functions: tuple, offset=None, inputs=None) -> Iterator[Patches | None]:
    patches = Patches(functions, offset, inputs) if functions else None
    outer = activate(_ACTIVE.collector, patches)
    try:
        yield patches
    finally:
        activate(*outer)

