"""Whether the replica step is compiled with XLA: --jit_compile=true|false, or auto, the engine's choice.

The choice depends on the hardware as much as on the model (dense, convolutional, a decoder over tokens) and the
precision, and it is made from measurements (bench/RESULTS.md, sections "XLA on a CPU (--jit_compile=auto)" and "XLA
on a GPU (--jit_compile=auto)", a part per rule): XLA fuses the elementwise ops around the matmuls and removes per-op
dispatch, but on a CPU it does not use the bfloat16 matrix units and its convolutions are slower than oneDNN's, and on
a GPU its compile of a large decoder in mixed precision takes minutes. `choose` holds every rule and takes its facts
as arguments, so each case can be checked without the hardware; `resolve` reads them from the running process.
"""

import dataclasses

import keras

# Instructions with which oneDNN multiplies bfloat16 matrices in hardware (Intel AMX tiles, AVX512_BF16 dot
# products), as /proc/cpuinfo names them.
BFLOAT16_UNITS = ("amx_bf16", "avx512_bf16")


# mixed_bfloat16 on a CPU with bfloat16 units: the smallest weight matrix (in weights) whose matmuls the units speed
# up more than XLA's fusion of everything around them does (measured: bench/RESULTS.md, "Small bfloat16 matmuls").
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
    decoder=False,
):
    """(compile, reason): whether to compile the replica step with XLA, and why, in words for the run's first line.

    `setting`: --jit_compile (auto, true or false; a given true or false is the answer). `device`: CPU, GPU or
    TPU. `cpu_flags`: the CPU's instruction sets (/proc/cpuinfo). `convolutions`: the model has convolution
    layers. `synchronizes`: the model or task synchronizes replicas inside its forward pass or loss (synchronized
    batch norm, gathered negatives) where XLA cannot, found when the first round failed to trace with it.
    `unsupported`: ops of the step XLA has no kernel for (a task's random gamma draws), found when the first step
    failed to compile. `remote`: the variables live on parameter servers. `largest_matrix`: the weights in the
    model's largest weight matrix (a dense or attention kernel). `decoder`: a model over token sequences (an
    embedding of tokens: a language model).
    """
    if device == "TPU":
        # TPUStrategy compiles each step (strategy.run) with XLA whatever the flag says; the engine's own compilation
        # of the step's halves would only nest inside it.
        return False, f"{'auto' if setting == 'auto' else 'flag'}: on a TPU every step is compiled with XLA anyway"
    if setting != "auto":  # --jit_compile=true with parameter servers is refused (engine/settings/checks.py)
        return setting == "true", "flag"
    refused = _cannot_compile(synchronizes, remote, unsupported)
    if refused:
        return False, f"auto: {refused}"
    if device == "GPU":
        return _on_gpu(precision, decoder)
    return _on_cpu(precision, cpu_flags, convolutions, largest_matrix, decoder)


def _on_gpu(precision, decoder):
    """choose() on a GPU. Each rule's measurements: bench/RESULTS.md, section "XLA on a GPU (--jit_compile=auto)"."""
    if decoder and precision != "float32":
        # XLA's compile of the 12-layer decoder in mixed_bfloat16 did not finish in 150 s on an H200 (measured:
        # "Decoders in mixed precision"); TensorFlow's own kernels run it at once.
        return False, f"auto: a decoder in {precision} on a GPU: XLA's compile of it takes minutes"
    # float32 decoders: XLA's step matched PyTorch's to 3% (measured: "Decoders in float32"), its compile paid once
    # (--compile_cache keeps it for a requeued job). Dense and convolutional models: fusing the elementwise ops
    # (loss scaling, the update, casts) around cuBLAS and cuDNN, the standard fast path (measured: "Dense layers").
    return True, f"auto: {precision} on a GPU: XLA fuses the elementwise ops around cuBLAS and cuDNN"


def _cannot_compile(synchronizes, remote, unsupported):
    """Why the engine does not compile the step whatever the model's speed would say; "" where nothing stops it."""
    if synchronizes:
        # With several replicas only the step's per-replica halves are compiled, and a cross-replica sum inside
        # the forward pass would sit inside one of them, where XLA cannot synchronize replicas.
        return "the model or task synchronizes replicas inside its forward pass, which XLA cannot"
    if remote:
        # An XLA program reads only variables on its own device; a parameter server's are on another task
        # ("Trying to access resource mlp/kernel/0 located in device /job:ps/...").
        return "the variables live on parameter servers, which an XLA program cannot read"
    if unsupported:
        return f"the step holds ops XLA cannot compile ({unsupported})"
    return ""


def _on_cpu(precision, cpu_flags, convolutions, largest_matrix, decoder=False):
    """choose() on a CPU, where XLA wins on dense layers but loses on convolutions and big bfloat16 matmuls.
    Each rule's measurements: bench/RESULTS.md, section "XLA on a CPU (--jit_compile=auto)"."""
    if convolutions:
        # XLA:CPU's convolutions are slower than oneDNN's (measured: "Convolutions").
        return False, "auto: convolutions on a CPU: oneDNN's beat XLA's"
    units = sorted(set(BFLOAT16_UNITS) & set(cpu_flags))
    if precision == "mixed_bfloat16" and units and largest_matrix < UNITS_MIN_WEIGHTS:
        # Matmuls this small gain less from the units than the step gains from XLA's fusion (measured: "Small
        # bfloat16 matmuls").
        return True, (
            f"auto: mixed_bfloat16 on a CPU with {units[0]}, but matmuls of at most {largest_matrix:,} weights, "
            "too small for the units: XLA fuses the step"
        )
    if precision == "mixed_bfloat16" and units:
        # XLA:CPU computes bfloat16 in float32; oneDNN uses the units (measured: "bfloat16 with the units"). A
        # CPU without the units falls through to the dense rule: its non-XLA bfloat16 kernels take a slow path.
        return False, f"auto: mixed_bfloat16 on a CPU with {units[0]}: oneDNN's bfloat16 matmuls beat XLA's"
    if decoder:
        # A decoder over tokens: XLA's step ran 1.13x and 1.26x the one without (measured: "Decoders").
        return True, f"auto: a {precision} decoder on a CPU: XLA fuses the step"
    # Dense layers: XLA's fusion ties or beats oneDNN's kernels (measured: "Dense layers").
    return True, f"auto: {precision} dense layers on a CPU: XLA fuses the step"


@dataclasses.dataclass
class Choice:
    """Whether a run's step compiles with XLA (`compile`) and why (`reason`, in words for the run's first line). The
    train program changes it when the step turns out unable to compile with XLA; the evaluation, which compiles where
    the step does, reads it until its first run."""

    compile: bool
    reason: str


def resolve(numerics, placement, models, synchronizes=False, unsupported=""):
    """choose() for this process: the run's config.numerics, its engine/cluster/distribute.py Placement (its device,
    parameter servers), this machine's CPU and the models' layers."""
    return choose(
        numerics.jit_compile,
        numerics.precision,
        placement.device,
        cpu_flags=cpu_flags(),
        convolutions=has_convolutions(models.values()),
        synchronizes=synchronizes,
        unsupported=unsupported,
        remote=placement.parameter_server,
        largest_matrix=largest_matrix(models.values()),
        decoder=is_decoder(models.values()),
    )


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


def _has_layer(models, types):
    """Whether any of the Keras models has a layer of `types` (a class or a tuple of them), at any depth."""
    return any(isinstance(layer, types) for model in models for layer in model._flatten_layers(include_self=False))


def has_convolutions(models):
    """Whether any of the Keras models has a convolution layer (Conv2D, its transposes, depthwise, separable),
    at any depth."""
    return _has_layer(models, _CONVOLUTIONS)


def is_decoder(models):
    """Whether any of the Keras models reads tokens through an embedding (a language model's decoder)."""
    return _has_layer(models, keras.layers.Embedding)


def largest_matrix(models):
    """The number of weights in the models' largest weight matrix (a kernel of two or more dimensions); 0 if none."""
    sizes = [v.shape.num_elements() for model in models for v in model.trainable_variables if len(v.shape) >= 2]
    return max(sizes, default=0)
