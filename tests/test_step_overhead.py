"""Nothing per step in Python that can be done once.

Torch runs a step's Python every step, and `*_on_batch` loops and custom loops
pay every call's Python each time, so what a key or a class fixes is resolved
once: a capture's selection (globs or a callable) and its histogram ranges per
key, the signatures of Sequential and Functional `call` per class, the weight
snapshot only where a JAX loop can purge the variables. Torch's statistics run as
few ops as they can. `fit`'s validation takes no gradients. These tests count
the work (calls, ops), never time it.
"""

import inspect
import sys

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy

import callscope as cs
from callscope import _grads, _keras_compat, _points, _reduce

X = np.random.default_rng(0).normal(size=(24, 4)).astype("float32")
Y = np.random.default_rng(1).normal(size=(24, 2)).astype("float32")


def _mlp():
    return cs.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="d0"),
                          keras.layers.Dense(8, activation="relu", name="d1"),
                          keras.layers.Dense(2, name="head")], name="m")


class _Counting:
    """Wraps `owner.name` and counts the calls made from callscope's modules."""

    def __init__(self, monkeypatch, owner, name):
        self.count, original = 0, getattr(owner, name)

        def counted(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("callscope"):
                self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize("jit", [False, "auto"])
def test_selection_globs_run_once_per_key_not_per_step(monkeypatch, jit):
    counter = _Counting(monkeypatch, _points.Spec, "selects")  # the globs' matching
    counts = {}
    for steps in (2, 6):
        model = _mlp()
        model.compile(optimizer="sgd", loss="mse", jit_compile=jit)
        counter.count = 0
        with cs.capture(model, "m/d?", reduce=("mean", "std", "hist")) as cap:
            model.fit(X[:4 * steps], Y[:4 * steps], batch_size=4, epochs=2, verbose=0)
        counts[steps] = counter.count
        assert cap["m/d1:output/mean"].shape == (2 * steps,)
    assert counts[2] == counts[6] > 0  # resolved for the key: as many points, not steps


def test_a_select_callable_runs_once_per_point_per_key():
    calls = []
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)

    def select(point, layer):
        calls.append(point)
        return point == "m/d1"

    with cs.capture(model, select, reduce="mean") as cap:
        model.fit(X, Y, batch_size=4, epochs=2, verbose=0)
    assert cap["m/d1:output/mean"].shape == (12,)
    assert len(calls) == len(set(calls))  # each point asked once, whatever the steps


def test_sequential_and_functional_calls_inspect_no_signature(monkeypatch):
    seq = _mlp()
    inputs = keras.Input((4,))
    functional = cs.Model(inputs, keras.layers.Dense(2)(inputs))
    seq.register_context_args("flag")
    functional.register_context_args("flag")
    for model in (seq, functional):
        model(X[:2], flag=True)  # the first call may look the class up
    counter = _Counting(monkeypatch, inspect, "signature")
    for _ in range(5):
        for model in (seq, functional):
            out = model(X[:2], flag=True)
    assert counter.count == 0
    np.testing.assert_allclose(numpy(out), numpy(keras.Model.__call__(functional, X[:2])),
                               rtol=1e-6)


def test_a_capture_with_inputs_inspects_each_layer_once(monkeypatch):
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    with cs.capture(model, "m/d?", kinds=("input",)):
        model.fit(X[:8], Y[:8], batch_size=4, verbose=0)
    counter = _Counting(monkeypatch, inspect, "signature")
    with cs.capture(model, "m/d?", kinds=("input",)) as cap:
        model.fit(X, Y, batch_size=4, verbose=0, shuffle=False)
    assert counter.count == 0
    np.testing.assert_allclose(cap["m/d0:input"], X, rtol=1e-6)


@pytest.mark.parametrize("method", ["train_on_batch", "test_on_batch", "predict_on_batch",
                                    "fit", "evaluate", "predict"])
def test_the_weight_snapshot_is_taken_only_where_jax_purges(monkeypatch, method):
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse")
    taken = []
    original = _keras_compat.snapshot_variable_values

    def snapshot(model, method):
        kept = original(model, method)
        taken.append(len(kept[0]) if kept else 0)  # (variable, value) pairs
        return kept

    monkeypatch.setattr(_keras_compat, "snapshot_variable_values", snapshot)
    args = (X,) if method.startswith("predict") else (X, Y)
    getattr(model, method)(*args, **({} if "on_batch" in method else {"verbose": 0}))
    purges = BACKEND == "jax" and method in ("fit", "evaluate", "predict")
    assert len(taken) == 1 and (taken[0] > 0) == purges


@pytest.mark.skipif(BACKEND != "jax", reason="only JAX's fit, evaluate and predict purge")
@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_the_weight_snapshot_holds_every_variable_the_loop_purges(monkeypatch, method):
    # The snapshot takes only the parts of the state a call purges (predict: no
    # optimizer or metrics variables): every variable found purged inside the
    # loop must be in it, or a failed call could not put its value back.
    model = _mlp()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(X, Y, verbose=0)  # the optimizer's and metrics' variables exist
    kept, original = [], _keras_compat.snapshot_variable_values
    monkeypatch.setattr(_keras_compat, "snapshot_variable_values",
                        lambda m, name: kept.append(original(m, name)) or kept[-1])
    everything = [*model.variables, *model.optimizer.variables, *model.metrics_variables]
    purged = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):  # no self.model: it syncs
            purged.extend(v for v in everything if v._value is None)

        on_test_batch_end = on_predict_batch_end = on_train_batch_end

    args = (X,) if method == "predict" else (X, Y)
    getattr(model, method)(*args, callbacks=[Look()], verbose=0)
    snapshot = {id(v) for v, _ in kept[0][0]}
    assert purged and all(id(v) in snapshot for v in purged)
    assert len(snapshot) < len(everything) if method != "fit" else len(snapshot) == len(
        everything)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's own partials (eager ops)")
@pytest.mark.parametrize("stats,finite,most", [
    (("mean", "std", "frac_zero"), True, 9), (("mean", "std", "frac_zero"), False, 33),
    (_reduce.STATS, True, 20), (_reduce.STATS, False, 53)])
def test_torch_statistics_run_few_ops(stats, finite, most):
    # All-finite data on the CPU takes the short path (`_torch_finite_partials`:
    # scalars read back and worked out in Python, into host arrays); data
    # with NaN or inf pays the masks (and the sum that found them), the six
    # ops that correct M2 and the mean for the mean's rounding (`_centred`; one
    # leaves out a correction that is not finite, of an overflowed mean), and six
    # that scale the deviations by the largest (the spread of a vanishing
    # gradient, whose squares flush to 0, read 0 without them). Squares are
    # summed as a square and a sum, two ops where a dot product is one, whose
    # float32 accumulators lost 5e-5 of the rms of constant values. Zeros are
    # counted by sign . sign rather than `count_nonzero` (1 op,
    # but 870 µs against 45 µs on a 256 x 512 CPU tensor): fewer ops is not
    # always faster.
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    x = torch.tensor(np.random.default_rng(2).normal(size=(64, 32)).astype("float32"))
    x[2, 2] = 0.0
    if not finite:
        x[0, 0], x[1, 1] = float("nan"), float("inf")
    with Count():
        parts = _reduce.partials(x, stats, 8, (-1.0, 1.0))
    assert Count.ops <= most
    merged = _reduce.merge({k: np.asarray(v) for k, v in parts.items()})
    data = x.numpy().astype(np.float64)
    kept = data[np.isfinite(data)]
    np.testing.assert_allclose(_reduce.finalize(merged, "std"), kept.std(), rtol=1e-5)
    np.testing.assert_allclose(_reduce.finalize(merged, "frac_zero"), (kept == 0).mean())
    if "hist" in stats:
        np.testing.assert_array_equal(
            _reduce.finalize(merged, "hist"),
            np.histogram(np.clip(kept, -1, 1), bins=8, range=(-1, 1))[0])
        for stat, fn in (("min", np.min), ("max", np.max), ("absmax", lambda v: np.abs(v).max())):
            assert _reduce.finalize(merged, stat) == pytest.approx(fn(kept), rel=1e-6)
        assert _reduce.finalize(merged, "nan_count") == np.isnan(data).sum()
        assert _reduce.finalize(merged, "inf_count") == np.isinf(data).sum()


@pytest.mark.parametrize("jit", [False, "auto"])
def test_fit_validation_takes_no_gradients(monkeypatch, jit):
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit)
    kinds = []
    original = _grads.impl.step_with_grads

    def step_with_grads(model, kind, *args):
        kinds.append(kind)
        return original(model, kind, *args)

    monkeypatch.setattr(_grads.impl, "step_with_grads", step_with_grads)
    with cs.capture(model, "m/d1", kinds=("output", "grad")) as cap:
        model.fit(X, Y, batch_size=8, epochs=2, validation_data=(X[:8], Y[:8]), verbose=0)
    assert set(kinds) == {"train"}
    validation = [c for c in cap.calls if c.nested]
    assert len(validation) == 2 and set(validation[0]) == {"m/d1:output"}
    assert cap["m/d1:grad"].shape == (48, 8)
    with cs.capture(model, "m/d1", kinds=("grad",)) as asked:  # evaluate itself: grads
        model.evaluate(X, Y, batch_size=8, verbose=0)
    assert asked["m/d1:grad"].shape == (24, 8) and "test" in kinds


def test_points_are_named_the_same_after_the_first_step():
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    with cs.capture(model, "*") as cap:
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    assert sorted(cap) == ["m/d0:output", "m/d1:output", "m/head:output", "m:output"]
    assert all(cap[k].shape[0] == 48 for k in cap)
    assert "m/d1" in _points.tree_points(model)


@pytest.mark.skipif(BACKEND == "torch", reason="torch's partials have no cond (eager ops)")
def test_the_finite_checks_cond_takes_the_tensor_in_its_own_shape():
    # Given the flattened tensor, XLA on a CPU computed a layer's output twice in a
    # compiled step (once in its own shape for the next layer, once flat for the
    # cond): one more pass and buffer per point, 5-10% of a train step. The masked
    # branch flattens it itself.
    h = np.random.default_rng(4).normal(size=(8, 16)).astype("float32")
    stats = ("mean", "std", "frac_zero")
    if BACKEND == "jax":
        import jax

        jaxpr = jax.make_jaxpr(lambda t: _reduce.partials(t, stats))(h)
        conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
        shapes = [tuple(v.aval.shape) for e in conds for v in e.invars]
    else:
        import tensorflow as tf

        graph = tf.function(lambda t: _reduce.partials(t, stats)).get_concrete_function(
            tf.TensorSpec(h.shape, tf.float32)).graph
        conds = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
        shapes = [tuple(i.shape) for op in conds for i in op.inputs]
    assert len(conds) == 1
    assert h.shape in shapes and (h.size,) not in shapes, shapes
    parts = _reduce.merge({k: numpy(v) for k, v in _reduce.partials(h, stats).items()})
    np.testing.assert_allclose(_reduce.finalize(parts, "std"), h.std(dtype=np.float64), rtol=1e-5)
