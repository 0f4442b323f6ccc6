"""torch `jit_compile=True`: context, capture and patches inside `torch.compile`.

Keras's torch trainer wraps each step in `torch.compile`. Dynamo traces the step's
Python, callscope's layer wrappers included, and compiles each frame it traces for
the guards it read; a frame compiled once per layer instance (a graph break in a
wrapper shared by every layer) would reach dynamo's recompile limit (8) in a
model of 8 blocks and fall back to eager. These tests count dynamo's compiles:
every scenario compiles as many frames for 8 blocks as for 2, none again when it
is repeated, and never near the limit, whose hit is an error here; the values
equal an eager (`jit_compile=False`) run of the same weights.
"""

import logging

import keras
import numpy as np
import pytest
from conftest import BACKEND

import callscope as cs

pytestmark = [
    pytest.mark.skipif(
        BACKEND != "torch",
        reason="torch.compile only: JAX and TensorFlow compiled steps are covered by "
               "every capture test (they trace the step once per key)"),
    # Dynamo's own probe of a non-leaf tensor that a compiled frame takes in
    # (torch 2.13 `safe_has_grad`), which it hides from `showwarning` but which
    # the suite's "error" filter raises. Every other warning stays an error.
    pytest.mark.filterwarnings(
        "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
]

X = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
Y = X[:, :1] * 0.5


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16, activation="tanh")

    def call(self, x):
        return cs.sow(self, "h", self.dense(x))


@cs.context_args("mode")
class Net(cs.Model):
    def __init__(self, blocks=8, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [Block(name=f"block_{i}") for i in range(blocks)]
        self.head = keras.layers.Dense(1)

    def call(self, x, mode=None):
        for block in self.blocks:
            x = block(x)
        if mode == "double":
            x = x * 2.0
        elif mode == "half":
            x = x * 0.5
        return self.head(x)


def _zero(value):
    return value * 0.0


def _scaled(value, values):
    return value * values["scale"]


# A patch array: one row per row of the data, sliced per batch by the row offset.
ROWS = np.random.default_rng(1).normal(size=(len(X), 16)).astype("float32")


def _scenarios(model):
    """name -> a call of `model`, returning what to compare with the eager run."""
    def fit(**kwargs):
        model.fit(X, Y, batch_size=16, verbose=0, shuffle=False, **kwargs)
        return [w for w in model.get_weights()]

    def predict(**kwargs):
        return model.predict(X, batch_size=16, verbose=0, **kwargs)

    def captured(call, **kwargs):
        with cs.capture(model, **kwargs) as cap:
            call()
        return dict(cap)

    def patched(patch, **kwargs):
        with cs.patch(model, {"net/block_1": patch}, **kwargs):
            return predict()

    return {
        "fit": fit,
        "predict": predict,
        "fit_capture": lambda: captured(fit, select="*/block_*"),
        "fit_stats": lambda: captured(fit, select="*/block_*", reduce=("mean", "std")),
        "fit_grad": lambda: captured(fit, select="*/block_?", kinds=("output", "grad")),
        "fit_hist": lambda: captured(fit, select="*/block_*", reduce="hist"),
        "predict_patch": lambda: patched(_zero),
        "predict_array_patch": lambda: patched(ROWS),
        "predict_values_patch": lambda: patched(_scaled, values={"scale": np.float32(3.0)}),
        "predict_double": lambda: predict(mode="double"),
        "predict_half": lambda: predict(mode="half"),
        "fit_double": lambda: fit(mode="double"),
    }


@pytest.fixture
def dynamo():
    """Counts dynamo's compiles (a frame traced and compiled, first or again);
    hitting the recompile limit raises, and any warning dynamo logs fails."""
    import torch
    from torch._dynamo import callback

    torch._dynamo.reset()
    compiles = []

    def started(args):
        if args.callback_trigger is callback.CallbackTrigger.DYNAMO:
            compiles.append(args.compile_id)

    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warned.append
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    callback.on_compile_start(started)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            yield compiles
    finally:
        callback.callback_handler.remove_start_callback(started)
        logger.removeHandler(handler)
        torch._dynamo.reset()
    assert not [r.getMessage() for r in warned]


def _models(blocks):
    compiled, eager = Net(blocks, name="net"), Net(blocks, name="net")
    for model, jit in ((compiled, True), (eager, False)):
        model.context_cache_size = 16  # a key per scenario, none evicted
        model.compile(optimizer="sgd", loss="mse", jit_compile=jit)
        model(X[:2])
    eager.set_weights(compiled.get_weights())
    return compiled, eager


def _assert_same(got, want, name):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), name
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}: {key}")
        return
    for g, w in zip(got, want) if isinstance(want, list) else ((got, want),):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)


# The frames a first run compiles (measured with keras 3.15.1, torch 2.13: a
# plain fit compiles 19, as stock Keras's compiled step with its own graph
# breaks at `backward()` and in the optimizer; a capture's fit 28; a predict
# with a patch that takes the batch (an array) broke the graph at every layer
# call before `_record._first_batched`, and compiles 1 frame). A capture of
# statistics also compiles, once, the helpers its eager steps call while
# dynamo's frame hook is on (torch's finite path, `_reduce._torch_finite_partials`,
# and its caches' first calls): 26-28 frames, 32-35 with `hist`. The bound
# is far below one frame per layer call (8 blocks: 24 layers per step).
_FIRST = {"fit": 24, "predict": 2, "fit_capture": 32, "fit_stats": 32, "fit_hist": 37,
          "fit_grad": 0, "predict_patch": 2, "predict_array_patch": 2,
          "predict_values_patch": 2, "predict_double": 2, "predict_half": 2,
          "fit_double": 24}


def test_compiled_scenarios_compile_once_and_equal_eager(dynamo):
    compiled, eager = _models(8)
    compiled_calls, eager_calls = _scenarios(compiled), _scenarios(eager)
    counts = {}
    for name in _FIRST:
        for run in ("first", "again"):
            before = len(dynamo)
            got = compiled_calls[name]()
            counts[name, run] = len(dynamo) - before
            _assert_same(got, eager_calls[name](), f"{name} ({run})")
    assert {name: counts[name, "again"] for name in _FIRST} == dict.fromkeys(_FIRST, 0)
    first = {name: counts[name, "first"] for name in _FIRST}
    assert all(first[name] <= bound for name, bound in _FIRST.items()), str(first)
    # Gradients with respect to intermediates run the step uncompiled
    # (`_keras_compat.own_compile_cache`): none compiled, the values right.
    assert first["fit_grad"] == 0
    assert first["fit"] > 0 and first["predict"] > 0


GROWTH = ("fit_capture", "fit_hist", "predict_patch", "predict_array_patch",
          "predict_double")


def test_compiles_do_not_grow_with_the_number_of_layers(dynamo):
    counts = {}
    for blocks in (2, 8):
        model = Net(blocks, name="net")
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        calls = _scenarios(model)
        for name in GROWTH:
            before = len(dynamo)
            calls[name]()
            counts[blocks, name] = len(dynamo) - before
    for name in GROWTH:  # (a frame or so of the first model's may be shared ones)
        assert 0 < counts[8, name] <= counts[2, name], (name, counts)


def _residual(blocks, jit_compile):
    """A functional model whose `Add` layers take a list (a call no single tensor
    describes: the layer wrappers walk its arguments)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = inputs
    for i in range(blocks):
        x = keras.layers.Add(name=f"add_{i}")([x, keras.layers.Dense(8, name=f"d_{i}")(x)])
    model = cs.Model(inputs, keras.layers.Dense(1, name="head")(x), name="res")
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    return model


def test_layers_called_with_a_list_compile_once_however_many(dynamo):
    # Before `_record._leaves`, `keras.tree.flatten` in the wrappers broke the
    # graph at each such call: 8 blocks hit the recompile limit.
    counts = {}
    for blocks in (2, 8):
        compiled, eager = _residual(blocks, True), _residual(blocks, False)
        for run in ("first", "again"):
            got = []
            for model in (compiled, eager):
                before = len(dynamo)
                with cs.capture(model, "res/add_*") as cap:
                    outputs = model.predict(X, batch_size=16, verbose=0)
                if model is compiled:
                    counts[blocks, run] = len(dynamo) - before
                got.append((dict(cap), outputs))
            assert len(got[0][0]) == blocks
            _assert_same(got[0][0], got[1][0], f"{blocks} blocks ({run})")
            _assert_same(got[0][1], got[1][1], f"{blocks} blocks ({run})")
    # The first model may compile what every later one shares (27 frames in this
    # file alone, 1 after the rest of the suite); one of 8 blocks compiles its step.
    assert counts[2, "again"] == counts[8, "again"] == 0, counts
    assert 0 < counts[8, "first"] <= max(2, counts[2, "first"]), counts
