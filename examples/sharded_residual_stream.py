"""The residual stream of every block of a sharded transformer, with statistics.

A keras_hub Gemma backbone (a tiny config, random weights: nothing downloads) is
sharded with its own layout map over 8 CPU devices: kernels over a `model` axis,
the batch over `batch`. One `predict` streams every block's output to disk and
computes per-block statistics on the devices; the plot shows them side by side.

Run: KERAS_BACKEND=jax python examples/sharded_residual_stream.py
"""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["KERAS_BACKEND"] = "jax"  # keras.distribution is JAX's engine

import keras  # noqa: E402
import keras_hub  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

import callscope as cs  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

devices = keras.distribution.list_devices("cpu")
mesh = keras.distribution.DeviceMesh((2, len(devices) // 2), ("batch", "model"), devices)
layout = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch"))

backbone = cs.enable(keras_hub.models.GemmaBackbone(
    vocabulary_size=256, num_layers=4, num_query_heads=4, num_key_value_heads=4,
    hidden_dim=64, intermediate_dim=128, head_dim=16, dtype="float32", name="gemma"))
ids = np.random.RandomState(0).randint(0, 256, (32, 16)).astype("int32")
data = {"token_ids": ids, "padding_mask": np.ones_like(ids)}

blocks = "gemma/decoder_block_*"  # each block's output: the residual stream after it
stream_dir = tempfile.mkdtemp()
with cs.capture(backbone, blocks, to=stream_dir, overwrite=True) as stream, \
        cs.capture(backbone, blocks, reduce=("mean", "std", "absmax")) as stats:
    backbone.predict(data, batch_size=8, verbose=0)

names = [f"gemma/decoder_block_{i}:output" for i in range(4)]
residual = cs.load_capture(stream_dir)  # the whole arrays, read back from disk
assert residual[names[0]].shape == (32, 16, 64)
for name in names:  # the statistics the devices computed are the streamed arrays'
    np.testing.assert_allclose(stats[f"{name}/std"], residual[name].std(), rtol=1e-4)

fig, ax = plt.subplots(figsize=(5, 3))
for stat in ("mean", "std", "absmax"):
    ax.plot(range(4), [stats[f"{n}/{stat}"] for n in names], marker="o", label=stat)
ax.set_xlabel("decoder block")
ax.set_title("Residual stream of a sharded Gemma")
ax.legend()
fig.savefig("residual_stream.png", dpi=80, bbox_inches="tight")
print("per-block std:", [round(float(stats[f"{n}/std"]), 3) for n in names])
