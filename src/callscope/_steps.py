"""How captured values leave a compiled step, per backend.

A step's result is, per backend and kind:

| backend       | train / test      | predict               |
|---------------|-------------------|-----------------------|
| tensorflow    | `logs`            | `outputs`             |
| torch         | `logs`            | `outputs`             |
| jax           | `(logs, state)`   | `(outputs, ntv)`      |

`attach` adds the captured values to it (`logs[SOWN]`, or `{OUTPUTS: outputs,
SOWN: ...}` for predict), and `popper` wraps the made `*_function` so that Keras's
loop gets back exactly what the step would have returned without capture.

Under a multi-replica `tf.distribute` strategy, Keras runs the step in each
replica and reduces train and test outputs with "mean" (`reduce_per_replica`,
keras 3.15.1 backend/tensorflow/trainer.py `_make_function`), which would average
the replicas' records. `finalize` therefore joins them inside the step, with
`ReplicaContext.merge_call` (`_backend.gather_replicas`): it returns one tensor per
record, the same object in every replica, which tf.distribute's `regroup` leaves
unwrapped and `reduce_per_replica` passes through. Full records are concatenated
in replica order (the global batch order), statistics partials get one row per
replica (the host merges each step's rows exactly: `_reduce.merge_each`). Where every
replica ran the whole batch (`*_on_batch`), one replica's records are kept and its
gradients are scaled to the step's. Predict needs none of this: Keras concatenates
its replicas. A value sown without a batch axis (`batch_axis=None`) is one for all
replicas in every method: the first replica's is kept (`_backend.agreed`; the host
raises if the others differ), statistics count it in the first replica only, and its
gradient is the sum of theirs.

On JAX the default `train_step` differentiates `compute_loss_and_updates`, whose
aux output is a fixed 4-tuple; values sown inside it are tracers of the
differentiated trace. `smuggle` carries them out as one extra entry at the end of
the non-trainable-variables list, and `unsmuggle` takes it off again before the
state reaches Keras.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from callscope import _backend, _grads, _keras_compat, _record, _reduce
from callscope._record import OUTPUTS, SOWN

BACKEND = keras.backend.backend()
_JAX = BACKEND == "jax"


def unsmuggle(result, collector):
    """Takes sown values smuggled out of JAX's `value_and_grad` off a step's state
    (see `_keras_compat.AuxHook`) and gives them to `collector`."""
    if not _JAX:
        return result
    result, smuggled = _keras_compat.unsmuggle(result)
    if smuggled:
        collector.merge(smuggled)
    return result


def attach(kind, result, sown):
    main, rest = (result[0], result[1:]) if _JAX else (result, ())
    if kind == "predict":
        main = {OUTPUTS: main, SOWN: sown}
    else:
        main = {**main, SOWN: sown}
    return (main, *rest) if _JAX else main


def pop_sown(kind, result, run):
    """Takes the captured values off a made function's result; hands them to `run`.

    Keras's loop gets back exactly what the step would have returned without
    capture. `run` is the call in effect in the caller's thread.
    """
    main, rest = (result[0], result[1:]) if _JAX else (result, ())
    if not isinstance(main, dict) or SOWN not in main:
        if run is not None:  # a step that recorded nothing: counted (`Call._skipped`)
            run.sink(kind, {})
        return result
    sown = main[SOWN]
    rows = sown.pop(_record.ROWS, None) if isinstance(sown, dict) else None
    trace = sown.pop(_record.TRACE, None) if isinstance(sown, dict) else None
    if trace is not None and run is not None:
        run.ran_trace(kind, trace)
    lost = sown.pop(_record.LOST, None) if isinstance(sown, dict) else None
    if lost is not None and run is not None:
        run.noted_casts(lost)
    if _backend.BACKEND == "tensorflow" and isinstance(sown, dict):
        _check_agreed(sown)
    if rows is not None and run is not None and run.offset is not None:
        run.offset.advance(int(np.sum(_reduce.to_numpy(rows))))
    if kind == "predict":
        main = main[OUTPUTS]
    else:
        main = {k: v for k, v in main.items() if k != SOWN}
    if run is not None:
        run.sink(kind, sown)
    return (main, *rest) if _JAX else main


def gathered_outputs(kind, result):
    """predict's outputs, whole on every process of a multi-process JAX job.

    Keras's predict loop concatenates each step's outputs on the host, which
    raises for arrays whose shards live on other processes (Keras 3.15.1); the
    gathered outputs are the global batch, in order, on every process.
    """
    if kind != "predict" or _backend.process_index()[1] == 1:
        return result
    outputs, rest = (result[0], result[1:]) if _JAX else (result, ())
    outputs = keras.tree.map_structure(_backend.gathered, outputs)
    return (outputs, *rest) if _JAX else outputs


def finalize(collector, kind, args, kwargs) -> dict:
    """The step's captured values (`collector.finalize()`), as the whole step's under
    a multi-replica `tf.distribute` strategy (see the module docstring), their
    statistics partials packed into one array (`_reduce.pack`)."""
    # Keras concatenates predict's replicas itself.
    predicting = kind == "predict" or not (collector.records or collector.rows is not None)
    split = None if predicting else _backend.replica_split((args, kwargs))
    if split is False and collector.records:
        # Every replica ran the whole batch with its loss scaled by 1/replicas, and
        # Keras sums their gradients: one replica's times `replicas` is the step's.
        replicas = _backend.replicas_in_step()
        for name, values in collector.records.items():
            if _record.split_record(name)[2] == "grad":
                collector.records[name] = [v * replicas for v in values]
    unbatched = collector.unbatched_records() if _backend.replicas_in_step() > 1 else ()
    if (unbatched or split is not None) and _keras_compat.in_tf_xla_context():
        raise ValueError(
            "callscope joins a step's records across the replicas of tf.distribute with "
            "`merge_call`, which a step compiled by XLA cannot make (the records of "
            "`fit` and `evaluate`, and values sown with batch_axis=None in any method). "
            "Compile the model with jit_compile=False to capture them under a "
            "multi-replica strategy. Received: jit_compile=True, "
            f"{_backend.replicas_in_step()} replicas")
    agreed = {}
    for name in unbatched:
        # A value without a batch axis (`sow(..., batch_axis=None)`) is one for all
        # replicas: the one they agree on, its gradient their gradients' sum.
        values = collector.records[name]
        if _record.split_record(name)[2] != "grad":
            for i, value in enumerate(values):
                values[i], agreed[f"{AGREED}{i}|{name}"] = _backend.agreed(value)
        elif split:
            collector.records[name] = [_backend.sum_replicas(v) for v in values]
    sown = collector.finalize()
    if unbatched:  # ... counted once: in the first replica's statistics
        sown.update({key: _backend.first_replica_only(sown[key]) for key in collector.unbatched
                     if isinstance(sown[key], dict)})
        sown.update(agreed)
        if predicting:  # ... and kept once
            full = {key: sown[key] for key in [*collector.unbatched, *agreed] if key in sown
                    and not isinstance(sown[key], dict)}
            sown.update(_backend.gather_replicas(full, False) if full else {})
    if split is not None and sown:
        sown = _backend.gather_replicas(sown, split, {*collector.unbatched, *agreed})
    return _reduce.pack(sown)


AGREED = "__callscope_agreed__"  # did the replicas agree on a value without a batch axis?


def _check_agreed(sown: dict) -> None:
    """Raises for a value sown with batch_axis=None that the replicas of
    tf.distribute disagreed on (`finalize`); takes the answers off `sown`."""
    answers = {name: sown.pop(name) for name in [n for n in sown if n.startswith(AGREED)]}
    disagreed = sorted({_shown(_record.split_record(name.split("|", 1)[1]))
                        for name, same in answers.items()
                        if not np.all(_reduce.to_numpy(same))})
    arguments = [p for p in disagreed if ":input" in p]
    if arguments:  # a layer's 0-d argument computed from each replica's rows
        raise ValueError(
            f"{', '.join(f'`{p}`' for p in arguments)}: the replicas of tf.distribute "
            "passed different 0-d values for this layer argument (computed from "
            "their own rows, say), so no value is the batch's, as on one device. "
            "Leave it out of the selection (capture kinds without 'input', or a glob "
            "that does not match the layer), or capture the rows it is computed from. "
            f"Received: points={arguments}")
    if disagreed:
        raise ValueError(
            f"{', '.join(f'`{p}`' for p in disagreed)} has no batch axis (sown with "
            "batch_axis=None, or a layer's 0-d argument), but "
            "the replicas of tf.distribute computed different values for it. A value "
            "without a batch axis must be the same in every replica (a value of the "
            "weights); one computed from the batch's rows has a batch axis: sow it with "
            "that `batch_axis`, or capture the rows and reduce them after the call. "
            f"Received: points={disagreed}")


def _shown(record: tuple) -> str:
    _, point, kind = record
    return point if kind in ("output", "grad") else f"{point}:{kind}"


def check_not_rematerialized(model) -> None:
    """Raises for a model with layers that Keras rematerializes (see
    `_keras_compat.rematerialized_layers`), before anything runs."""
    found = _keras_compat.rematerialized_layers(model)
    if found:
        # Measured on keras 3.15.1: JAX lost the layers' gradients, left points
        # out of cs.points and raised leaked-tracer errors elsewhere, TF raised
        # inside `recompute_grad` or (eager) recorded each point twice, torch
        # recorded outputs twice in fit.
        names = [layer.name for layer, _ in found]
        modes = sorted({mode for _, mode in found})
        raise ValueError(
            "callscope cannot look inside layers that Keras rematerializes: their "
            "`call` runs again inside the backend's checkpoint, where a record would "
            "be lost, counted twice or leak out of it, so cs.capture, cs.patch, "
            "cs.intermediate_grads, cs.points and cs.summary refuse such a model. "
            "Make and first call (build) the model outside `keras.RematScope`, or "
            "load it with `keras.saving.load_model` outside the scope (the mode is "
            f"not saved), to look inside it. Received: model={model.name!r} with "
            f"{len(names)} rematerialized layers {names[:8]}"
            f"{' ...' if len(names) > 8 else ''} (mode={', '.join(modes)})"
        )


_WITH_LOSS = ("fit", "evaluate", "train_on_batch", "test_on_batch")


def call_specs(captures, method: str, runs: tuple, validation: bool = False) -> tuple:
    """What each capture records in this call: its spec, without gradients in fit's
    validation (`validation`: they would cost a backward pass per step) and in a
    call without a loss made inside a run that the capture records (`runs`: those
    in progress here; a callback's `predict` or `model(x)` during a captured
    `fit`, of the model or of one it holds): there, the other kinds."""
    specs = []
    for capture in captures:
        spec = capture.spec
        if "grad" in spec.kinds and (validation or (
                method not in _WITH_LOSS and capture._records(runs))):
            spec = dataclasses.replace(spec, kinds=tuple(k for k in spec.kinds if k != "grad"))
        specs.append(spec)
    return tuple(specs)


def check_capture_supported(model, method, specs=()):
    """Raises where a capture would silently lose or average rows, or has no loss."""
    grads = [spec for spec in specs if "grad" in spec.kinds]
    if grads:
        if method not in _WITH_LOSS:
            raise ValueError(
                "cs.capture(kinds=('grad',)) needs a loss: gradients come from `fit`, "
                "`evaluate`, `train_on_batch` and `test_on_batch` under the compiled "
                f"loss. `{method}` has none. Capture `output` there instead (a call "
                "made inside a captured `fit`, as a callback's `predict`, records the "
                "other kinds without gradients). "
                f"Received: kinds={grads[0].kinds!r} in {method}"
            )
        if not getattr(model, "compiled", False):
            raise ValueError(
                "cs.capture(kinds=('grad',)) needs a compiled model: call "
                "`model.compile(optimizer=..., loss=...)` first. Received: an "
                "uncompiled model"
            )
    if method not in _WITH_LOSS:
        return
    steps = getattr(model, "steps_per_execution", 1) or 1
    if method in ("fit", "evaluate") and steps > 1:
        raise ValueError(
            f"cs.capture cannot run inside `{method}` with steps_per_execution={steps}: "
            "Keras keeps only the last step's outputs of each execution in train and "
            "test, so the other steps' captures would be lost. Compile with "
            "steps_per_execution=1 while capturing (predict concatenates every step and "
            f"works with any value). Received: steps_per_execution={steps}"
        )
    strategy = getattr(model, "distribute_strategy", None)
    if _keras_compat.replicas(model) > 1 and not _backend.is_mirrored(strategy):
        # Keras reduces train and test outputs of other strategies otherwise (a
        # multi-worker strategy all-reduces even the joined records): not verified.
        raise ValueError(
            f"cs.capture inside `{method}` under tf.distribute works with "
            "MirroredStrategy (one machine, several devices), where the replicas' "
            "records are joined exactly. Capture with `predict`, or train under "
            "MirroredStrategy while capturing. "
            f"Received: strategy={type(strategy).__name__}"
        )


# --------------------------------------------------------------------------
# Gradients with respect to intermediates (per backend: `_grads`)
# --------------------------------------------------------------------------
def loss_hook(loss):
    """Called with every loss a step computes (`_keras_compat.LossHook`)."""
    collector = _record.active_collector()
    if collector is None or not collector.wants_grads or collector.manual or loss is None:
        return loss
    _grads.impl.at_loss(collector, loss)
    return loss


def step_with_grads(model, kind, step, args, kwargs, collector):
    """Runs one train/test step and files d loss / d source for every grad source."""
    return _grads.impl.step_with_grads(model, kind, step, args, kwargs, collector)
