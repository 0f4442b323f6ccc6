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

On JAX the default `train_step` differentiates `compute_loss_and_updates`, whose
aux output is a fixed 4-tuple; values sown inside it are tracers of the
differentiated trace. `smuggle` carries them out as one extra entry at the end of
the non-trainable-variables list, and `unsmuggle` takes it off again before the
state reaches Keras.
"""

from __future__ import annotations

import keras

from callscope._capture import OUTPUTS, SOWN

_JAX = keras.backend.backend() == "jax"
_SMUGGLED = "__callscope_smuggled__"


def smuggle(aux, values):
    unscaled_loss, y_pred, non_trainable, metrics = aux
    return unscaled_loss, y_pred, [*non_trainable, {_SMUGGLED: values}], metrics


def unsmuggle(result, collector):
    """Takes smuggled records off a JAX step's state and gives them to `collector`."""
    if not _JAX or not isinstance(result, tuple) or len(result) != 2:
        return result
    main, state = result
    if not isinstance(state, tuple) or len(state) < 2 or not isinstance(state[1], list):
        return result
    non_trainable = state[1]
    if non_trainable and isinstance(non_trainable[-1], dict) and _SMUGGLED in non_trainable[-1]:
        collector.merge(non_trainable[-1][_SMUGGLED])
        state = (state[0], non_trainable[:-1], *state[2:])
    return main, state


def attach(kind, result, sown):
    main, rest = (result[0], result[1:]) if _JAX else (result, ())
    if kind == "predict":
        main = {OUTPUTS: main, SOWN: sown}
    else:
        main = {**main, SOWN: sown}
    return (main, *rest) if _JAX else main


def popper(model, kind, function):
    """Wraps a made `*_function`: pops captured values and sinks them on the host."""

    def run(*args, **kwargs):
        result = function(*args, **kwargs)
        main, rest = (result[0], result[1:]) if _JAX else (result, ())
        if isinstance(main, dict) and SOWN in main:
            sown = main[SOWN]
            if kind == "predict":
                main = main[OUTPUTS]
            else:
                main = {k: v for k, v in main.items() if k != SOWN}
            model._cs_sink(kind, sown)
        return (main, *rest) if _JAX else main

    run._callscope_popper = True
    run.__wrapped__ = function
    return run


def check_capture_supported(model, method):
    """Raises where a capture would silently lose or average rows."""
    if method not in ("fit", "evaluate", "train_on_batch", "test_on_batch"):
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
    replicas = getattr(strategy, "num_replicas_in_sync", 1)
    if replicas > 1:
        raise ValueError(
            f"cs.capture cannot run inside `{method}` under a tf.distribute strategy with "
            f"{replicas} replicas: Keras averages the replicas' step outputs in train and "
            "test, which would silently mix their rows. Capture with `predict` (it "
            "concatenates replicas), or outside the strategy. "
            f"Received: num_replicas_in_sync={replicas}"
        )
