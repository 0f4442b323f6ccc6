"""The compiled functions of a key, and how a run reaches them.

- `PerKeyFunction`: `model.<kind>_function`, resolved through the run in effect to
  its key's table entry (Keras reads and writes these attributes).
- `StepDispatch`: shadows `<kind>_step` on the instance; while a run's made function
  executes, it calls the key's step closure, otherwise the plain step.
- `step_closure`: a fresh callable per key that enters the key's values inside the
  traced step (a sealed frame) and returns captured values as extra outputs.
- `RunFunction`: wraps a made function: the run's dynamic values in, its captured
  values out to the run's sinks.
"""

from __future__ import annotations

import contextlib
import re
from types import MappingProxyType

import keras
import numpy as np

from callscope import _backend, _inputs, _keras_compat, _keys, _record, _scope, _steps

_JAX = keras.backend.backend() == "jax"
_TF = keras.backend.backend() == "tensorflow"


def _shape_errors_raised(function):
    """`function`, its patches' shape checks in the TF graph raised as ValueErrors."""
    def call(*args, **kwargs):
        with _backend.graph_checks_raised():
            return function(*args, **kwargs)

    return call


class PerKeyFunction:
    """`self.<kind>_function`, resolved through the run in effect (see above)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __get__(self, model, owner=None):
        if model is None:
            return self
        return model._cs_entry_now().functions[self.kind]

    def __set__(self, model, value):
        model._cs_entry_now().functions[self.kind] = value


class StepDispatch:
    """Shadows `<kind>_step` on the instance: calls the step closure of the key in
    effect. Holds the model as an attribute (not a closure), so deep copies rebind."""

    def __init__(self, model, kind: str):
        self.model = model
        self.kind = kind

    def __call__(self, *args, **kwargs):
        model = self.model
        run = _scope.run_of(model) if _scope.stepping(model) else None
        entry = run.entry if run is not None else model._cs.replica_entry
        if entry is None:  # a direct call (a custom loop, a callback): the caller's scope
            return getattr(type(model), f"{self.kind}_step")(model, *args, **kwargs)
        return entry.steps[self.kind](*args, **kwargs)


def step_closure(model, kind, values, specs, patches, reads, hits, used):
    """A fresh callable over `type(model).<kind>_step` that enters `values`.

    New per key on purpose: JAX keys its trace cache on the callable. Everything it
    reads is fixed by `values`, `specs` and `patches`: the frame it enters is sealed,
    so a scope value outside the key cannot leak into the trace, and a name outside
    the key that the trace looks up is kept in `reads` (checked at every call). With
    capture specs or patches, it names points inside the step (`_record.Collector`),
    returns the records as extra outputs, and notes the patched points it reached
    (checked when each run ends): by trace in `hits` (trace number -> points), the
    number returned beside the records, so that a run checks the traces its own
    steps ran, not a trace of an earlier run (a batch of another shape that took
    another branch); an eager step's in its run (`Run.eager_hits`). Patch values
    and found histogram ranges are inputs of the step (`_inputs.py`); the names it
    reads go in `used`.
    """
    step = getattr(type(model), f"{kind}_step")
    resolved = _record.Resolved()  # selections, once per key (torch: not per step)
    values = MappingProxyType(dict(values))
    # eager steps outside a run (tf.distribute's replica threads): the key's
    untracked = _scope.Later(hits.setdefault(_keys.UNTRACKED, set()))
    reads, hits, used = _scope.Later(reads), _scope.LaterByTrace(hits), _scope.Later(used)

    def scoped_step(*args, **kwargs):
        # `try`/`finally`, not `with`: see `_scope.push`.
        frame = _scope.sealed(values)
        token = _scope.push(frame)
        state = None
        try:
            if _JAX and model._cs.dynamic:  # the values are in the step's state (args[0])
                state = _scope.enter_step_state(model, args[0])
            if not specs and not patches:
                return step(model, *args, **kwargs)
            return _recording_step(*args, **kwargs)
        finally:
            if state is not None:
                _scope.exit_step_state(state)
            _scope.pop(token)
            _scope.join_after(reads, frame.reads)

    def _recording_step(*args, **kwargs):
        offset = model._cs.rows_offset if patches else None
        args, inputs = _inputs.unwrap(model, args)
        tracing = _backend.is_tracing_now()
        if not tracing:  # (torch.compile would guard on the run)
            resolved.begin(_scope.run_of(model))
        collector = _record.Collector(specs, kind, resolved)
        active = _record.Patches(patches, offset, inputs) if patches else None
        outer = _record.activate(collector, active)
        try:
            collector.inputs = inputs
            if collector.wants_grads and kind != "predict":
                result = _steps.step_with_grads(model, kind, step, args, kwargs, collector)
            else:
                result = step(model, *args, **kwargs)
            result = _steps.unsmuggle(result, collector)
            run = None if tracing else _scope.run_of(model)
            trace = _backend.new_trace() if active is not None and tracing else None
            if trace is not None:
                model._cs_note_points(collector, active, _scope.Later(set()), resolved)
                _scope.join_after(hits, {trace.number: frozenset(active.hits)})
            elif run is not None:
                # An eager step: its run checks what its own steps reached, not
                # what the key's steps reached in earlier runs (a branch taken then).
                model._cs_note_points(collector, active, _scope.Later(
                    run.eager_hits.setdefault(kind, set())), resolved)
            else:
                model._cs_note_points(collector, active, untracked, resolved)
            sown = _steps.finalize(collector, kind, args, kwargs)
            if trace is not None:
                sown[_record.TRACE] = trace.tensor
                if active.lost:
                    # (float32: tf.distribute averages a step's outputs over its
                    # replicas, and an int mean of [0, 1] read 0)
                    sown[_record.LOST] = {k: keras.ops.cast(flag, "float32")
                                          for k, flag in active.lost.items()}
            return _steps.attach(kind, result, sown) if sown else result
        finally:
            _record.activate(*outer)
            _scope.join_after(used, inputs.used)

    scoped_step.__name__ = f"{kind}_step"
    return scoped_step


def marked(key: tuple, mark: str) -> tuple:
    return next((item[1] for item in key if item[0] == mark), ())


ESCAPED_TRACER = (
    "callscope: a capture is open, and a value it recorded may have been made inside a "
    "JAX transformation in your own step (a stateless `train_step` that calls "
    "`jax.value_and_grad` or `jax.grad` around the model): such a value can leave it "
    "only through its outputs. Wrap the forward in `with cs.collecting() as sown:`, "
    "return `sown.values` in the aux output, and call `cs.emit(sown_values)` after the "
    "gradient (README: \"Your own stateless JAX `train_step`\").")


STEPS_DIFFER = (
    "callscope: a capture is open, and the model runs several steps per execution "
    "(steps_per_execution={spe}). If this error is Keras joining the outputs of "
    "those steps (a mismatch of keys or structure), they recorded different points "
    "(a branch that one batch took, such as the uneven last batch's, traced with its "
    "shape): compile with steps_per_execution=1, or capture points that every step "
    "reaches.")


@contextlib.contextmanager
def _noting_escaped_tracers(run):
    """JAX's error for a value that left its transformation, with what to do where a
    capture recorded it (it names no point, and never callscope); and Keras's, for
    the steps of one execution whose captured values differ."""
    try:
        yield
    except Exception as error:
        if _JAX and run is not None and run.calls and _keras_compat.is_escaped_tracer(error):
            error.add_note(ESCAPED_TRACER)
        spe = getattr(run.model, "steps_per_execution", 1) if run is not None else 1
        if run is not None and run.calls and spe > 1 and isinstance(error, (
                ValueError, TypeError)) and re.search(r"mismatch|structure|instance of dict",
                                                      str(error)):
            error.add_note(STEPS_DIFFER.format(spe=spe))
        raise


class RunFunction:
    """Wraps a made `*_function`: puts the run's dynamic values in, and takes its
    captured values out before Keras's loop sees them.

    It reads the run from the caller's context, so the same compiled function
    serves every run of its key, each with its own values and sinks.
    """

    def __init__(self, model, kind: str, function):
        self.model, self.kind, self.__wrapped__ = model, kind, function
        # TF: the function a run with patches calls (their shape checks raised as
        # ValueErrors), made once here rather than at every step.
        self._checked = _shape_errors_raised(function) if _TF else function

    def __call__(self, *args, **kwargs):
        model, function = self.model, self.__wrapped__
        run = _scope.run_of(model)
        if run is not None:
            run.check_before_step(model, self.kind, args)
        if run is not None and run.ranges and any(s.ranges.pending(self.kind)
                                                  for s in run.ranges):
            # Histogram ranges come from the batch this first step sees, fixed
            # before the step is traced (it reads them while tracing).
            batch, args, state = _keras_compat.peek_batch(args)
            model._cs_find_ranges(run.ranges, self.kind, batch, state, patches=run.patches)
        inputs = run.inputs_for(self.kind) if run is not None and run.has_inputs else None
        if inputs and _JAX:  # beside each batch, placed on the device once per run
            args = (args[0], _inputs.wrapped(args[1], inputs), *args[2:])
        if run is not None and run.patches:
            function = self._checked
        if run is None or not (run.dynamic or run.replicated or run.offset
                               or (inputs and not _JAX)):  # common case
            with _scope.steps_of(model), _noting_escaped_tracers(run):
                result = _steps.pop_sown(self.kind, function(*args, **kwargs), run)
            return _steps.gathered_outputs(self.kind, result)
        dynamic = run.dynamic
        if run.offset is not None:  # this step's row offset, for patches of the batch
            dynamic = (*dynamic, (run.offset.target, np.asarray(run.offset.rows, "int32")))
        if dynamic and _JAX:
            state = _keras_compat.replace_non_trainable(args[0], dynamic, _backend.place_like)
            args = (state, *args[1:])
        with contextlib.ExitStack() as stack:
            state = model._cs
            if run.replicated:
                # Replica threads see no contextvars: they find the entry here.
                stack.enter_context(state.replica_lock)
                state.replica_entry = run.entry
                stack.callback(setattr, state, "replica_entry", None)
            if (dynamic or inputs) and not _JAX:
                stack.enter_context(state.dynamic_lock)
                for variable, array in dynamic:
                    variable.assign(array)
                if inputs:
                    _inputs.assign(model, run, self.kind, inputs)
            stack.enter_context(_scope.steps_of(model))
            stack.enter_context(_noting_escaped_tracers(run))
            result = function(*args, **kwargs)
        return _steps.gathered_outputs(self.kind, _steps.pop_sown(self.kind, result, run))
