"""`callscope demo`: train a small subclassed model and show what happens inside it.

The task has a known answer and needs no download: points in 8 dimensions whose
label is the sign of `x0 * x1` (XOR), which a linear model cannot learn but the
nested blocks can. While `fit` runs with Keras's own progress bar, callscope
captures each block's activation statistics (mean, std, dead-ReLU fraction,
histograms) and the gradient of the loss with respect to each block's output,
all inside the compiled training step. Then `predict(debugging=True)` makes the
blocks sow their pre-activations, captured for a few examples.
"""

from __future__ import annotations

import os

import keras
import numpy as np

import callscope as cs
from callscope import report

BLOCKS = 4


@cs.context_args("debugging")
class Block(keras.layers.Layer):
    """Dense + ReLU; in debugging mode it also sows its pre-activation."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units)

    def call(self, x, debugging=None):
        h = self.dense(x)
        if debugging:
            cs.sow(self, "pre_act", h)
        return keras.ops.relu(h)


class DemoNet(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [Block(32, name=f"block_{i}") for i in range(BLOCKS)]
        self.head = keras.layers.Dense(2, name="head")
        self.register_context_args("debugging")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(n, 8)).astype("float32")
    y = (x[:, 0] * x[:, 1] > 0).astype("int32")
    return x, y


def run_demo(out, epochs):
    keras.utils.set_random_seed(0)
    os.makedirs(out, exist_ok=True)
    x, y = make_data(4096, seed=0)
    model = DemoNet(name="demo_net")
    model.compile(optimizer=keras.optimizers.Adam(3e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    blocks = "demo_net/block_?"
    with cs.capture(model, blocks, reduce=("mean", "std", "frac_zero", "hist"),
                    hist_range=(0.0, 3.0), bins=30, log=True) as acts, \
            cs.capture(model, blocks, kinds=("grad",), reduce=("rms",)) as grads:
        history = model.fit(x, y, batch_size=64, epochs=epochs, validation_split=0.1,
                            verbose=1)
    test_x, test_y = make_data(512, seed=1)
    _, accuracy = model.evaluate(test_x, test_y, verbose=0)
    print(f"test accuracy {accuracy:.3f} (XOR of the first two coordinates)")

    with cs.capture(model) as sown:
        logits = model.predict(test_x[:8], debugging=True, verbose=0)
    print(f"predict(debugging=True) on 8 examples: logits {logits.shape}; sown: "
          + ", ".join(f"{k} {v.shape}" for k, v in sown.items()))

    values = {**{k: acts[k] for k in acts}, **{k: grads[k] for k in grads}}
    edges = {k: acts.hist_edges(k) for k in acts if k.endswith("/hist")}
    files = {
        "activation statistics": report.plot_step_statistics(
            values, os.path.join(out, "activations.png")),
        "activation histograms": report.plot_histograms(
            values, edges, os.path.join(out, "histograms.png")),
        "gradient norms": report.plot_grad_norms(values, os.path.join(out, "gradients.png")),
    }
    with cs.context(debugging=True):  # the tree then lists what each block sows
        summary = cs.summary(model, test_x[:8], print_fn=lambda s: None)
    files["call tree"] = os.path.join(out, "summary.txt")
    with open(files["call tree"], "w") as f:
        f.write(summary + "\n")
    files["every statistic (CSV)"] = os.path.join(out, "statistics.csv")
    report.write_csv(files["every statistic (CSV)"], values)
    epoch_keys = [k for k in history.history if k.endswith("/frac_zero")]
    print("dead-ReLU fraction per block in the last epoch (from History): "
          + ", ".join(f"{k.split('/')[1]} {history.history[k][-1]:.2f}" for k in epoch_keys))
    print()
    print(summary)
    print()
    for name, path in files.items():
        print(f"{name:>24}: {path}")
    return files
