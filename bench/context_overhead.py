"""What context arguments cost: callscope against stock Keras, side by side.

Prints ratios (callscope time / stock time) measured in one run, per backend, on
an 8-block MLP. Each pair is timed interleaved, after a warm-up, and the median of
the repeats is reported. This is a script, not a timed test.

Usage:
    python bench/context_overhead.py                 # jax, tensorflow, torch
    python bench/context_overhead.py --backend jax --repeats 9
"""

from _paired import paired, per_backend, table

def run_backend(repeats):
    import keras
    import numpy as np

    import callscope as cs

    traces = {"stock": 0, "cs": 0}

    def make_block(hard_coded, counter):
        class Block(keras.layers.Layer):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.dense = keras.layers.Dense(256, activation="relu")
                self._register_call_context_args("debugging")

            def call(self, x, debugging=None):
                traces[counter] += 1
                if hard_coded if hard_coded is not None else debugging:
                    x = x * 0.5
                return self.dense(x)

        return Block

    def make_model(base, hard_coded=None, counter="stock"):
        block = make_block(hard_coded, counter)

        class MLP(base):
            def __init__(self):
                super().__init__()
                self.blocks = [block() for _ in range(8)]
                self.head = keras.layers.Dense(10)

            def call(self, x):
                for b in self.blocks:
                    x = b(x)
                return self.head(x)

        keras.utils.set_random_seed(0)
        model = MLP()
        model.compile(optimizer="sgd", loss="mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 256)).astype("float32")
    y = rng.normal(size=(4096, 10)).astype("float32")

    rows = []
    stock = make_model(keras.Model)
    ours = make_model(cs.Model)
    f = paired(lambda: ours.predict(x, batch_size=256, verbose=0),
               lambda: stock.predict(x, batch_size=256, verbose=0), repeats)
    rows.append(("cs.Model unused vs keras.Model: predict", f, ""))
    f = paired(lambda: ours.fit(x, y, batch_size=256, epochs=1, verbose=0),
               lambda: stock.fit(x, y, batch_size=256, epochs=1, verbose=0), repeats)
    rows.append(("cs.Model unused vs keras.Model: fit epoch", f, ""))

    stock_on = make_model(keras.Model, hard_coded=True)
    ours = make_model(cs.Model)
    ours.register_context_args("debugging")
    f = paired(lambda: ours.predict(x, batch_size=256, verbose=0, debugging=True),
               lambda: stock_on.predict(x, batch_size=256, verbose=0), repeats)
    rows.append(("predict(debugging=True) vs hard-coded", f, ""))
    f = paired(lambda: ours.fit(x, y, batch_size=256, epochs=1, verbose=0, debugging=True),
               lambda: stock_on.fit(x, y, batch_size=256, epochs=1, verbose=0), repeats)
    rows.append(("fit(debugging=True) vs hard-coded", f, ""))

    # The same work on the stock side: two models, one per value, alternating (on
    # torch, which runs eagerly, `debugging=True` costs a multiply per block).
    stocks = [make_model(keras.Model, hard_coded=value, counter="stock")
              for value in (False, True)]
    ours = make_model(cs.Model, counter="cs")
    ours.register_context_args("debugging")
    xs = x[:512]

    def alternate():
        for i in range(10):
            ours.predict(xs, batch_size=256, verbose=0, debugging=bool(i % 2))

    def plain():
        for i in range(10):
            stocks[i % 2].predict(xs, batch_size=256, verbose=0)

    alternate(), plain()  # first of each value
    traces["cs"] = traces["stock"] = 0
    f = paired(alternate, plain, repeats)
    note = f"block calls after warm-up: callscope {traces['cs']}, stock {traces['stock']}"
    if keras.backend.backend() == "torch":
        note += " (torch runs eagerly: calls, not traces)"
    rows.append(("10 predicts alternating True/False vs stock", f,
                 note + "  target <= 1.05"))

    print(table(f"{keras.backend.backend()} (keras {keras.__version__}, {repeats} repeats)",
                rows, "stock"))


def main():
    per_backend(__file__, __doc__, run_backend, repeats=7)


if __name__ == "__main__":
    main()
