"""The start of a distribution worker script: device counts are fixed before a
backend initialises, so each scenario runs in a process of its own, which calls
`start` before it imports keras."""

import faulthandler
import os
import sys


def start(jax_devices: int, tf_devices: int) -> str:
    """Sets up the engine named on the command line (`jax` or `tensorflow`) with
    that many CPU devices (TF: logical devices of the one CPU) and returns its name.
    A hang fails with its stacks."""
    faulthandler.dump_traceback_later(500, exit=True)
    engine = sys.argv[1]
    if engine == "jax":
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={jax_devices}"
    os.environ["KERAS_BACKEND"] = engine
    if engine == "tensorflow":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * tf_devices)
    return engine
