"""ModelParallel on 8 CPU devices: one run sharded, one on one device, same weights.

Usage: python sharded_worker.py   (prints one `RESULTS {json}` line)
Device counts are fixed before JAX starts, hence the process. Two models: a
subclassed one with a context argument, and a keras_hub Gemma backbone from a tiny
config sharded by its own `get_layout_map` (kernels over `model`, batch over
`batch`).
"""

import contextlib
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import callscope as cs  # noqa: E402
from multiprocess_model import build as build_net  # noqa: E402

STATS = ("mean", "std", "min", "max", "hist", "nan_count")


def build_gemma():
    import keras_hub

    keras.utils.set_random_seed(0)
    return cs.enable(keras_hub.models.GemmaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=4,
        hidden_dim=32, intermediate_dim=64, head_dim=8, dtype="float32", name="gemma"))


RNG = np.random.RandomState(0)
IDS = RNG.randint(0, 64, (16, 12)).astype("int32")
CASES = {
    "net": dict(build=build_net, x=RNG.randn(16, 6).astype("float32"),
                y=RNG.randn(16, 6).astype("float32"), blocks="net/block",
                patch="net/block/up", context=True),
    "gemma": dict(build=build_gemma, x={"token_ids": IDS, "padding_mask": np.ones_like(IDS)},
                  y=RNG.randn(16, 12, 32).astype("float32"), blocks="gemma/decoder_block_*",
                  patch="gemma/decoder_block_0", context=False),
}


def device_bytes():
    """Bytes of live arrays per device (CPU devices report no memory stats)."""
    used = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            used[shard.device.id] = used.get(shard.device.id, 0) + shard.data.nbytes
    return used


def run(case, model):
    x, y, out = case["x"], case["y"], {}
    out["predict"] = model.predict(x, batch_size=8, verbose=0)
    if case["context"]:
        out["predict_debugging"] = model.predict(x, batch_size=8, debugging=True, verbose=0)
    with cs.capture(model, case["blocks"]) as cap:
        model.predict(x, batch_size=8, verbose=0)
        # Landed on the host as the call ran: the capture holds no device arrays.
        out["held_on_device"] = sum(call._landing.held() for call in cap.calls
                                    if call._landing is not None)
        out["on_host"] = all(isinstance(b.view(), np.ndarray)
                             for call in cap.calls for b in call._full.values())
    out["capture"] = dict(cap.items())
    with cs.capture(model, case["blocks"], reduce=STATS, bins=8) as stats:
        model.predict(x, batch_size=8, verbose=0)
    out["stats"] = dict(stats.items())
    with cs.patch(model, {case["patch"]: lambda v: v * 0.5}):
        out["patched"] = model.predict(x, batch_size=8, verbose=0)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with cs.capture(model, case["blocks"], kinds=("output", "grad")) as grads:
        out["loss"] = model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                                verbose=0).history["loss"]
    out["grads"] = dict(grads.items())
    out["weights"] = model.get_weights()
    # Figures for the issue note: time per fit step with and without capture
    # (the best of 3 fits of 16 steps), and the most bytes any one device holds
    # for a capture of 16 batches, beyond what it held before.
    xs = keras.tree.map_structure(lambda a: np.concatenate([a] * 8), x)
    ys = np.concatenate([y] * 8)

    def best_step(capturing):
        times = []
        for _ in range(4):  # the first compiles
            with cs.capture(model, case["blocks"], kinds=("output", "grad")) if capturing \
                    else contextlib.nullcontext():
                t = time.perf_counter()
                model.fit(xs, ys, batch_size=8, verbose=0)
                times.append((time.perf_counter() - t) / 16)
        return min(times[1:])

    before = device_bytes()
    with cs.capture(model, case["blocks"], kinds=("output", "grad")) as cap:
        model.fit(xs, ys, batch_size=8, verbose=0)
        held = device_bytes()
    del cap
    grown = {d: held[d] - before.get(d, 0) for d in held}
    out["figures"] = {"step_s": best_step(False), "step_captured_s": best_step(True),
                      "max_device_bytes_capturing": max(grown.values()),
                      "devices_holding": sum(v > 0 for v in grown.values())}
    return out


def tolist(tree):
    return keras.tree.map_structure(lambda v: np.asarray(v).tolist(), tree)


results = {}
for name, case in CASES.items():
    single = case["build"]()
    weights = single.get_weights()
    results[name] = {"single": tolist(run(case, single))}
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"),
                                         keras.distribution.list_devices("cpu"))
    if name == "gemma":
        import keras_hub

        layout = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    else:
        layout = keras.distribution.LayoutMap(mesh)
        layout[".*/up/kernel"] = (None, "model")
        layout[".*/down/kernel"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch"))
    model = case["build"]()
    model.set_weights(weights)
    results[name]["sharded_kernels"] = sum(
        len(v.value.sharding.device_set) == 8 and v.value.sharding.shard_shape(v.shape) != v.shape
        for v in model.weights)
    results[name]["sharded"] = tolist(run(case, model))
    keras.distribution.set_distribution(None)
print("RESULTS " + json.dumps(results))
