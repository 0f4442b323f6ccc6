"""One of two JAX processes running one sharded model (see test_multiprocess.py).

Usage: python multiprocess_worker.py PROCESS_ID PORT OUT_DIR
Each process feeds its own rows (Keras's multi-process data rule) to a model
sharded over 2 processes x 4 CPU devices, streams its shards of the captures into
shared directories, and writes what it saw to OUT_DIR for the test to compare.
"""

import json
import os
import sys

PROCESS, PORT, OUT = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{PORT}", num_processes=2, process_id=PROCESS)

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import callscope as cs  # noqa: E402
from multiprocess_model import DATA, build  # noqa: E402

mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"),
                                     keras.distribution.list_devices("cpu"))
layout = keras.distribution.LayoutMap(mesh)
layout[".*/up/kernel"] = (None, "model")
layout[".*/down/kernel"] = ("model", None)
distribution = keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
distribution.auto_shard_dataset = False  # each process passes its own rows
keras.distribution.set_distribution(distribution)

model = build()
if PROCESS == 0:
    np.savez(os.path.join(OUT, "weights.npz"), *model.get_weights())
x, y = DATA[PROCESS]  # this process's rows
seen = {"processes": jax.process_count(), "devices": jax.device_count(),
        "sharded_kernels": sum(v.value.sharding.shard_shape(v.shape) != v.shape
                               for v in model.weights)}
with cs.capture(model, ["*/up", "*/block"], to=os.path.join(OUT, "predict")):
    seen["predict"] = model.predict(x, batch_size=4, verbose=0).tolist()
seen["predict_debugging"] = model.predict(x, batch_size=4, debugging=True, verbose=0).tolist()
with cs.capture(model, ["*/up", "*/block"], reduce=("mean", "std", "min", "max", "hist"),
                bins=8) as stats:
    model.predict(x, batch_size=4, verbose=0)
seen["stats"] = {k: np.asarray(v).tolist() for k, v in stats.items()}
model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
with cs.capture(model, "*/block", kinds=("output", "grad"), to=os.path.join(OUT, "fit")):
    seen["loss"] = model.fit(x, y, batch_size=4, epochs=1, shuffle=False,
                             verbose=0).history["loss"]
seen["weights"] = [np.asarray(w).tolist() for w in model.get_weights()]
with open(os.path.join(OUT, f"seen.p{PROCESS}.json"), "w") as f:
    json.dump(seen, f)
