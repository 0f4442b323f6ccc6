"""What a capture costs an eager call: callscope against the same call, side by side.

A direct `model(x)` inside `cs.capture`, and `cs.intermediate_grads`, run the
model's Python once per call (no compiled step keeps what a first call learned),
so their per-call work grows with the model. Measured on a subclassed model of
241 layers: 60 blocks named alike, each holding three `Dense(name="d")` and a
ReLU, whose points callscope numbers from where each parent holds them. Prints
ratios (callscope time / reference time) measured in one run, per backend:
interleaved pairs after a warm-up, the median of the repeats with its interval.
This is a script, not a timed test.

Usage:
    python bench/eager_calls.py                      # jax, tensorflow, torch
    python bench/eager_calls.py --backend torch --repeats 15
"""

from _paired import paired, per_backend, table

BLOCKS = 60


def run_backend(repeats):
    import keras
    import numpy as np

    import callscope as cs

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.d = [keras.layers.Dense(8, name="d") for _ in range(3)]
            self.act = keras.layers.ReLU(name="act")

        def call(self, x):
            for dense in self.d:
                x = dense(x)
            return self.act(x)

    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.blocks = [Block(name="b") for _ in range(BLOCKS)]

        def call(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = cs.enable(Net(name="net"))
    x = keras.ops.convert_to_tensor(np.ones((4, 8), "float32"))
    model(x)
    rows = []

    def captured():
        with cs.capture(model, "net/b/d*") as cap:
            model(x)
        assert len(cap) == 3  # net/b/d, net/b/d#1, net/b/d#2 of the first block

    f = paired(captured, lambda: model(x), repeats)
    rows.append(("model(x) in a capture of 3 points vs model(x)", f, "diagnostic"))

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        weights = [v.value for v in model.trainable_variables]
        others = [v.value for v in model.non_trainable_variables]

        def loss_fn(x):
            return keras.ops.sum(model.stateless_call(weights, others, x)[0] ** 2)

        def reference():
            jax.grad(loss_fn)(x)
    else:
        def loss_fn(x):
            return keras.ops.sum(model(x) ** 2)

        if backend == "torch":
            def reference():
                model.zero_grad()
                loss_fn(x).backward()
        else:
            import tensorflow as tf

            def reference():
                with tf.GradientTape() as tape:
                    loss = loss_fn(x)
                tape.gradient(loss, model.trainable_variables)

    def grads():
        cs.intermediate_grads(model, loss_fn, x, select="net/b/d*")

    f = paired(grads, reference, repeats)
    rows.append(("intermediate_grads vs backend loss + grad", f, "diagnostic"))
    print(table(f"{backend} (keras {keras.__version__}, {repeats} repeats)", rows,
                "reference"))


def main():
    per_backend(__file__, __doc__, run_backend, repeats=9)


if __name__ == "__main__":
    main()
