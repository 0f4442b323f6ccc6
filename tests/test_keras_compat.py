"""Fail loudly if Keras moves an internal that callscope relies on."""

import gc
import inspect
import pathlib
import re
import sys

import keras
import numpy as np
import pytest
from conftest import BACKEND

from callscope import _keras_compat

SRC = pathlib.Path(_keras_compat.__file__).parent


@pytest.mark.parametrize("owner, name", _keras_compat.REQUIRED_ATTRIBUTES,
                         ids=lambda x: getattr(x, "__name__", x))
def test_private_attribute_still_exists(owner, name):
    assert _keras_compat.has_private_attribute(owner, name), (
        f"keras {keras.__version__} no longer has {owner.__name__}.{name}; "
        f"callscope was checked against {_keras_compat.CHECKED_AGAINST}"
    )


def test_private_keras_api_is_used_only_in_the_compat_module():
    pattern = re.compile(r"keras\.src|\._register_call_context_args|\._call_context_args|"
                         r"\._tracker|\._flatten_layers|\._value\b|_nodes_by_depth|"
                         r"_compute_loss\b|_update_metrics_variables|_get_call_context|"
                         r"\.__dict__\b|\.__class__\s*=|__bases__\s*=|_seed_generators|"
                         r"\._jax_state|_use_cached_eval_dataset|super\(\)\.compute_loss_and_upd|"
                         r"stateless_apply|unpack_x_y_sample_weight|_purge_model_variables|"
                         r"_convert_input_args")
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "_keras_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_keras_version_is_in_the_supported_range():
    major, minor = (int(p) for p in keras.__version__.split(".")[:2])
    assert (major, minor) >= (3, 15)


def test_stock_step_detection():
    class Custom(keras.Model):
        def train_step(self, *args):
            return super().train_step(*args)

    assert _keras_compat.is_stock_step(keras.Model(), "train")
    assert _keras_compat.is_stock_step(Custom(), "test")
    assert not _keras_compat.is_stock_step(Custom(), "train")


def test_fit_validation_still_reenters_evaluate_with_its_private_argument():
    import inspect

    params = inspect.signature(keras.Model.evaluate).parameters
    assert _keras_compat.PRIVATE_EVALUATE_ARGUMENTS <= set(params) or any(
        p.kind is p.VAR_KEYWORD for p in params.values()
    ), f"keras {keras.__version__} changed how fit's validation calls evaluate"


def test_hidden_state_joins_variables_but_not_weights():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    variable = keras.Variable(1.0, trainable=False)
    _keras_compat.add_hidden_state(model, variable)
    assert any(v is variable for v in model.non_trainable_variables)
    assert not any(v is variable for v in model.weights)
    assert len(model.get_weights()) == 2


def test_jax_step_state_layout():
    if keras.backend.backend() != "jax":
        pytest.skip("the stateless step state is JAX's")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True)
    assert len(state) == 2 and len(state[0]) == len(model.trainable_variables)


def test_names_keras_makes_up_are_remembered():
    # `mark_made_up_names` wraps `Operation.__init__`, which makes up a name
    # where none is given, and marks the layer.
    from keras.src.ops import operation

    assert getattr(operation.Operation.__init__, "_callscope_marks", False)
    assert _keras_compat.has_automatic_name(keras.layers.Dense(2)), (
        f"keras {keras.__version__} no longer names unnamed layers in "
        "ops/operation.py's `Operation.__init__`")
    assert not _keras_compat.has_automatic_name(keras.layers.Dense(2, name="dense"))
    named = keras.layers.Dense(2)
    named.name = "".join(["de", "nse"])  # set later: another string object
    assert not _keras_compat.has_automatic_name(named)
    # Marked on the layer: nothing else keeps a made-up name (a table of them
    # grew with every operation made per call, an eager `keras.ops.cond` each).
    keras.layers.Dense(2)  # (the first made-up name is Keras's own key for the next)
    name = keras.layers.Dense(2).name
    gc.collect()  # (a layer is in reference cycles)
    assert sys.getrefcount(name) == 2  # `name`, and the call's argument


def test_loops_and_branches_are_counted():
    # `mark_loops` wraps the backend's keras.ops loops, which ops/core.py calls.
    depths = []
    _keras_compat.mark_loops()
    keras.ops.cond(True, lambda: depths.append(_keras_compat.loop_depth()) or 1.0,
                   lambda: depths.append(_keras_compat.loop_depth()) or 0.0)
    keras.ops.scan(lambda c, x: (depths.append(_keras_compat.loop_depth()) or c, x), 0.0,
                   keras.ops.ones((2,)))
    assert depths and min(depths) >= 1, f"keras {keras.__version__} moved its loops"


def test_a_checkpoint_body_is_counted_and_tf_recording_stopped_is_seen():
    # `mark_loops` also wraps `backend.core.remat`, which keras.remat calls.
    depths = []
    _keras_compat.mark_loops()
    keras.remat(lambda x: depths.append(_keras_compat.loop_depth()) or x * 2.0)(
        keras.ops.ones((2,)))
    assert depths == [1], f"keras {keras.__version__} moved `remat`: {depths}"
    assert _keras_compat.loop_depth() == 0

    # ... and `backend.core.custom_gradient`, which keras.ops.custom_gradient calls.
    @keras.ops.custom_gradient
    def doubled(x):
        depths.append(_keras_compat.loop_depth())
        return x * 2.0, lambda *args, upstream=None: 2.0 * (
            args[0] if upstream is None else upstream)

    doubled(keras.ops.ones((2,)))
    assert depths == [1, 1], f"keras {keras.__version__} moved `custom_gradient`: {depths}"
    assert _keras_compat.loop_depth() == 0
    if BACKEND == "tensorflow":
        import tensorflow as tf

        seen = []
        assert not _keras_compat.tf_recording_stopped()
        tf.recompute_grad(lambda x: seen.append(_keras_compat.tf_recording_stopped()) or x)(
            tf.ones((2,)))
        assert seen == [True], "tensorflow changed how recompute_grad runs its body"


def test_stateless_value_reads_the_innermost_scope_only():
    """`stateless_value` reads keras's StatelessScope: the mapped value inside,
    None outside or for a variable the scope does not map."""
    import numpy as np

    mapped, other = keras.Variable(1.0), keras.Variable(2.0)
    assert _keras_compat.stateless_value(mapped) is None
    with keras.StatelessScope(state_mapping=[(mapped, keras.ops.ones(()) * 5.0)]):
        assert float(np.asarray(_keras_compat.stateless_value(mapped))) == 5.0
        assert _keras_compat.stateless_value(other) is None
    assert _keras_compat.stateless_value(mapped) is None


@pytest.mark.skipif(BACKEND != "torch", reason="torch's autograd engine")
def test_torch_backward_is_seen_where_a_checkpoint_recomputes():
    import torch
    from torch.utils.checkpoint import checkpoint

    seen = []
    x = torch.ones(2, requires_grad=True)
    checkpoint(lambda t: seen.append(_keras_compat.in_torch_backward()) or t.sin(), x,
               use_reentrant=False).sum().backward()
    assert seen == [False, True], f"torch {torch.__version__} changed: {seen}"
    assert not _keras_compat.in_torch_backward()


@pytest.mark.skipif(BACKEND != "torch", reason="torch's checkpoint")
@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_passes_are_told_apart_and_found_again(reentrant):
    """`torch_checkpoint` reads torch's private checkpoint objects: each forward
    pass is its own object, and its recompute finds that same object."""
    import torch
    from torch.utils.checkpoint import checkpoint

    seen = []

    def body(t):
        seen.append(_keras_compat.torch_checkpoint(forward=True))
        return t.sin()

    x = torch.ones(2, requires_grad=True)
    losses = [checkpoint(body, x, use_reentrant=reentrant).sum() for _ in range(2)]
    sum(losses).backward()
    assert all(place is not None for place in seen), f"torch {torch.__version__}: {seen}"
    (first, none), (second, none_too), (again, backward), (again_too, _) = (
        seen[0], seen[1], *sorted(seen[2:], key=lambda p: p[0] is not seen[0][0]))
    assert none is None and none_too is None and first is not second
    assert again is first and again_too is second and backward is not None
    assert _keras_compat.torch_checkpoint(forward=True) is None
    with torch.no_grad():
        assert _keras_compat.torch_checkpoint(forward=True) is None
    # The code objects the stack walk looks for (reentrant forward and backward,
    # the non-reentrant `checkpoint` function and its recompute's unpack hook).
    codes = _keras_compat._checkpoint_code()
    assert len(codes) == 4 and all(inspect.iscode(c) for c in codes), codes


@pytest.mark.skipif(BACKEND != "torch", reason="torch's checkpoint")
def test_torch_reentrant_forward_pass_is_told_from_the_others():
    """`in_reentrant_checkpoint_forward` tells a reentrant checkpoint's forward pass
    (no graph: d loss / d a point there raises) from a non-reentrant one's, from
    either recompute, and from a non-reentrant pass nested in a reentrant one."""
    import torch
    from torch.utils.checkpoint import checkpoint

    seen = []

    def body(t):
        seen.append(_keras_compat.in_reentrant_checkpoint_forward())
        return t.sin()

    x = torch.ones(2, requires_grad=True)
    for reentrant in (True, False):
        checkpoint(body, x, use_reentrant=reentrant).sum().backward()
    checkpoint(lambda t: checkpoint(body, t, use_reentrant=False), x,
               use_reentrant=True).sum().backward()
    assert seen == [True, False, False, False, True, False, False], (
        f"torch {torch.__version__} changed: {seen}")
    assert not _keras_compat.in_reentrant_checkpoint_forward()


def test_a_mask_on_a_call_output_is_kept_by_layer_call():
    # `_record._masked_like` relies on both: the mask is read and set as Keras
    # does, and `Layer.__call__` keeps a mask the call's output already has.
    class Passes(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.supports_masking = True

        def call(self, x):
            y = x + 0.0
            _keras_compat.set_keras_mask(y, keras.ops.convert_to_tensor([True, False]))
            return y

    x = keras.ops.ones((2, 3))
    _keras_compat.set_keras_mask(x, keras.ops.convert_to_tensor([False, False]))
    out = Passes()(x)
    assert keras.ops.convert_to_numpy(_keras_compat.keras_mask(out)).tolist() == [True, False]
    assert _keras_compat.keras_mask(keras.ops.ones((2,))) is None


def test_the_call_context_and_shape_only_calls_are_seen_where_a_call_runs():
    # `_model._fills_passed` relies on both: a layer whose `call` a wrapper runs
    # directly (TimeDistributed) still sees the enclosing layer's call context, and
    # a call run only for its output's shape runs in Keras's symbolic scope.
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append((_keras_compat.call_context_value("callscope_probe"),
                         _keras_compat.in_symbolic_scope()))
            return x

    class Outer(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            _keras_compat.register_call_context_args(self, ("callscope_probe",))
            self.wrapped = keras.layers.TimeDistributed(Probe())

        def call(self, x, callscope_probe=None):
            return self.wrapped(x)

    Outer()(keras.ops.ones((1, 2, 3)), callscope_probe="here")
    Probe().compute_output_spec(keras.KerasTensor((1, 3)))
    # (Building TimeDistributed runs shape-only calls first; then one per time step.)
    assert [s for s in seen if not s[1]] == [("here", False)] * 2, seen
    assert seen[-1] == (None, True), seen
    assert _keras_compat.call_context_value("callscope_probe") is None
    assert not _keras_compat.in_symbolic_scope()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF's XLA context")
def test_tf_xla_context_is_seen_where_a_step_compiles_with_xla():
    # `_reduce.partials` reads a bfloat16 or float16 value from its bits there
    # only (XLA drops its rounding; without XLA that would only cost).
    import tensorflow as tf

    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(_keras_compat.in_tf_xla_context())
            return x

    def probe(x):
        return Probe()(x)

    x = tf.ones((2, 3))
    tf.function(probe, jit_compile=True)(x)
    tf.function(probe)(x)
    tf.function(lambda t: tf.function(probe, jit_compile=True)(t))(x)  # nested, as Keras's
    assert seen == [True, False, True], seen
    for jit_compile in (True, False):
        model = keras.Sequential([keras.Input((3,)), Probe()])
        model.compile(jit_compile=jit_compile)
        seen.clear()  # (building the model ran `call` symbolically)
        model.predict(x, verbose=0)
        assert seen and set(seen) == {jit_compile}, (jit_compile, seen)
    assert not _keras_compat.in_tf_xla_context()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF's autograph")
def test_autograph_leaves_callscope_alone():
    # A user's tf.function that calls a callscope model converts the code it
    # reaches unless autograph's rules say not to (as for `keras`): converted, a
    # full test run once called a stale conversion (`Patches._values`) in
    # `stateless_call` (tensorflow 2.21.0).
    import tensorflow as tf
    from tensorflow.python.autograph.impl import conversion

    from callscope import _mixin, _record

    for fn in (_mixin.ContextMixin.stateless_call, _record.active_patches,
               _record.Patches.find):
        assert conversion.is_allowlisted(fn), fn
    assert not conversion.is_allowlisted(test_autograph_leaves_callscope_alone)
    _keras_compat.keep_autograph_out()  # once, whatever the calls
    from tensorflow.python.autograph.core import config

    assert sum(getattr(r, "_prefix", None) == "callscope" for r in config.CONVERSION_RULES) == 1
    del tf


def test_is_tracing_now_tells_a_trace_from_eager_code_on_each_backend():
    # On JAX its fast answer (`jax_at_top_level`, JAX's private trace state) must
    # agree with the probe it skips: eager code, and eager transformations that
    # stage nothing (grad, vmap), are not traced; jit, and grad inside it, are.
    from callscope import _backend

    seen = []

    def probe(x):
        seen.append(_backend.is_tracing_now())
        return x * 2.0

    probe(1.0)
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        assert _keras_compat.jax_at_top_level(), (
            f"jax {jax.__version__}: `jax._src.core.trace_state_clean` no longer says "
            "eager code is at the top level")
        jax.grad(probe)(1.0)
        jax.vmap(probe)(np.ones(2, "float32"))
        jax.jit(probe)(1.0)
        jax.jit(jax.grad(probe))(3.0)
        assert seen == [False, False, False, True, True]

        inside = []
        jax.jit(lambda x: inside.append(_keras_compat.jax_at_top_level()) or x)(1.0)
        jax.grad(lambda x: inside.append(_keras_compat.jax_at_top_level()) or x)(1.0)
        assert inside == [False, False]
    elif backend == "tensorflow":
        import tensorflow as tf

        tf.function(probe)(tf.constant(1.0))
        assert seen == [False, True]
    else:
        import torch

        torch.compile(probe, backend="eager")(torch.ones(()))
        assert seen == [False, True]
