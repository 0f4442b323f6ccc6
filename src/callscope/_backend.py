"""The few backend facts the engine needs that `keras.ops` does not give.

Is this Python running inside a trace (a compiled function being built), and how
to place a run's value in a JAX step's state. The framework of the chosen
backend is imported here on first use, never another.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import threading
import weakref
from typing import Any, NamedTuple

import keras
import numpy as np

BACKEND = keras.backend.backend()


def is_tracing(leaves) -> bool:
    """True inside a compiled function's Python: a JAX trace (tracer inputs), a
    `tf.function` graph, `torch.compile`'s dynamo, or `torch.jit.trace`."""
    if BACKEND == "jax":
        import jax

        return any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return not tf.executing_eagerly()
    if BACKEND == "torch":
        import torch

        # (`torch.jit.trace` records the ops that ran, as code: a patch or a context
        # value it saw would be served by the traced module, outside any scope.)
        return bool(torch.compiler.is_compiling() or torch.jit.is_tracing())
    return False


def torch_jit_tracing() -> bool:
    if BACKEND != "torch":
        return False
    import torch

    return bool(torch.jit.is_tracing())


def is_tracing_now() -> bool:
    """`is_tracing` without inputs to look at: is a compiled function being built?"""
    if BACKEND == "jax":
        import jax

        from callscope import _keras_compat

        if _keras_compat.jax_at_top_level():
            return False
        return isinstance(jax.numpy.zeros(()), jax.core.Tracer)  # staged while tracing
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return not tf.executing_eagerly()
    if BACKEND == "torch":
        import torch

        # (`torch.jit.trace` records the ops that ran, as code: a patch or a context
        # value it saw would be served by the traced module, outside any scope.)
        return bool(torch.compiler.is_compiling() or torch.jit.is_tracing())
    return False


_TRACE_NUMBERS = itertools.count(1)
_GRAPH_TRACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TRACE_LOCK = threading.Lock()


class Trace(NamedTuple):
    number: int
    tensor: Any  # the number, as a step returns it: int32, shape (1,)


def new_trace() -> Trace:
    """A number for the trace being built (`is_tracing_now`). On TF, the same for
    every replica of a tf.distribute strategy: their threads trace the step into
    one graph, and Keras averages or joins what they return. On torch, a constant
    of the dynamo graph (`assume_constant_result`): traced as a counter, dynamo
    would guard on it and compile again at every step."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        graph = tf.compat.v1.get_default_graph()
        with _TRACE_LOCK:
            if graph not in _GRAPH_TRACES:
                _GRAPH_TRACES[graph] = next(_TRACE_NUMBERS)
            number = _GRAPH_TRACES[graph]
        return Trace(number, tf.constant([number], tf.int32))
    if BACKEND == "torch":
        import torch

        number = _constant_trace_number()
        return Trace(number, torch.tensor([number], dtype=torch.int32))
    number = next(_TRACE_NUMBERS)
    return Trace(number, keras.ops.convert_to_tensor(np.asarray([number], "int32")))


def _next_trace_number() -> int:
    return next(_TRACE_NUMBERS)


if BACKEND == "torch":
    import torch

    _constant_trace_number = torch.compiler.assume_constant_result(_next_trace_number)


def untraced(fn):
    """`fn`, run as plain Python where torch.compile's dynamo would trace it (it
    breaks the graph there): for a walk of Keras's layers, whose `InputLayer` is a
    torch Module without `_buffers` that dynamo fails on."""
    if BACKEND == "torch":
        import torch

        return torch.compiler.disable(fn)
    return fn


def is_symbolic(leaves) -> bool:
    """True for Keras's shape-only calls: KerasTensors, and on torch the meta
    tensors that `compute_output_spec` runs the model on (eagerly)."""
    for leaf in leaves:
        if isinstance(leaf, keras.KerasTensor):
            return True
        if BACKEND == "torch" and getattr(leaf, "is_meta", False):
            return True
    return False


def _replica_context():
    """The replica context of a multi-replica `tf.distribute` step running now, or
    None (other backends, one replica, cross-replica context)."""
    if BACKEND != "tensorflow":
        return None
    import tensorflow as tf

    if tf.distribute.in_cross_replica_context():
        return None
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def _replica_parts(variable) -> tuple | None:
    """The per-replica variables of a `tf.distribute` variable (a metric's is
    sync-on-read: each replica keeps its own part), or None."""
    if BACKEND != "tensorflow":
        return None
    parts = getattr(getattr(variable, "value", None), "values", None)
    return parts if isinstance(parts, tuple) else None


def host_values(variable):
    """A copy of `variable`'s value on the host; per replica for a distributed one
    (a sync-on-read variable has no single value: numpy refuses it)."""
    parts = _replica_parts(variable)
    if parts is not None:
        return tuple(np.array(p.numpy()) for p in parts)
    return keras.ops.convert_to_numpy(variable.value)


def assign_values(variable, values) -> None:
    """Puts back what `host_values` copied."""
    parts = _replica_parts(variable)
    if parts is not None and isinstance(values, tuple) and len(values) == len(parts):
        for part, value in zip(parts, values):
            part.assign(value)
        return
    variable.assign(values)


def strategy_scope(model):
    """The scope of `model`'s `tf.distribute` strategy (TF's trainer gives the
    default strategy outside any), where variables of the model are made: one
    made outside a MirroredStrategy's scope is a plain variable, which the
    optimizer's distributed update refuses (a bare AssertionError in `fit`). A
    null context on the other backends."""
    strategy = getattr(model, "distribute_strategy", None)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def is_mirrored(strategy) -> bool:
    """Is `strategy` a `tf.distribute.MirroredStrategy` (one machine)?"""
    if BACKEND != "tensorflow":
        return False
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.MirroredStrategy)


def in_replica_thread() -> bool:
    """Does a replica of a `tf.distribute` step (one of several, or a
    `MirroredStrategy`'s one) run here, in a thread that sees no contextvars?"""
    if BACKEND != "tensorflow":
        return False
    import tensorflow as tf

    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


def replicas_in_step() -> int:
    """How many replicas run the step being traced now (1 outside tf.distribute)."""
    context = _replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def replica_split(data) -> bool | None:
    """Inside a replica of a multi-replica `tf.distribute` step: did each replica
    get its own part of the batch (True: a tensor of the step's `data` differs
    across replicas, as in fit and evaluate) or every replica the whole batch
    (False: Keras's `*_on_batch` hand one batch to `strategy.run`)? None
    elsewhere. Decided while tracing; it adds nothing to the graph."""
    context = _replica_context()
    if context is None:
        return None
    leaf = next((v for v in keras.tree.flatten(data) if hasattr(v, "shape")), None)
    if leaf is None:
        return True
    import tensorflow as tf

    return context.merge_call(
        lambda strategy, value: isinstance(value, tf.distribute.DistributedValues),
        args=(leaf,))


def sum_replicas(value):
    """`value` summed over the replicas of the `tf.distribute` step running now."""
    import tensorflow as tf

    return _replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)


def agreed(value):
    """The first replica's `value`, and whether every replica's equals it (NaN
    equals NaN), the same two tensors in every replica of the `tf.distribute` step
    running now. The host raises if not (`_steps.pop_sown`): an assertion in the
    step would cancel the collective ops of the other replicas, for good."""
    import tensorflow as tf

    def first(strategy, value):
        parts = list(strategy.experimental_local_results(value))
        if len(parts) == 1:
            return parts[0], tf.constant(True)
        nan = tf.math.is_nan if parts[0].dtype.is_floating else tf.zeros_like
        same = [tf.reduce_all(tf.equal(parts[0], part)
                              | (tf.cast(nan(parts[0]), tf.bool) & tf.cast(nan(part), tf.bool)))
                for part in parts[1:]]
        return tf.identity(parts[0]), tf.reduce_all(tf.stack(same))

    return _replica_context().merge_call(first, args=(value,))


def first_replica_only(partials: dict) -> dict:
    """Statistics partials as the first replica's, and as no data (the partials of
    an empty tensor) in the others, so that the value they describe counts once."""
    import tensorflow as tf

    first = tf.equal(_replica_context().replica_id_in_sync_group, 0)
    empty = {"min": float("inf"), "max": -float("inf"), "absmax": -float("inf")}
    return {name: tf.where(first, part, tf.fill(tf.shape(part), tf.cast(empty.get(name, 0),
                                                                        part.dtype)))
            for name, part in partials.items()}


def gather_replicas(sown: dict, split: bool, unbatched=frozenset()) -> dict:
    """A replica's captured values as the whole step's, under `tf.distribute`.

    Keras averages a train or test step's outputs across replicas (`reduce_per_replica`
    with "auto": "mean" on MirroredStrategy), which would mix their rows. This hands
    the records to `ReplicaContext.merge_call`: in cross-replica context, each
    record's replica parts are concatenated along axis 0 in replica order, the global
    batch order (`split`; statistics partials get one row per replica, merged exactly
    on the host), or, where every replica ran the whole batch (not `split`), the
    first replica's are kept, as are the full records in `unbatched` (of values
    without a batch axis, `agreed`, and whether the replicas agreed on them). Every
    replica then returns that one tensor, which `regroup` leaves unwrapped and Keras
    passes through unreduced. Call it only in a multi-replica step.
    """
    import tensorflow as tf

    def whole(strategy, values):
        def join(value, first: bool):
            parts = list(strategy.experimental_local_results(value))
            if first:
                return parts[0]
            if len(parts) == 1:  # one tensor seen by every replica: each recorded it
                parts = parts * strategy.num_replicas_in_sync
            return tf.concat(parts, axis=0)

        return {key: {name: join(part, not split) for name, part in value.items()}
                if isinstance(value, dict) else join(value, not split or key in unbatched)
                for key, value in values.items()}

    return _replica_context().merge_call(whole, args=(sown,))


def place_like(array, like):
    """`array` as a fresh JAX buffer placed like `like` (same sharding): Keras
    donates a step's state, so each step gets its own."""
    import jax

    sharding = getattr(like, "sharding", None)
    return jax.device_put(array, sharding) if sharding is not None else jax.numpy.asarray(array)


def as_recorded(value, kind: str):
    """`value` as a step's record keeps it: what it is now, not at the step's end.

    Records are read when the step ends (`Collector.finalize`), after the
    optimizer's update. So a variable sown as it is is read at once (on TF, the
    read is ordered before the update). On torch, which updates variables in
    place, a tensor that may share a variable's memory is copied: a view of a
    `Parameter` (a slice, a broadcast), and, in a train step, a tensor with no
    autograd history (a variable itself, or one detached). Activations, which
    have a history in training and are views of no variable, are kept as they are:
    a later in-place op on one raises at the step's end (`version`). Under
    torch.compile, which can tell neither, every record is copied.
    """
    if isinstance(value, keras.Variable):
        value = value.value  # JAX, in a step: the step's state
    if BACKEND == "tensorflow":  # a keras Variable's `.value` is a tf.Variable
        import tensorflow as tf

        return tf.identity(value) if isinstance(value, tf.Variable) else value
    if BACKEND != "torch":
        return value
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    if torch.compiler.is_compiling():
        # `_base`, `grad_fn` and `_version` do not trace (the step recompiles per
        # layer). A view of a weight leaves the compiled train step as the updated
        # weight, and a value changed in place later in the step (`x += 1`) as the
        # changed value (checked, torch 2.13.0): copy every record there (in the
        # graph, where the copy can fuse with the op that makes the value).
        return value.clone()
    base = value._base if value._base is not None else value
    if isinstance(base, torch.nn.Parameter) or (kind == "train" and value.grad_fn is None):
        return value.clone()
    return value


def version(value) -> int | None:
    """torch, eager: `value`'s in-place version counter, read when it is recorded,
    so that the step can tell at its end whether a later op changed it in place
    (`x += 1`): its record would then show the changed values. None where there
    is none: other backends' arrays never change, an inference-mode tensor keeps
    no counter, and under torch.compile it does not trace."""
    if BACKEND != "torch":
        return None
    import torch

    if torch.compiler.is_compiling() or not isinstance(value, torch.Tensor) \
            or value.is_inference():
        return None
    return value._version


def trace_marker():
    """What identifies where Python runs now: a layer whose `call` starts under
    another marker than its caller's runs inside a loop body, a branch or another
    nested transformation, whose values cannot leave it. It is the depth of
    `keras.ops` loops and branches (`_keras_compat.mark_loops`), with, on JAX,
    the current trace (jax 0.10.2: `jax._src.core.trace_ctx`, the only way to ask;
    it catches `jax.lax` loops and transforms in user code), on TF, the
    default graph (a `tf.while_loop` body is a graph of its own) and whether
    gradient recording is stopped (`tf.recompute_grad`'s body: a gradient of a
    value made there reads 0), and on torch, the level of `torch.func`
    transforms (`torch.vmap`'s values cannot leave it: torch's own error). RNN
    layers are known by type."""
    from callscope import _keras_compat

    depth = _keras_compat.loop_depth()
    if BACKEND == "jax":
        from jax._src import core

        return depth, getattr(getattr(core, "trace_ctx", None), "trace", None)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        return depth, graph, _keras_compat.tf_recording_stopped()
    return depth, _keras_compat.torch_transform_level()


def marks_loop(marker) -> bool:
    """Does `trace_marker()`'s `marker` say Python runs inside a `keras.ops` loop,
    branch or checkpoint, or (TF) with gradient recording stopped?"""
    return marker[0] > 0 or (BACKEND == "tensorflow" and marker[2])


def check_same_shape(out, value, message: str):
    """`out` if it has `value`'s structure and shape; else a ValueError (`message`
    takes `{got}` and `{want}`). Where TF does not know a dimension while tracing,
    the check runs in the graph."""
    outs, wants = keras.tree.flatten(out), keras.tree.flatten(value)
    got = [tuple(getattr(o, "shape", ())) for o in outs]
    want = [tuple(getattr(w, "shape", ())) for w in wants]
    shown = (lambda s: s[0] if len(s) == 1 else s)
    if len(got) != len(want) or any(
        len(g) != len(w) or any(a is not None and b is not None and a != b
                                for a, b in zip(g, w)) for g, w in zip(got, want)):
        raise ValueError(message.format(got=shown(got), want=shown(want)))
    if BACKEND == "tensorflow" and any(None in g or None in w for g, w in zip(got, want)):
        import tensorflow as tf

        checked = []
        for o, w, g, s in zip(outs, wants, got, want):
            if None in g or None in s:
                check = tf.debugging.assert_equal(
                    tf.shape(o), tf.shape(w), summarize=len(g) + 1,
                    message=_IN_GRAPH + message.format(got=_GOT, want=_WANT))
                # XLA drops the assert (and without XLA an op after the patch may
                # fail first): a `where` over the value's shape, which takes each
                # element of the patch as it is, fails on a patch of another shape.
                # (Not a reshape or broadcast: TF infers their static shape from the
                # patch's, and Grappler drops them as no-ops.)
                name = f"callscope_shape_check_{next(_CHECK_NUMBERS)}"
                _SHAPE_CHECKS[name] = message
                with tf.control_dependencies([check] if check is not None else []):
                    o = tf.where(tf.ones_like(w, dtype="bool"), o, o, name=name)
            checked.append(o)
        out = keras.tree.pack_sequence_as(out, checked)
    return out


# A shape check in a TF graph fails as an InvalidArgumentError when the step runs;
# `graph_checks_raised` gives it as the ValueError that the other backends raise.
_IN_GRAPH, _GOT, _WANT = "[callscope] ", "(the first shape below)", "(the second)"
# A check's node name -> its message (XLA): one per patched point per TF trace.
_SHAPE_CHECKS: dict[str, str] = {}
_CHECK_NUMBERS = itertools.count()


@contextlib.contextmanager
def graph_checks_raised():
    """TF: a failed `check_same_shape` inside a compiled step, raised as the
    ValueError it is (with the shapes), not as TF's `InvalidArgumentError`."""
    import tensorflow as tf

    try:
        yield
    except tf.errors.InvalidArgumentError as error:
        text = getattr(error, "message", str(error))
        start = text.find(_IN_GRAPH)
        if start < 0:
            node = re.search(r"\{\{node (?:[^}]*/)?(callscope_shape_check_\d+)\}\}", text)
            shapes = re.search(r"Incompatible shapes: \[([\d,]*)\] vs\. \[([\d,]*)\]", text)
            if node is None or node.group(1) not in _SHAPE_CHECKS or shapes is None:
                raise
            got, want = (str(tuple(int(n) for n in s.split(",") if n)) for s in shapes.groups())
            raise ValueError(_SHAPE_CHECKS[node.group(1)].format(got=got, want=want)) from None
        message = text[start + len(_IN_GRAPH):].split("] [Condition", 1)[0]
        message = message.replace("\\'", "'")  # (TF's printing escapes quotes)
        shapes = re.findall(r"\[x \(.*?\) = \] \[([\d ]*)\] \[y \(.*?\) = \] "
                            r"\[([\d ]*)\]", text)
        if shapes:
            got, want = (str(tuple(int(n) for n in s.split())) for s in shapes[0])
            message = message.replace(_GOT, got).replace(_WANT, want)
        # (TF's own error, with the shapes as it printed them, where they were not read)
        raise ValueError(message) from (None if shapes else error)


@contextlib.contextmanager
def same_random_numbers():
    """What runs inside draws the random numbers that the code after it will draw
    again: torch's global generator (an unseeded Dropout on torch draws from it)
    is put back afterwards. JAX and TF draw from Keras seed states, which a
    `keras.StatelessScope` never advances."""
    if BACKEND != "torch":
        yield
        return
    import torch

    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


# --------------------------------------------------------------------------
# Several JAX processes (`jax.distributed.initialize`): arrays that span them
# --------------------------------------------------------------------------
_processes: tuple[int, int] | None = None


def process_index() -> tuple[int, int]:
    """`(this process, processes)` of a multi-process JAX job; `(0, 1)` elsewhere.

    Read once: asking initialises JAX's backends, after which
    `jax.distributed.initialize` refuses to run, so the answer never changes (and
    it is asked at every step)."""
    global _processes
    if BACKEND != "jax":
        return 0, 1
    if _processes is None:
        import jax

        _processes = (jax.process_index(), jax.process_count())
    return _processes


def layout(value) -> str | None:
    """"sparse" for a TF `SparseTensor` or a JAX sparse array (BCOO), "ragged" for
    a TF `RaggedTensor`; None for a dense value (torch has neither)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return ("sparse" if isinstance(value, tf.SparseTensor)
                else "ragged" if isinstance(value, tf.RaggedTensor) else None)
    if BACKEND == "jax":
        from jax.experimental import sparse

        return "sparse" if isinstance(value, sparse.JAXSparse) else None
    return None


def spans_processes(value) -> bool:
    """True for a JAX global array that has shards on another process: no process
    can read it whole (`np.asarray` raises)."""
    return BACKEND == "jax" and getattr(value, "is_fully_addressable", True) is False


def gathered(value):
    """The whole of `value` on this host, a collective for an array that spans
    processes: every process must call it, in the same order (each step's values
    reach the sinks in the same order on every process of an SPMD program)."""
    if not spans_processes(value):
        return value
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def local_blocks(value):
    """`(start, block)` for each shard of `value` this process holds, one copy of
    each across every process (replica 0), with `start` its global corner."""
    for shard in value.addressable_shards:
        if shard.replica_id == 0:
            start = [s.indices(n)[0] for s, n in zip(shard.index, value.shape)]
            yield start, np.asarray(shard.data)


def barrier(name: str) -> None:
    """Waits until every process of a multi-process JAX job gets here."""
    if process_index()[1] > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# --------------------------------------------------------------------------
# Captured values on their way to the host (`_sinks.Landing`)
# --------------------------------------------------------------------------
def start_host_copy(leaves: list) -> list:
    """Starts each leaf's copy to the host without waiting; `to_host` finishes it.

    JAX: `copy_to_host_async`. torch on CUDA: a `non_blocking` copy (into pinned
    memory) and an event to wait on. TF, and torch on the CPU, have nothing to
    start: their values are read as they are."""
    if BACKEND == "jax":
        if not _jax_on_host():
            for leaf in leaves:
                if getattr(leaf, "is_fully_addressable", False) and hasattr(
                        leaf, "copy_to_host_async"):
                    leaf.copy_to_host_async()
        return list(leaves)
    if BACKEND == "torch":
        import torch

        handles = []
        for leaf in leaves:
            leaf = leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
            if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                host = leaf.to("cpu", non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                leaf = (host, event)
            handles.append(leaf)
        return handles
    return list(leaves)


@functools.cache
def _jax_on_host() -> bool:
    """True where JAX's devices are the CPU: its arrays are host memory, which
    numpy reads without a copy (`copy_to_host_async` and `device_get` would only
    add a few microseconds per array, every step)."""
    import jax

    return all(device.platform == "cpu" for device in jax.devices())


def is_ready(handles: list) -> bool:
    """True where the device is done with every handle's value (JAX's `is_ready`,
    a torch CUDA copy's event), so that `to_host` waits for a copy at most. A
    handle that cannot tell (TF) counts as not ready."""
    for handle in handles:
        if isinstance(handle, tuple):  # torch on CUDA: (pinned host tensor, event)
            ready = handle[1].query()
        elif isinstance(handle, np.ndarray):
            ready = True
        else:
            is_ready = getattr(handle, "is_ready", None)
            ready = is_ready is not None and is_ready()
        if not ready:
            return False
    return True


def to_host(handles: list) -> list:
    """The host arrays of `start_host_copy`'s handles (waits for the copies). On
    JAX, one `device_get` for all of them; arrays that span processes are left as
    they are (no process can read them whole)."""
    if BACKEND == "jax":
        if _jax_on_host():  # the arrays are host memory: read in place, no copy
            return [h if spans_processes(h) else np.asarray(h) for h in handles]
        import jax

        local = [h for h in handles if not spans_processes(h)]
        got = iter(jax.device_get(local))
        return [h if spans_processes(h) else np.asarray(next(got)) for h in handles]
    out = []
    for handle in handles:
        if isinstance(handle, tuple):  # torch on CUDA: (pinned host tensor, event)
            handle[1].synchronize()
            handle = handle[0]
        out.append(handle if isinstance(handle, np.ndarray) else _host_array(handle))
    return out


def _host_array(value) -> np.ndarray:
    """`value` on the host. A torch or TF tensor in host memory is read in place,
    without a copy (Keras's `convert_to_numpy` copies it: one more pass over every
    captured byte, a tenth of a full capture's predict on torch). Such a view is
    only ever copied at once (`HostBuffer.append`), or through `owned`."""
    device = getattr(value, "device", None)
    if BACKEND == "torch" and device is not None and device.type == "cpu":
        try:
            return value.numpy()
        except (TypeError, RuntimeError):  # bfloat16, or a conj/neg bit: converted
            pass
    if BACKEND == "tensorflow" and isinstance(device, str) and "CPU" in device.upper() \
            and hasattr(value, "__array__"):  # an eager dense tensor
        return np.asarray(value)
    return np.asarray(keras.ops.convert_to_numpy(value))


def owned(array: np.ndarray) -> np.ndarray:
    """`array` as something kept for later may hold (a streamed batch, which the
    writer thread writes steps after): a copy where it views a torch or TF tensor,
    whose memory a later step may change in place (a torch layer that refills one
    buffer at each call). JAX arrays never change."""
    return array if BACKEND == "jax" or array.flags.owndata else np.array(array)


_THREADED_COPY = 2**18  # bytes from which torch's threaded copy beats numpy's


def copy_rows(into: np.ndarray, rows: np.ndarray) -> None:
    """`into[...] = rows`. On torch, a large plain block goes through torch's own
    copy, which uses its intra-op threads where numpy's uses one: a full capture's
    4 MiB step landed in 265 us instead of 404 on 2 cores, most of a capture's
    cost on a CPU. Anything else (a cast, bfloat16, a read-only view) is numpy's."""
    if (BACKEND == "torch" and rows.nbytes >= _THREADED_COPY and rows.dtype == into.dtype
            and rows.shape == into.shape and rows.dtype.kind in "biufc" and rows.dtype.isnative
            and rows.flags.writeable and min(rows.strides) >= 0):
        import torch

        torch.from_numpy(into).copy_(torch.from_numpy(rows))
        return
    into[...] = rows


def copy_lags(leaves: list) -> bool:
    """True where reading a step's values at once would wait for the device: they
    then land later (`_sinks.Landing`), so the device runs ahead (JAX's dispatch is always
    asynchronous; TF and torch only off the CPU). Several JAX processes land at
    once: gathering is a collective that every process must make in step."""
    if BACKEND == "jax":
        return process_index()[1] == 1
    if BACKEND == "torch":
        return any(getattr(leaf, "is_cuda", False) for leaf in leaves)
    return any("CPU" not in getattr(leaf, "device", "CPU").upper() for leaf in leaves)
