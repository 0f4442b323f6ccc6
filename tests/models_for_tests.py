"""Small models used across tests (imported by the test modules)."""

import keras
import numpy as np
from keras import layers, ops

import callscope as cs


class Inner(layers.Layer):
    """The first seed's layer: adds 1 when `foo_mode` is on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._register_call_context_args("foo_mode")

    def call(self, x, foo_mode=False):
        return x + ops.where(foo_mode, 1.0, 0.0)


class Outer(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = Inner()

    def call(self, x):
        return self.inner(x)


@cs.context_args("debugging")
class Probe(layers.Layer):
    """Adds 100 when `debugging`, and records every value it sees in Python."""

    def __init__(self, seen=None, **kwargs):
        super().__init__(**kwargs)
        self.seen = seen if seen is not None else []

    def call(self, x, debugging=None):
        self.seen.append(debugging)
        return x + 100.0 if debugging else x


class Deep(layers.Layer):
    """Three levels of plain layers around a Probe: no plumbing in between."""

    def __init__(self, seen=None, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(1, kernel_initializer="ones", use_bias=False)
        self.level1 = Level(Level(Probe(seen)))

    def call(self, x):
        return self.level1(self.dense(x))


class Level(layers.Layer):
    def __init__(self, child, **kwargs):
        super().__init__(**kwargs)
        self.child = child

    def call(self, x):
        return self.child(x)


class SubModel(cs.Model):
    """A subclassed cs.Model with a Probe three levels deep."""

    def __init__(self, seen=None, **kwargs):
        super().__init__(**kwargs)
        self.deep = Deep(seen)
        self.register_context_args("debugging")

    def call(self, x):
        return self.deep(x)


def make_models(seen):
    """One model of each kind, all computing sum(x) (+100 when debugging)."""
    sub = SubModel(seen)
    seq = cs.Sequential([keras.Input((3,)), Deep(seen)])
    seq.register_context_args("debugging")
    inputs = keras.Input((3,))
    fun = cs.Model(inputs, Deep(seen)(inputs))
    fun.register_context_args("debugging")
    stock = keras.Sequential([keras.Input((3,)), Deep(seen)])
    enabled = cs.enable(stock)
    enabled.register_context_args("debugging")
    return {"subclassed": sub, "sequential": seq, "functional": fun, "enabled": enabled}


@cs.context_args("debugging")
class ScalesWhenDebugging(layers.Layer):
    """Weightless: `x * factor` when `debugging` is true, else `x`."""

    def __init__(self, factor=0.5, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x, debugging=None):
        return x * self.factor if debugging else x


@cs.context_args("debugging")
class HalvesWhenDebugging(layers.Layer):
    """A Dense(3) whose output is halved when `debugging` is true."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def call(self, x, debugging=None):
        h = self.dense(x)
        return h * 0.5 if debugging else h


class SowsWithoutBatchAxis(layers.Layer):
    """A Dense(4) that sows values whose batch axis is not the first: one of its
    weights with a NaN in it and that weight's sum (`batch_axis=None`), and its
    output three times over, time-major (`batch_axis=1`). The sum and two of the
    three steps reach the output, so they have gradients. `of_rows=True` also sows
    the mean of the batch's rows as if it had no batch axis: wrong where replicas
    each see their own rows."""

    def __init__(self, of_rows=False, **kwargs):
        super().__init__(**kwargs)
        self.of_rows = of_rows
        self.dense = layers.Dense(4, name="dense")

    def call(self, x):
        h = self.dense(x)
        nan_first = np.ones((2, 4), "float32")
        nan_first[0, 0] = np.nan
        cs.sow(self, "kernel", ops.convert_to_tensor(nan_first) * self.dense.kernel,
               batch_axis=None)
        total = cs.sow(self, "kernel_sum", ops.sum(self.dense.kernel), batch_axis=None)
        steps = cs.sow(self, "time_major", ops.stack([h, 2.0 * h, h - 1.0]), batch_axis=1)
        if self.of_rows:
            cs.sow(self, "row_mean", ops.mean(x, axis=0), batch_axis=None)
        return steps[0] + 0.5 * steps[2] + 0.1 * total

    def get_config(self):
        return {**super().get_config(), "of_rows": self.of_rows}


class Branching(cs.Model):
    """Runs `a` after `b` where `use_a` says: Python each step in an eager step,
    so a step can skip a point an earlier step reached."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.b = keras.layers.Dense(3, name="b", kernel_initializer="ones")
        self.a = keras.layers.Dense(3, name="a", kernel_initializer="ones")
        self.use_a = True

    def call(self, x):
        h = self.b(x)
        return self.a(h) if self.use_a else h


class SkipsOnShortBatches(cs.Model):
    """Runs `a` after `b`, except for a batch of fewer than 8 rows whose size its
    trace knows: the uneven last batch of 20 rows in batches of 8. (TF's compiled
    steps trace with the batch size unknown, so they run `a` every step.)"""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.b = keras.layers.Dense(3, name="b", kernel_initializer="ones")
        self.a = keras.layers.Dense(3, name="a", kernel_initializer="ones")

    def call(self, x):
        h = self.b(x)
        return h if x.shape[0] is not None and x.shape[0] < 8 else self.a(h)
