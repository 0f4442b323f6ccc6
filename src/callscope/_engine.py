"""The engine: one run per call, and the compiled functions of each key.

Each public call (`fit`, `evaluate`, `predict`, the `*_on_batch` methods; a direct
`model(x)` in `_mixin.py`) makes one `Run` (`_run.py`) from the caller's scopes and
its keyword arguments, and holds it in a `ContextVar` while Keras runs. Nothing about
the call is written to the model:

- Keras reads and writes `self.train_function`/`test_function`/`predict_function`.
  Here they are data descriptors that resolve through the run in effect to the
  `KeyTable` entry of its key (`_keys.py`), so two threads with different keys each
  get their own compiled functions, with no swap and no lock across Keras's loop.
- `train_step`/`test_step`/`predict_step` are shadowed once, on the instance, by a
  dispatcher that calls the key's fresh step closure. The closure enters exactly the
  key's values *inside* the traced step (a sealed frame, `_scope.py`), which reaches
  the replica threads of `tf.distribute` and leaves user-overridden steps unchanged.
- Dynamic values travel with the run: substituted into the JAX state of each step,
  or assigned to a hidden variable for the length of one compiled call on
  TensorFlow and torch. They are never weights.
- Calls of one model take turns where they share state (`_run.Gate`): every call
  on JAX, the calls with metrics on TensorFlow and torch. The turn passes to other
  threads around every callback, with the paused call's state parked.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import keras
import numpy as np

from callscope import _backend, _inputs, _keras_compat, _keys, _patch, _record, _scope, _steps
from callscope._capture import begin_calls
from callscope._capturing import CAPTURE, PATCH, CaptureMixin, first_x
from callscope._functions import (
    PerKeyFunction,
    RunFunction,
    StepDispatch,
    marked,
    step_closure,
)
from callscope._logger import EpochStatistics
from callscope._points import CALL_KINDS
from callscope._run import Gate, RowOffset, Run, SharedState, with_gate_callbacks

DEFAULT_CACHE_SIZE = 8
_KINDS = _keys.KINDS
_JAX = keras.backend.backend() == "jax"
_TF = keras.backend.backend() == "tensorflow"
_WITH_METRICS = ("fit", "evaluate", "train_on_batch", "test_on_batch")


class _State:
    """callscope's per-model registry: names, compiled functions, known points.

    It holds what is true of the model, never of one call.
    """

    def __init__(self, model):
        self.static: dict[str, None] = {}
        self.dynamic: dict[str, keras.Variable | None] = {}
        self.lock = threading.RLock()  # registration only; never held across a call
        self.unbaked = False
        self.declared: frozenset | None = None  # names declared by sublayers
        # points seen in traces -> layer, element or sown, for error messages
        self.seen: dict[str, str] = {}
        self.loops: dict[str, str] = {}  # points seen inside loops -> the loop's layer
        self.rows_offset: keras.Variable | None = None  # patches that take the batch
        # TF, torch: the steps' dynamic inputs (`_inputs.py`): (name, shape, dtype)
        # -> hidden variable; the names the last assigning run gave, that run and
        # kind of step (it skips assigning again), and how many assigns so far.
        self.slots: dict[tuple, keras.Variable] = {}
        self.provided: frozenset = frozenset()
        self.slot_holder: tuple | None = None
        self.assigned = 0
        self.replica_lock = threading.Lock()  # tf.distribute: replica threads see no
        self.replica_entry = None  # contextvars, so the tracing call's entry is here
        self.dynamic_lock = threading.Lock()  # TF/torch: one assign-and-call at a time
        self.make_lock = threading.RLock()  # make_*_function reads the step once
        # Calls of one model take turns where they share state: on JAX every call
        # (Keras's loop keeps the weights out of the variables while it runs), on
        # TF and torch the calls with metrics (Keras keeps them on the model). The
        # turn passes to other threads around every callback.
        self.shared = SharedState(model, sync=_JAX, metrics=True)
        self.gate = Gate(self.shared)
        # thread -> `(method, what it keeps while it reads its batches, the Python
        # sources of those)` of each call of the model in progress there
        # (`check_not_feeding`)
        self.reading: dict[int, list[tuple]] = {}

    def gates(self, method: str) -> tuple:
        if _JAX or method in _WITH_METRICS:
            return (self.gate,)
        return ()

    @property
    def names(self) -> set[str]:
        return set(self.static) | set(self.dynamic)


FEEDS_A_CALL = (
    "`{model}.{method}` was called while making a batch of {source}, which a "
    "`{running}` of `{model}` in another thread reads: {why}, so this call would wait "
    "for ever for that one, and it for this batch. Compute such values before the "
    "call, or with a copy of the model (`keras.models.clone_model` and "
    "`set_weights`). Received: `{model}.{method}` called in thread `{thread}`")


def check_not_feeding(model, method: str, takes: frozenset) -> None:
    """Refuses a call of `model` made while making a batch for a call of it in
    another thread (a `PyDataset` worker, tf.data's generator thread), where it
    would wait for that call for ever, for what `takes` names: the turn (a JAX
    call, or a call with metrics, keeps it while it reads its batches) or, on TF,
    the dynamic values (fit's and evaluate's steps hold them while they pull their
    batch). Every such call is refused, not only one that finds them taken: a
    pipeline reads ahead, and would hang or pass as it happened to run. A pipeline
    that feeds another call (another model's fit) waits its turn as before."""
    me = threading.get_ident()
    sources = [(method_, source) for thread, calls in list(model._cs.reading.items())
               if thread != me for method_, keeps, feeds in calls if keeps & takes
               for source in feeds]
    running, source = _making_a_batch_of(sources)
    if source is None:
        return
    kept = {what for thread, calls in list(model._cs.reading.items()) if thread != me
            for method_, keeps, _ in calls if method_ == running for what in keeps} & takes
    why = ("on JAX, calls of one model take turns (Keras's loop keeps the weights out of "
           "the variables while it runs), and that call keeps its turn" if _JAX
           else "calls that update the model's metrics, and direct calls, take turns, "
           "and that call keeps its turn" if "turn" in kept else
           "on TensorFlow, that call's steps read their batch while they hold the "
           "model's dynamic values (and the values of patches, and the replicas' entry "
           "under a MirroredStrategy), which this call sets too")
    shown = (f"the generator `{source.__name__}`" if inspect.isgenerator(source)
             else f"the `{type(source).__name__}`")
    raise RuntimeError(FEEDS_A_CALL.format(
        model=model.name, method=method, source=shown, running=running, why=why,
        thread=threading.current_thread().name))


def _making_a_batch_of(sources) -> tuple:
    """`(method, source)` of the first of `sources` (`(method, a generator or a
    PyDataset)`) whose Python code this thread runs now: the generator's own frame,
    or the PyDataset's `__getitem__`; `(None, None)` if none."""
    if not sources:
        return None, None
    frames = {id(source.gi_frame): (method, source) for method, source in sources
              if inspect.isgenerator(source) and source.gi_frame is not None}
    datasets = {id(source): (method, source) for method, source in sources
                if not inspect.isgenerator(source)}
    frame = inspect.currentframe().f_back
    while frame is not None:
        found = frames.get(id(frame))
        if found is None and datasets and frame.f_code.co_name == "__getitem__":
            found = datasets.get(id(frame.f_locals.get("self")))
        if found is not None:
            return found
        frame = frame.f_back
    return None, None


def _fed_by(method: str, args: tuple, kwargs: dict) -> tuple:
    """The Python sources of batches a call of `method` reads (its generators and
    `PyDataset`s, validation's included), whose code may call the model."""
    given = [args[0] if args else kwargs.get("x")]
    if method == "fit":
        given.append(kwargs.get("validation_data"))
    return tuple(source for source in given if inspect.isgenerator(source)
                 or isinstance(source, keras.utils.PyDataset))


def _ended_here(reading: dict, thread: int) -> None:
    calls = reading[thread]
    calls.pop()
    if not calls:
        del reading[thread]


class Engine(CaptureMixin):
    """The entry points of `ContextMixin` (see the module docstring).

    Attributes:
        context_cache_size: how many distinct non-default keys keep their compiled
            functions (LRU, default 8). Past that, the least recently used key that
            no running call uses is evicted with a warning, and retraces when it
            comes back.
    """

    context_cache_size: int = DEFAULT_CACHE_SIZE
    train_function = PerKeyFunction("train")
    test_function = PerKeyFunction("test")
    predict_function = PerKeyFunction("predict")

    def _cs_table(self) -> _keys.KeyTable:
        table = _keras_compat.get_instance_attribute(self, "_callscope_table")
        if table is None:
            table = _keys.KeyTable(self._cs_make_steps)
            _keras_compat.set_instance_attribute(self, "_callscope_table", table)
        return table

    def _cs_make_steps(self, key: tuple, values: Mapping, reads: set, hits: dict,
                       inputs: dict) -> dict:
        specs, patches = marked(key, CAPTURE), marked(key, PATCH)
        return {kind: step_closure(self, kind, dict(values), specs, patches, reads,
                                   hits.setdefault(kind, {}),
                                   inputs.setdefault(kind, set()))
                for kind in _KINDS}

    def _cs_entry_now(self) -> _keys.Entry:
        run = _scope.run_of(self)
        return run.entry if run is not None else self._cs_table().default

    def _cs_install_steps(self) -> None:
        for kind in _KINDS:
            name = f"{kind}_step"
            if not isinstance(_keras_compat.get_instance_attribute(self, name), StepDispatch):
                _keras_compat.set_instance_attribute(self, name, StepDispatch(self, kind))

    def _cs_check_stray(self) -> None:
        """A scope value that a sublayer declares but this model's key would not hold
        would be frozen into (or silently missing from) the compiled function."""
        state = self._cs
        if state.declared is None:
            if not self.built:
                return
            declared = set()
            for layer in _keras_compat.flatten_layers(self):
                declared |= _keras_compat.registered_call_context_args(layer)
            state.declared = frozenset(declared - {"training"})
        values = _scope.frame().values
        for name in state.declared:
            if name not in state.static and name not in state.dynamic \
                    and values.get(name) is not None:
                raise _scope.stray_in_step(name, values[name], self)

    def _cs_dynamic_array(self, name: str, value: Any) -> np.ndarray:
        """`value` of dynamic `name` as an array of the dtype and shape its variable
        holds (before its first value, the dtype that value would give it), or the
        error every entry point gives: a direct call checks it as `predict` does
        (it passed 2**40 on JAX as 0, and 1e39 as inf)."""
        array = self._cs_dynamic_numbers(name, value)
        variable = self._cs.dynamic.get(name)
        if variable is not None:
            _check_dynamic_shape(name, variable, array)
            return _held_as(name, array, np.dtype(variable.dtype))
        first = _held_as(name, array, _first_dtype(array))
        held = keras.ops.convert_to_tensor(np.zeros((), first.dtype)).dtype  # (JAX: int32)
        return _held_as(name, array, np.dtype(keras.backend.standardize_dtype(held)))

    def _cs_dynamic_numbers(self, name: str, value: Any) -> np.ndarray:
        if not _keys.is_tensor_like(value):  # (a str, a dict, a list holding None)
            _check_numbers(name, value, np.asarray(value))
        array = _as_numpy(value)
        _check_numbers(name, value, array)
        return array

    def _cs_dynamic_variable(self, name: str, value: Any) -> tuple[keras.Variable, np.ndarray]:
        """The hidden variable of dynamic `name` (made at its first value), and the
        value as an array of its dtype and shape."""
        state = self._cs
        array = self._cs_dynamic_numbers(name, value)
        with state.lock:
            variable = state.dynamic.get(name)
            if variable is None:
                first = _held_as(name, array, _first_dtype(array))
                with _backend.strategy_scope(self):
                    variable = keras.Variable(first, trainable=False,
                                              name=f"callscope_{name}")
                self._cs_add_hidden_state(variable, f"the first value of `{name}`", 0)
                state.dynamic[name] = variable
        _check_dynamic_shape(name, variable, array)
        return variable, _held_as(name, array, np.dtype(variable.dtype))

    def _cs_add_hidden_state(self, variable, what: str, own: int) -> None:
        """Adds callscope's `variable` to the model's state (`own`: the calls of
        this one that hold a key already). Under a JAX `keras.distribution`, Keras
        fixes each compiled step's output shardings, one per state variable, when
        it makes the step: every function made before then, this model's or that
        of a callscope model holding it, is made again, and a call running one
        (another thread's, or the `fit` whose callback this is) would fail on it,
        after its weights were taken out of the variables, so the variable is
        refused there. (Any callscope model's: which hold this one is not known.)"""
        distributed = _JAX and keras.distribution.distribution() is not None
        tables = _keys.every_table() if distributed else []
        running = sum(table.users() for table in tables) - own
        if running > 0:
            raise RuntimeError(
                f"callscope needs a variable for {what} of `{self.name}`, and under a "
                "JAX keras.distribution a variable added while a call of a callscope "
                "model runs (here, or in another thread: a `fit` whose callback this "
                "call is) breaks that call's compiled step, whose output shardings "
                "Keras fixed when it made it. Make one call with it before such a "
                "call starts (e.g. a `predict` on one batch before `fit`). Received: "
                f"running_calls={running}")
        _keras_compat.add_hidden_state(self, variable)
        for table in tables:
            table.clear()

    def _cs_scopes(self) -> tuple[tuple, tuple]:
        """The caller's open captures and patches of this model or of a callscope
        model inside it (its layers record wherever it is called from)."""
        ours = self._cs_owns()
        return _scope.captures_where(ours), _scope.patches_where(ours)

    def _cs_owns(self):
        """A test of whether a capture's or patch's model is this one, or inside it."""
        inside = None

        def ours(model) -> bool:
            nonlocal inside
            if model is self:
                return True
            if inside is None:
                inside = _keras_compat.layers_held(self)
            return id(model) in inside

        return ours

    def _cs_run(self, method: str, args: tuple, kwargs: dict) -> Any:
        state = self._cs
        # First: a call refused below reached its scopes (its error says the rest).
        captures, patches = self._cs_scopes()
        _scope.read_all(state.names, kwargs)
        # Everything below reads (and writes) Keras's arguments by name, wherever
        # the caller put them.
        _check_cache_size(self.context_cache_size)
        args, kwargs = _bind_positional(type(self), method, args, kwargs)
        known = _keras_method(type(self), method)
        given = self._cs_split(method, kwargs, known.accepted, known.keras_own)
        self._cs_check_stray()
        values = self._cs_resolve(given)
        variables = {}
        for name in state.dynamic:
            if name in values:
                variables[name], values[name] = self._cs_dynamic_variable(name, values[name])
        dynamic = [(variables[name], values[name]) for name in variables]
        # The frame holds each dynamic value itself: callbacks and nested calls
        # read this call's value, never what another call assigned last. The steps
        # read the hidden variable, which holds this call's value while it runs.
        frame = _scope.overlay({**dict.fromkeys(state.names), **values}, keyed=True)
        values.update(variables)
        key = _keys.static_key(values, set(state.static))
        outer, runs = _scope.run_of(self), _scope.runs_here()
        specs = _steps.call_specs(captures, method, runs,
                                  _keras_compat.is_fit_validation(method, kwargs))
        if captures:
            _steps.check_capture_supported(self, method, specs)
        if captures or patches:
            _steps.check_not_rematerialized(self)
            self._cs_prepare_capture(captures, first_x(args, kwargs))
            if specs:
                key = (*key, (CAPTURE, specs))
            if patches:
                _record.install_wrappers(self)
                self._cs_check_loops(captures, patches)
                key = (*key, (PATCH, tuple((o, p, _patch.keyed(fn)) for o, p, fn in patches)))
        table = self._cs_table()
        entry = table.acquire(key, values, self.context_cache_size)
        try:
            _scope.check_unkeyed(entry.reads, state.names, self)
            self._cs_install_steps()
            nested = outer is not None
            offset = self._cs_row_offset(method, patches)
            if dynamic and _JAX:
                positions = {id(v): i for i, v in enumerate(self.non_trainable_variables)}
                dynamic = [(positions[id(v)], a) for v, a in dynamic]
            calls, landing = begin_calls(captures, method, runs)
            try:  # the run ends whatever happens: a capture's exit waits for its calls
                run = Run(self, method, entry, tuple(dynamic), calls, patches, nested,
                          _keras_compat.replica_threads(self), offset,
                          tuple(c.spec for c in captures if c.spec.finds_ranges()), landing,
                          (frame, *_scope.scopes_now()[1:]))
                logging = next((i for i, c in enumerate(captures) if c.log), None)
                first = ()  # callscope's own callbacks, before the user's
                if method == "fit" and logging is not None:
                    user = kwargs.get("callbacks")
                    if isinstance(user, keras.callbacks.CallbackList):
                        # The user's list keeps its own progress bar (or none).
                        first = (EpochStatistics(calls[logging], user.callbacks,
                                                 progress=False),)
                    else:
                        user = list(user or [])
                        first = (EpochStatistics(calls[logging], user),)
                gates = state.gates(method)
                if first and "callbacks" not in known.accepted:
                    raise TypeError(
                        "cs.capture(log=...) logs through a callback of `fit`, and the "
                        "model's class overrides `fit()` without `callbacks`. Let the "
                        "override take `**kwargs` and pass them on to `super().fit()`. "
                        f"Received: fit{known.signature}")
                if (gates or first) and method in ("fit", "evaluate", "predict") and (
                        "callbacks" in known.accepted):
                    # (An override that takes no callbacks runs none of the user's:
                    # the gate then stays held for the whole call.)
                    kwargs["callbacks"] = with_gate_callbacks(kwargs.get("callbacks"), gates,
                                                              self, first)
                result = self._cs_call_keras(method, run, frame, args, kwargs)
            except BaseException as error:
                if landing is not None:
                    landing.end(error)
                raise
            run.end()
            if run.patches:
                run.check_casts()
                kind = CALL_KINDS[method]
                self._cs_check_reached(run.patches, run.method,
                                       run.reached(kind, entry.hits.get(kind, {})))
            if run.offset is not None:
                run.offset.check_end()
            return result
        finally:
            table.release(entry)

    def _cs_row_offset(self, method: str, patches: tuple):
        """Where a run's row offset goes, for patches that take the batch (else None)."""
        batch = [fn for _, _, fn in patches if getattr(fn, "takes_batch", False)]
        if not batch:
            return None
        if method == "fit":
            raise ValueError(
                "A patch that takes the batch (`fn(value, batch)` or an array) gives "
                "each batch rows of the call's data in order, and `fit` shuffles and "
                "repeats its data (and validates on other data). Use it with `predict`, "
                "`evaluate` or the *_on_batch methods (each call's data starts at row 0), "
                "or patch with `fn(value)` in fit. Received: a batch patch in fit"
            )
        steps = getattr(self, "steps_per_execution", 1) or 1
        replicas = _keras_compat.replicas(self)
        if steps > 1 or replicas > 1:
            fix = " and ".join(
                ([f"compile with steps_per_execution=1 (not {steps})"] if steps > 1 else [])
                + ([f"run outside the {replicas}-replica strategy"] if replicas > 1 else []))
            raise ValueError(
                "A patch that takes the batch (`fn(value, batch)` or an array) needs "
                "one batch per compiled step on one replica, to know each batch's rows: "
                f"{fix}. Received: steps_per_execution={steps}, replicas={replicas}"
            )
        state = self._cs
        with state.lock:
            if state.rows_offset is None:
                with _backend.strategy_scope(self):
                    rows = keras.Variable(np.int32(0), dtype="int32", trainable=False,
                                          name="callscope_rows")
                self._cs_add_hidden_state(rows, "the first patch that takes the batch", 1)
                state.rows_offset = rows
        target = state.rows_offset
        if _JAX:
            target = next(i for i, v in enumerate(self.non_trainable_variables)
                          if v is state.rows_offset)
        return RowOffset(target, tuple(fn.rows for fn in batch
                                       if getattr(fn, "rows", None) is not None))

    def _cs_call_keras(self, method, run, frame, args, kwargs):
        state = self._cs
        holds_lock = run.dynamic or run.has_inputs or run.offset is not None or run.replicated
        takes = frozenset(("turn",) * bool(state.gates(method))
                          + ("values",) * (_TF and bool(holds_lock)))
        check_not_feeding(self, method, takes)
        me = threading.get_ident()
        with contextlib.ExitStack() as stack:
            # A call that reads batches from a pipeline keeps its turn all along;
            # on TF, fit's and evaluate's steps read theirs holding the values.
            keeps = takes - {"values"} if method == "predict" else takes
            state.reading.setdefault(me, []).append(
                (method, keeps, _fed_by(method, args, kwargs)))
            stack.callback(_ended_here, state.reading, me)
            for gate in state.gates(method):
                stack.enter_context(gate.held())
            snapshot = _keras_compat.snapshot_variable_values(self, method)  # under the gate
            try:
                with _scope.pushed(frame), _scope.running(run), \
                        _scope.ending_scopes_opened_in(run):
                    return getattr(super(), method)(*args, **kwargs)
            except BaseException as error:
                for gate in state.gates(method):
                    gate.close()  # a callback raised with the gate open: take it back
                problem = _keras_compat.settle_failed_call(self, method, snapshot)
                if problem is not None:
                    error.add_note(problem)
                raise
            finally:
                if not run.nested:
                    state.shared.forget(threading.get_ident())

    @contextlib.contextmanager
    def _cs_syncing(self):
        # JAX (`_keras_compat.SyncHook`): a callback that touches the weights while
        # the gate is open for it takes the gate back first, so that no other call
        # purges them under it.
        gate = self._cs.gate
        if not gate.is_open_for():
            with gate.held():
                yield
            return
        gate.close()  # only for the sync: callbacks never hold the gate
        try:
            with gate.held():
                yield
        finally:
            gate.open()

    def fit(self, *args, **kwargs):
        return self._cs_run("fit", args, kwargs)

    def evaluate(self, *args, **kwargs):
        return self._cs_run("evaluate", args, kwargs)

    def predict(self, *args, **kwargs):
        return self._cs_run("predict", args, kwargs)

    def train_on_batch(self, *args, **kwargs):
        return self._cs_run("train_on_batch", args, kwargs)

    def test_on_batch(self, *args, **kwargs):
        return self._cs_run("test_on_batch", args, kwargs)

    def predict_on_batch(self, *args, **kwargs):
        return self._cs_run("predict_on_batch", args, kwargs)

    def _cs_wrap_function(self, kind: str):
        entry = self._cs_entry_now()
        function = entry.functions[kind]
        if function is None or isinstance(function, RunFunction):
            return function
        # torch: gradients with respect to intermediates need the step's forward
        # pass outside one compiled graph (`_keras_compat.own_compile_cache`).
        grads = any("grad" in spec.kinds for spec in marked(entry.key, CAPTURE))
        function = _keras_compat.own_compile_cache(function, eager=grads)
        wrapped = entry.functions[kind] = RunFunction(self, kind, function)
        return wrapped

    def _cs_make(self, kind: str, make, force: bool):
        # JAX's trainer reads `self.<kind>_step` once, at make time, and keys its
        # trace cache on that callable: it must see the key's own closure then.
        # TF and torch read it at trace or call time, through the dispatcher.
        name = f"{kind}_step"
        with self._cs.make_lock:
            dispatcher = _keras_compat.get_instance_attribute(self, name)
            if _JAX and isinstance(dispatcher, StepDispatch):
                _keras_compat.set_instance_attribute(
                    self, name, self._cs_entry_now().steps[kind])
            try:
                make(force=force)
            finally:
                if _JAX and isinstance(dispatcher, StepDispatch):
                    _keras_compat.set_instance_attribute(self, name, dispatcher)
        return self._cs_wrap_function(kind)

    def make_train_function(self, force=False):
        return self._cs_make("train", super().make_train_function, force)

    def make_test_function(self, force=False):
        return self._cs_make("test", super().make_test_function, force)

    def make_predict_function(self, force=False):
        return self._cs_make("predict", super().make_predict_function, force)

    def compile(self, *args, **kwargs):
        # A new compile invalidates every key's functions (Keras resets its own).
        self._cs_table().clear()
        return super().compile(*args, **kwargs)

    def quantize(self, *args, **kwargs):
        # Keras drops its compiled functions where quantizing changed a layer
        # (keras 3.15.1: models/model.py:575); every key's are as stale, and
        # would run the float layers on (TensorFlow keeps their variables alive).
        try:
            return super().quantize(*args, **kwargs)
        finally:
            self._cs_table().clear()

    def compile_from_config(self, config):
        # Keras skips compiling on load when `compile` is overridden
        # (trainer.py:1003); ours only clears the cache, so compile as stock does,
        # unless the user's own `compile` takes other arguments: then warn and
        # load uncompiled, as stock Keras does for any overridden `compile`.
        return _keras_compat.compile_from_config(self, config, Engine.compile)


class _KerasMethod(NamedTuple):
    """What the wrapper of entry point `method` needs from the methods below it."""

    signature: inspect.Signature  # binds positional arguments as they would be
    accepted: frozenset  # the keywords `method` accepts
    keras_own: frozenset  # those Keras's own `method` takes


_METHOD_CACHE: dict = {}


def _keras_method(cls, method) -> _KerasMethod:
    """`method` down `cls`'s MRO, below callscope's wrapper, in one walk (per class).

    - signature: the first override that names its parameters: one `fit(self,
      *args, **kwargs)` passing them on binds as Keras's own does;
    - accepted: the named parameters of each override that passes `**kwargs` on
      (keras_hub's Tasks' `evaluate`), and of the first one that does not, Keras's
      own in the end (with the private ones fit's validation passes);
    - keras_own: those Keras's own takes (an override that leaves one out refuses
      what Keras passes from within)."""
    key = (cls, method)
    found = _METHOD_CACHE.get(key)
    if found is not None:
        return found
    signature, accepted, accepting = None, set(), True
    for base in cls.__mro__:
        if issubclass(base, Engine) or base.__module__.startswith("callscope.") or (
                method not in vars(base)):
            continue
        function = getattr(base, method)
        here = inspect.signature(function)
        parameters = here.parameters
        kinds = {p.kind for p in parameters.values()}
        if signature is None and inspect.Parameter.VAR_POSITIONAL not in kinds:
            signature = here
        keras_own = function.__module__.startswith("keras.")
        if accepting:
            accepted |= {p.name for p in parameters.values()
                         if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
            if keras_own and method == "evaluate":
                accepted |= _keras_compat.PRIVATE_EVALUATE_ARGUMENTS  # fit's validation
            accepting = inspect.Parameter.VAR_KEYWORD in kinds
        if keras_own:  # the walk ends
            found = _KerasMethod(signature or here, frozenset(accepted), frozenset(parameters))
            break
    _METHOD_CACHE[key] = found
    return found


def _bind_positional(cls, method, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args` given by name, as Keras's own `method` binds them (`fit(x, y, 32)`:
    x, y, batch_size), so callscope finds `callbacks` and the rest wherever the
    caller put them. Arguments past Keras's named parameters stay positional (Keras
    raises its own error for them)."""
    if not args:
        return args, kwargs
    names = []
    for parameter in list(_keras_method(cls, method).signature.parameters.values())[1:]:
        if parameter.kind is not parameter.POSITIONAL_OR_KEYWORD:  # ([0] is self)
            break
        names.append(parameter.name)
    bound = dict(zip(names, args))
    for name in bound:
        if name in kwargs:
            raise TypeError(f"{method}() got multiple values for argument '{name}'")
    return args[len(bound):], {**bound, **kwargs}


def _as_numpy(value) -> np.ndarray:
    """`keras.ops.convert_to_numpy(value)`, a TF bfloat16 tensor included (keras
    3.15.1's TF `convert_to_numpy` is `np.array(x)`, which numpy refuses for it;
    the tensor's own `.numpy()` gives an ml_dtypes array)."""
    try:
        return np.asarray(keras.ops.convert_to_numpy(value))
    except ValueError:
        if not hasattr(value, "numpy"):
            raise
        return np.asarray(value.numpy())


def _check_numbers(name: str, value, array: np.ndarray) -> None:
    """Raises unless dynamic `name`'s value is numbers (bfloat16's numpy kind is
    'V', ml_dtypes')."""
    if array.dtype.kind in "USOMm":
        raise TypeError(
            f"Dynamic context argument `{name}` takes a number, a bool or an array of "
            "them: it reaches layers as a tensor. For strings and other Python values, "
            "register a static name instead, one compiled function per value. "
            f"Received: {name}={_keys.shown(value)} (numpy dtype {array.dtype})")


def _check_cache_size(size) -> None:
    """A bound the key table can keep (None failed later on a bare `int()`, and 0
    or -1 kept one key without a word)."""
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
        raise ValueError(
            "`context_cache_size` is how many distinct non-default keys keep their "
            "compiled functions: a whole number, 1 or more (default "
            f"{DEFAULT_CACHE_SIZE}). Received: context_cache_size={size!r}")


def _first_dtype(array: np.ndarray) -> np.dtype:
    """The dtype a dynamic name's variable takes from its first value."""
    return np.dtype(keras.config.floatx() if array.dtype.kind == "f" else array.dtype)


def _check_dynamic_shape(name: str, variable, array: np.ndarray) -> None:
    if tuple(variable.shape) != array.shape:
        raise ValueError(
            f"Dynamic context argument `{name}` keeps the shape of its first value, "
            f"{tuple(variable.shape)}, so that it never retraces. Pass values of "
            f"that shape. Received: {name} with shape {array.shape}"
        )


def _held_as(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`array` as the dtype of dynamic `name`'s variable, or a clear error where
    that would change its value beyond rounding: a float held as an int (0.5 -> 0),
    a number held as a bool, an int out of range, a finite value that overflows."""
    with np.errstate(over="ignore", invalid="ignore"):  # told below, in words
        held = array.astype(dtype)
    if not _inputs.may_hold(dtype, array.dtype):
        error, problem = TypeError, f"a {array.dtype} value cannot be held as {dtype}"
        fix = ("Pass values of that kind; to hold floats, make the first value a float "
               "(1.0, not 1)")
    elif not _inputs.holds(array, dtype) and _inputs.kind(dtype) == "int":
        error, problem = ValueError, f"the value does not fit in {dtype}"
        fix = f"Pass values within {dtype}'s range, or make the first value a float"
    elif not _inputs.holds(array, dtype):
        error, problem = ValueError, f"the value overflows {dtype}"
        fix = f"Pass values within {dtype}'s range"
    else:
        return held
    shown = array.item() if array.size == 1 else f"an array of dtype {array.dtype}"
    raise error(
        f"Dynamic context argument `{name}` keeps the dtype of its first value, {dtype}, "
        f"so that it never retraces, and {problem}. {fix}. Received: {name}={shown!r}"
    )

