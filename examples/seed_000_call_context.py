"""The first seed (keras-team/keras#21530): a `foo_mode` call-context argument.

Keras's docstring for `_register_call_context_args` shows this example with a
typo (`seq.register_call_context_args`, no underscore), and even corrected it only
works for a direct `seq(x, foo_mode=True)`: `fit`, `evaluate`, `predict` and the
`*_on_batch` methods reject the argument. With callscope the model registers the
name publicly, and every entry point honours it.

Run: python examples/seed_000_call_context.py
"""

import numpy as np
from keras import layers, ops

import callscope as cs


class Inner(layers.Layer):
    def __init__(self):
        super().__init__()
        # Register `foo_mode` as a call-context arg (the seed's own way).
        self._register_call_context_args("foo_mode")

    def call(self, x, foo_mode=False):
        # If foo_mode=True add 1, otherwise add 0
        add_val = ops.where(foo_mode, 1.0, 0.0)
        return x + add_val


class Outer(layers.Layer):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def call(self, x):
        # We don't pass foo_mode here: it reaches `self.inner` through the context.
        return self.inner(x)


def main():
    sample_input = np.array([[1.0], [2.0]])
    seq = cs.Sequential([Outer()])
    # Tell the Sequential model to propagate foo_mode down the call stack.
    seq.register_context_args("foo_mode")
    seq.compile(optimizer="sgd", loss="mse")
    target = sample_input + 1.0

    results = {
        "__call__": ops.convert_to_numpy(seq(sample_input, foo_mode=True)),
        "predict": seq.predict(sample_input, foo_mode=True, verbose=0),
        "predict_on_batch": seq.predict_on_batch(sample_input, foo_mode=True),
        "evaluate (loss)": seq.evaluate(sample_input, target, foo_mode=True, verbose=0),
        "test_on_batch (loss)": seq.test_on_batch(sample_input, target, foo_mode=True),
        "train_on_batch (loss)": seq.train_on_batch(sample_input, target, foo_mode=True),
        "fit (loss)": seq.fit(sample_input, target, foo_mode=True, epochs=1,
                              verbose=0).history["loss"][0],
    }
    with cs.context(foo_mode=True):
        results["predict in cs.context"] = seq.predict(sample_input, verbose=0)
    results["predict, default after"] = seq.predict(sample_input, verbose=0)

    for name, value in results.items():
        print(f"{name:>24}: {np.ravel(value).tolist()}")
    for name in ("__call__", "predict", "predict_on_batch", "predict in cs.context"):
        np.testing.assert_allclose(np.ravel(results[name]), [2.0, 3.0])
    for name in ("evaluate (loss)", "test_on_batch (loss)", "train_on_batch (loss)",
                 "fit (loss)"):
        assert float(np.ravel(results[name])[0]) == 0.0, name
    np.testing.assert_allclose(np.ravel(results["predict, default after"]), [1.0, 2.0])
    print("every entry point honoured foo_mode=True, and the default came back after")


if __name__ == "__main__":
    main()
