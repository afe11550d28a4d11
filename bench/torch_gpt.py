"""The engine's GPT recipe written in PyTorch, as a researcher would write it (nanoGPT's way: nn.Linear,
scaled_dot_product_attention, torch.optim.AdamW in two groups, clip_grad_norm_, autocast for bfloat16 and float16,
GradScaler for float16).

Runs in its own virtual environment (PyTorch is not a requirement of the engine): bench/pytorch.py sets it up,
writes what both sides share into a folder, and starts this file there:

    .venv-torch/bin/python bench/torch_gpt.py --data=DIR [--precision=bfloat16] [--device=cuda]

On a GPU (--device=auto takes one when PyTorch sees it) the model, the batches and the evaluation windows live on
the device, AdamW is the fused kernel, float32 matmuls run in TF32 (TensorFlow's default there, so both sides do
the same arithmetic), and the loop never waits for the device: each step's time is read from CUDA events after the
last step, and the losses stay on the device until then. float16 scales the loss (torch.amp.GradScaler, starting at
the engine's initial loss scale and doubling after as many finite steps); a step whose gradients are not finite
changes nothing and counts as skipped.

DIR holds `recipe.json` (the run's sizes and optimizer settings, from the engine's Config), `weights.npz` (the
engine's initial weights, Keras layout), `batches.npy` (every training batch the engine reads, in its order) and
`eval_tokens.npy` / `eval_weights.npy` (the engine's evaluation windows and how many of each one's targets are
real). So both sides start from the same weights, read the same batches and are scored on the same characters.
Prints one JSON line: the loss of the first batch before any update, the last training loss, the validation
loss, the median and spread of the per-step times (the first STEADY_AFTER steps left out, a shorter run's first
half; null for a run of one step), the training and evaluation wall times, the device, the skipped steps and the
last loss scale (float16). Imports nothing of the engine.
"""

import argparse
import json
import math
import os
import statistics
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

# Steps left out of the per-step times: allocator and thread-pool warm-up. A shorter run leaves out its first half
# (its first step at least), as the engine's summary leaves out its first round.
STEADY_AFTER = 20
AUTOCAST = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --precision: autocast's dtype


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        self.mlp_in = nn.Linear(dim, 4 * dim)
        self.mlp_out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        batch, tokens, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, tokens, head_dim]
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, dim))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x))))  # exact gelu, as Keras's "gelu"


class GPT(nn.Module):
    def __init__(self, vocabulary, sequence_length, layers, heads, dim):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, dim)
        self.position = nn.Parameter(torch.zeros(sequence_length, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim, eps=1e-5)
        self.head = nn.Linear(dim, vocabulary)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).float()  # the logits in float32, as the engine's head computes them


def load_weights(model, weights):
    """The engine's initial weights, named by bench/pytorch.py as this model names its parameters. A Keras
    kernel is [in, out], an nn.Linear's weight [out, in]: those are transposed."""
    linear = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    params = dict(model.named_parameters())
    if set(params) != set(weights):
        raise ValueError(f"weights.npz and the model differ: {sorted(set(params) ^ set(weights))}")
    with torch.no_grad():
        for name, value in weights.items():
            tensor = torch.from_numpy(value).T if name in linear else torch.from_numpy(value)
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"{name}: the engine's is {tuple(tensor.shape)}, the model's {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)


def learning_rate(recipe, step):
    """The engine's schedule (engine/numerics/optim.py): linear warmup over warmup_steps, then cosine to 0 at
    train_steps."""
    lr = recipe["learning_rate"]
    if recipe["warmup_steps"]:
        lr *= min(1.0, (step + 1.0) / recipe["warmup_steps"])
    if recipe["lr_schedule"] == "cosine":
        progress = (step - recipe["warmup_steps"]) / (recipe["train_steps"] - recipe["warmup_steps"])
        lr *= 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return lr


def optimizer(model, recipe, fused):
    """AdamW with decoupled weight decay on the matrices (embeddings included), none on biases and norms: the
    engine's rule (len(shape) >= 2), nanoGPT's too. `fused`: one kernel for the whole update (on a GPU)."""
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": recipe["weight_decay"]}, {"params": others, "weight_decay": 0.0}]
    betas = (recipe["beta_1"], recipe["beta_2"])
    return torch.optim.AdamW(groups, lr=recipe["learning_rate"], betas=betas, eps=recipe["epsilon"], fused=fused)


def loss_of(model, tokens, dtype):
    with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype is not None):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class StepClock:
    """Each step's time without waiting for the device: on a GPU, CUDA events recorded between the steps and read
    after the last; on a CPU the step's ops have finished when it returns, and the host's clock is the step's."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self):
        """Seconds between consecutive marks; on a GPU this waits for the steps to end."""
        pairs = list(zip(self.marks, self.marks[1:]))
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) / 1000 for start, end in pairs]
        return [end - start for start, end in pairs]


def train(model, recipe, batches, dtype):
    """Every batch once, in order: (first loss before any update, last training loss, per-step seconds, skipped
    steps, the last loss scale or None)."""
    device = batches.device
    opt = optimizer(model, recipe, fused=device.type == "cuda")
    # float16 only; disabled, each of its calls below passes through (scale returns the loss, step calls opt.step).
    scaler = torch.amp.GradScaler(
        device.type,
        init_scale=recipe["initial_loss_scale"],
        growth_interval=recipe["loss_scale_growth_interval"],
        enabled=dtype == torch.float16,
    )
    with torch.no_grad():
        first = loss_of(model, batches[0], dtype)
    clock = StepClock(device)
    clock.mark()
    for step, tokens in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = learning_rate(recipe, step)
        loss = loss_of(model, tokens, dtype)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if recipe["clip_norm"]:
            scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(model.parameters(), recipe["clip_norm"])
        scaler.step(opt)  # skips the update (fused: masks it on the device) when a gradient is not finite
        scaler.update()
        clock.mark()
    # AdamW's count leaves out the updates GradScaler skipped: the fused kernel takes a skipped step's count back,
    # and elsewhere a skipped step never calls opt.step.
    skipped = len(batches) - int(opt.state[opt.param_groups[0]["params"][0]].get("step", 0))
    loss_scale = scaler.get_scale() if scaler.is_enabled() else None
    return first.item(), loss.item(), clock.seconds(), skipped, loss_scale


@torch.no_grad()
def evaluate(model, tokens, weights, batch_size, dtype):
    """Mean next-token cross-entropy over every real target: a window's first `weight` targets are real."""
    total = torch.zeros((), dtype=torch.float64, device=tokens.device)  # read once, after the last window
    count = torch.zeros((), dtype=torch.float64, device=tokens.device)
    for start in range(0, len(tokens), batch_size):
        window = tokens[start : start + batch_size]
        with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(window[:, :-1])
        losses = F.cross_entropy(logits.transpose(1, 2), window[:, 1:], reduction="none")
        real = torch.arange(losses.shape[1], device=tokens.device)[None, :] < weights[start : start + batch_size, None]
        total += (losses * real).sum()
        count += real.sum()
    return (total / count).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="the folder bench/pytorch.py wrote")
    parser.add_argument("--precision", choices=tuple(AUTOCAST), default="float32", help="autocast's dtype, if any")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if there")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 = PyTorch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # as TensorFlow's float32 matmuls on this GPU
    with open(os.path.join(args.data, "recipe.json")) as f:
        recipe = json.load(f)
    torch.manual_seed(recipe["seed"])
    model = GPT(recipe["vocabulary"], recipe["sequence_length"], recipe["layers"], recipe["heads"], recipe["dim"])
    load_weights(model, dict(np.load(os.path.join(args.data, "weights.npz"))))
    model.to(device)
    batches = torch.from_numpy(np.load(os.path.join(args.data, "batches.npy")).astype(np.int64)).to(device)
    dtype = AUTOCAST[args.precision]
    start = time.perf_counter()
    model.train()
    first, last, times, skipped, loss_scale = train(model, recipe, batches, dtype)
    train_seconds = time.perf_counter() - start
    model.eval()
    start = time.perf_counter()
    eval_tokens = torch.from_numpy(np.load(os.path.join(args.data, "eval_tokens.npy")).astype(np.int64)).to(device)
    eval_weights = torch.from_numpy(np.load(os.path.join(args.data, "eval_weights.npy"))).to(device)
    validation = evaluate(model, eval_tokens, eval_weights, recipe["eval_batch_size"], dtype)
    steady = times[min(STEADY_AFTER, max(1, len(times) // 2)) :]
    result = dict(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        threads=torch.get_num_threads(),
        precision=args.precision,
        first_loss=first,
        train_loss=last,
        validation_loss=validation,
        step_ms=1000 * statistics.median(steady) if steady else None,
        step_ms_quartiles=[1000 * q for q in statistics.quantiles(steady, n=4)[::2]] if len(steady) > 1 else [],
        skipped_steps=skipped,
        loss_scale=loss_scale,
        train_seconds=train_seconds,
        eval_seconds=time.perf_counter() - start,
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
