"""Whether the replica step is compiled with XLA: --jit_compile=true|false, or auto, the engine's choice.

The choice depends on the hardware as much as on the model, and it is made from measurements, each written
beside its rule: XLA fuses the elementwise ops around the matmuls and removes per-op dispatch, but on a CPU
it does not use the bfloat16 matrix units and its convolutions are slower than oneDNN's. `choose` holds every
rule and takes its facts as arguments, so each case can be checked without the hardware; `resolve` reads them
from the running process.
"""

import keras
import tensorflow as tf

from engine import distribute

# Instructions with which oneDNN multiplies bfloat16 matrices in hardware (Intel AMX tiles, AVX512_BF16 dot
# products), as /proc/cpuinfo names them.
BFLOAT16_UNITS = ("amx_bf16", "avx512_bf16")


# mixed_bfloat16 on a CPU with bfloat16 units: the smallest weight matrix (in weights) whose matmuls the units speed
# up more than XLA's fusion of everything around them does.
UNITS_MIN_WEIGHTS = 256 * 256


def choose(
    setting,
    precision,
    device,
    cpu_flags=(),
    convolutions=False,
    synchronizes=False,
    unsupported="",
    remote=False,
    largest_matrix=float("inf"),
):
    """(compile, reason): whether to compile the replica step with XLA, and why, in words for the run's first line.

    `setting`: --jit_compile (auto, true or false; a given true or false is the answer). `device`: CPU, GPU or
    TPU. `cpu_flags`: the CPU's instruction sets (/proc/cpuinfo). `convolutions`: the model has convolution
    layers. `synchronizes`: the model or task synchronizes replicas inside its forward pass or loss (synchronized
    batch norm, gathered negatives) where XLA cannot, found when the first round failed to trace with it.
    `unsupported`: ops of the step XLA has no kernel for (a task's random gamma draws), found when the first step
    failed to compile. `remote`: the variables live on parameter servers. `largest_matrix`: the weights in the
    model's largest weight matrix (a dense or attention kernel).
    """
    if setting != "auto":
        return setting == "true", "flag"
    if device == "TPU":
        # TPUStrategy hands the whole round to XLA whatever the flag says; the engine's own compilation of the
        # step's halves would only nest inside it.
        return False, "auto: on a TPU every round is compiled with XLA anyway"
    if synchronizes:
        # With several replicas only the step's per-replica halves are compiled, and a cross-replica sum inside
        # the forward pass would sit inside one of them, where XLA cannot synchronize replicas.
        return False, "auto: the model or task synchronizes replicas inside its forward pass, which XLA cannot"
    if remote:
        # An XLA program reads only variables on its own device; a parameter server's are on another task
        # ("Trying to access resource mlp/kernel/0 located in device /job:ps/...").
        return False, "auto: the variables live on parameter servers, which an XLA program cannot read"
    if unsupported:
        return False, f"auto: the step holds ops XLA cannot compile ({unsupported})"
    if device == "GPU":
        # Every precision: fusing the elementwise ops (loss scaling, the update, casts) around cuBLAS and cuDNN
        # is the standard fast path, mixed_float16 with XLA above all.
        return True, f"auto: {precision} on a GPU: XLA fuses the elementwise ops around cuBLAS and cuDNN"
    if convolutions:
        # ResNet-20, batch 128, 32x32x3, float32: on the AMD EPYC of bench/RESULTS.md the engine's fastest step
        # was the non-XLA one in every run, and a step ran about 2x slower with XLA; on the Xeon with AMX
        # (2 cores, load 1.6), launch.py's summary: 394 and 394 examples/s without XLA, 268 and 269 with (0.68x).
        return False, "auto: convolutions on a CPU: oneDNN's beat XLA's"
    units = sorted(set(BFLOAT16_UNITS) & set(cpu_flags))
    if precision == "mixed_bfloat16" and units and largest_matrix < UNITS_MIN_WEIGHTS:
        # Transformer 2x64 (largest kernel 64x128), batch 128, on the Xeon with AMX, launch.py's summary: 3,483 and
        # 3,612 examples/s with XLA against 2,948 and 2,847 without (1.24x); Keras fit alike, 3,331 with XLA and
        # 2,831 without. Its matmuls are too small for the units to outrun what XLA's fusion saves.
        return True, (
            f"auto: mixed_bfloat16 on a CPU with {units[0]}, but matmuls of at most {largest_matrix:,} weights, "
            "too small for the units: XLA fuses the step"
        )
    if precision == "mixed_bfloat16" and units:
        # The 1024-wide MLP, batch 256, on a Xeon with AMX (issue 14, quiet): float32 with XLA 101 steps/s,
        # mixed_bfloat16 with XLA 87-91 (XLA:CPU computes bfloat16 in float32), without it 165-178 (oneDNN uses
        # the units). Here, shared (load 2.7 to 3.9), launch.py's summary: 9,038 and 17,810 examples/s without
        # XLA, 7,328 and 5,596 with. A CPU without the units falls through to the rule below: on the AMD EPYC
        # the non-XLA bfloat16 kernels take a slow path (ResNet-20 at 0.14-0.17x float32, bench/RESULTS.md).
        # MLP 784-256-256-10 (largest kernel 200,704 weights), bench.end_to_end: 70,400 examples/s without XLA;
        # Keras fit 59,197 without, 51,350 with.
        return False, f"auto: mixed_bfloat16 on a CPU with {units[0]}: oneDNN's bfloat16 matmuls beat XLA's"
    # launch.py's summary examples/s on the Xeon with AMX (2 cores, shared: load average 1.8 to 3.6), runs with
    # and without XLA alternated. MLP 784-1024-1024-10, batch 256, float32: medians 10,421 with XLA against
    # 10,929 without over 7 runs each (best 17,526 against 13,118; the median of the 7 paired ratios 1.26x):
    # a tie within this machine's noise, and on the AMD EPYC the engine's fastest MLP steps were XLA's in every
    # bench run. Transformer 2x64, batch 128, float32: medians 2,744 with XLA against 2,124 without over 7 runs
    # each (1.29x; 3,989 against 2,998 in the 4 quietest pairs, 1.33x).
    return True, f"auto: {precision} dense layers on a CPU: XLA fuses the step"


def resolve(config, strategy, models, synchronizes=False, unsupported=""):
    """choose() for this process: its strategy's device, this machine's CPU and the models' layers."""
    return choose(
        config.jit_compile,
        config.precision,
        device_kind(strategy),
        cpu_flags=cpu_flags(),
        convolutions=has_convolutions(models.values()),
        synchronizes=synchronizes,
        unsupported=unsupported,
        remote=distribute.is_parameter_server(strategy),
        largest_matrix=largest_matrix(models.values()),
    )


def device_kind(strategy):
    """TPU, GPU or CPU: where the strategy's steps run (engine/distribute.py puts them on every GPU there is)."""
    if isinstance(strategy, tf.distribute.TPUStrategy):
        return "TPU"
    return "GPU" if tf.config.list_logical_devices("GPU") else "CPU"


def cpu_flags(path="/proc/cpuinfo"):
    """The instruction sets the CPU has, as Linux lists them; empty where it does not say (another OS)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


_CONVOLUTIONS = tuple(layer for name, layer in vars(keras.layers).items() if "Conv" in name and isinstance(layer, type))


def has_convolutions(models):
    """Whether any of the Keras models has a convolution layer (Conv2D, its transposes, depthwise, separable),
    at any depth."""
    return any(
        isinstance(layer, _CONVOLUTIONS) for model in models for layer in model._flatten_layers(include_self=False)
    )


def largest_matrix(models):
    """The number of weights in the models' largest weight matrix (a kernel of two or more dimensions); 0 if none."""
    sizes = [v.shape.num_elements() for model in models for v in model.trainable_variables if len(v.shape) >= 2]
    return max(sizes, default=0)
