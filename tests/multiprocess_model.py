"""The model and data that test_multiprocess.py runs in two processes and in one."""

import keras
import numpy as np

import callscope as cs

RNG = np.random.RandomState(7)
# Each process's own rows; a step's global batch is 4 rows of process 0, then 4 of
# process 1 (the mesh's batch axis runs over the processes in order).
DATA = [(RNG.randn(8, 6).astype("float32"), RNG.randn(8, 6).astype("float32"))
        for _ in range(2)]


def global_order(parts, batch=4):
    """The processes' rows as one process sees them, step by step."""
    steps = len(parts[0]) // batch
    return np.concatenate([p[i * batch:(i + 1) * batch] for i in range(steps) for p in parts])


@cs.context_args("debugging")
class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(16, activation="relu", name="up")
        self.down = keras.layers.Dense(6, name="down")

    def call(self, x, debugging=None):
        h = x + self.down(self.up(x))
        return h + 100.0 if debugging else h


class Net(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = Block(name="block")
        self.head = keras.layers.Dense(6, name="head")

    def call(self, x):
        return self.head(self.block(x))


def build():
    keras.utils.set_random_seed(0)
    model = Net(name="net")
    model.register_context_args("debugging")
    model(np.zeros((1, 6), "float32"))
    return model
