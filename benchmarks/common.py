"""Shared benchmark helpers: GPT-shaped model + AdamW state, memory warming, timing, tables."""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
from contextlib import contextmanager

import torch


def gpt_shapes(n_params: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter shapes of a GPT-2-like model with about ``n_params`` parameters."""
    d, ctx = 768, 1024
    per_layer = 12 * d * d + 13 * d
    layers = max(1, min(12, round(n_params * 0.7 / per_layer)))
    vocab = max(1000, (n_params - layers * per_layer - ctx * d) // d)
    shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for i in range(layers):
        p = f"h.{i}."
        shapes += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                   (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
                   (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                   (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                   (p + "mlp.c_fc.weight", (d, 4 * d)), (p + "mlp.c_fc.bias", (4 * d,)),
                   (p + "mlp.c_proj.weight", (4 * d, d)), (p + "mlp.c_proj.bias", (d,))]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def model_adamw_state(n_params: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """``{"model": ..., "optim": ...}`` shaped like model.state_dict() + AdamW.state_dict(),
    weights and moments in ``dtype`` (AdamW keeps its moments in the parameters' dtype)."""
    g = torch.Generator().manual_seed(seed)
    model, opt_state = {}, {}
    for i, (name, shape) in enumerate(gpt_shapes(n_params)):
        w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        model[name] = w
        opt_state[i] = {"step": torch.tensor(1000.0), "exp_avg": (torch.randn(shape, generator=g) * 1e-3).to(dtype),
                        "exp_avg_sq": (torch.rand(shape, generator=g) * 1e-6).to(dtype)}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
               "fused": None, "params": list(opt_state)}]
    return {"model": model, "optim": {"state": opt_state, "param_groups": groups}}


def tensors_of(state) -> list[torch.Tensor]:
    out = []
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        for v in state.values():
            out += tensors_of(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            out += tensors_of(v)
    return out


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def warm_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory, untimed: the VM hands freed memory back to the
    host within seconds and re-touching it is ~10x slower. Without this a benchmark
    measures that artefact instead of the code."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)
    del buf
    gc.collect()


from tieredckpt._format.atomic import fsync_file as fsync_path  # noqa: E402


def fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(root, f))
        fsync_path(root)


@contextmanager
def timer(out: list):
    start = time.perf_counter()
    yield
    out.append(time.perf_counter() - start)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def median(xs):
    return statistics.median(xs)


def table(rows: list[tuple], headers: tuple) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*map(str, r)) for r in [headers, *rows])
