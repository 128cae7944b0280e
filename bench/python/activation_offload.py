# SPDX-License-Identifier: Apache-2.0
"""Activation offload against its anchors, in one run: the same trainer (a residual MLP trunk of
`--layers` blocks of width `--width`, each a pinned unit, and a head), the same batches, four ways
of treating the activations autograd saves:
  none          kept where autograd keeps them (the step time to beat, the memory to save)
  save_on_cpu   torch.autograd.graph.save_on_cpu(pin_memory=True on CUDA): synchronous copies
  torchtune     torchtune.training.OffloadActivations (CUDA streams), on CUDA where torchtune imports
  taskswap      Runtime.register_activations: blocks stashed on the runtime's copy streams and
                brought back in the plan's order
Printed per arm: the step time (median of --repeats runs of --steps steps) and its ratio to none
and to save_on_cpu; on CUDA also the peak device memory (torch allocator's peak plus the runtime's)
and, with --largest, the largest batch that fits the device.

--model llama trains a Llama-style causal language model instead (transformers' LlamaForCausalLM
from a config, random weights, no download): `--layers` decoder layers of width `--width`, each a
pinned unit, sequences of `--seq` tokens, `--rows` sequences a batch; at long sequences its
activations outgrow its parameters many times over.

usage: python3 activation_offload.py [--model mlp|llama] [--width 1024] [--layers 16] [--rows 4096]
       [--seq 2048] [--dtype float32|bfloat16] [--steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import taskswap
import taskswap.torch as tt

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Trunk(torch.nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                torch.nn.Linear(4 * width, width)) for _ in range(layers))
        self.head = torch.nn.Linear(width, 8)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def mlp(args, rows: int, dev: torch.device):
    """The residual MLP trunk: its units (each block, the head) and its loss on one batch."""
    model = Trunk(args.width, args.layers).to(dev, DTYPES[args.dtype])
    x = torch.randn(rows, args.width, device=dev, dtype=DTYPES[args.dtype])
    y = torch.randn(rows, 8, device=dev, dtype=DTYPES[args.dtype])
    parts = [(f"trunk/{i}", layer) for i, layer in enumerate(model.layers)] + [("head", model.head)]
    return model, parts, lambda: torch.nn.functional.mse_loss(model(x), y)


def llama(args, rows: int, dev: torch.device):
    """A Llama-style causal LM from a config, made on the device in its dtype (the rotary
    frequencies in f32): its units (each decoder layer, the embedding, the final norm, the output
    head: every parameter once) and its next-token loss on one batch of random tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = args.heads or max(1, args.width // 128)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width,
                         intermediate_size=-(-args.width * 8 // 3 // 256) * 256,  # Llama's multiple of 256
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    tokens = torch.randint(0, args.vocab, (rows, args.seq), device=dev)
    inner = model.model
    parts = [(f"trunk/{i}", layer) for i, layer in enumerate(inner.layers)]
    parts += [("embed", inner.embed_tokens), ("norm", inner.norm), ("head", model.lm_head)]
    assert {id(p) for _, m in parts for p in m.parameters()} == {id(p) for p in model.parameters()}
    return model, parts, lambda: model(input_ids=tokens, labels=tokens).loss


def arms() -> dict[str, object]:
    cuda = torch.cuda.is_available()
    out = {"none": contextlib.nullcontext, "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda)}
    if not cuda:  # its hooks copy on CUDA streams
        print("torchtune: not run (OffloadActivations needs CUDA)")
    else:
        try:
            from torchtune.training import OffloadActivations
            out["torchtune"] = OffloadActivations
        except Exception as e:  # noqa: BLE001 - reported, the other arms run
            print(f"torchtune: not run ({type(e).__name__}: {e})")
    out["taskswap"] = contextlib.nullcontext
    return out


def run(arm: str, hooks, args, rows: int, device: str) -> tuple[float, int]:
    """Seconds per step (median) and the peak device bytes (0 off CUDA) of one arm at `rows`."""
    dev = torch.device("cuda" if device == "cuda" else "cpu")
    torch.manual_seed(0)
    model, parts, loss = (llama if args.model == "llama" else mlp)(args, rows, dev)
    # The default budget: the MLP's 16 layers pinned take 2.0 GiB; a Llama's pinned units, at most 16
    # bytes a parameter with their AdamW state, and 2 GiB.
    budget = args.budget or ("3 GiB" if args.model == "mlp" else
                             f"{(sum(p.numel() for p in model.parameters()) * 16 >> 30) + 2} GiB")
    rt = tt.Runtime(options=taskswap.parse_config(f"""
[device]
backend = "{device}"
budget = "{budget}"
[defaults]
residency = "pinned"
""", "bench"))
    units = [rt.register(module, name) for name, module in parts]
    if arm == "taskswap":
        rt.register_activations(args.host_gib << 30, block_bytes=args.block_mib << 20, min_bytes=1 << 16)
    times = []
    peak = 0
    try:
        for r in range(args.repeats + 1):
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(args.steps):
                rt.plan([units])
                with hooks(), rt.step(*units):
                    loss().backward()
            if device == "cuda":  # torch's peak and the runtime's: their sum bounds the device's
                torch.cuda.synchronize()
                peak = max(peak, torch.cuda.max_memory_allocated() + rt.stats().total.peak_device_bytes)
            if r:  # the first run warms up (and teaches the plan where the blocks go)
                times.append((time.perf_counter() - start) / args.steps)
    finally:
        rt.close()
        if device == "cuda" and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # save_on_cpu's pinned blocks, cached by torch: not the next arm's
    return (statistics.median(times) if times else float("nan")), peak


def largest(arm: str, hooks, args, device: str) -> int:
    """The largest batch (rows, a multiple of 256; llama: sequences) whose step fits the device."""
    once = argparse.Namespace(**{**vars(args), "steps": 1, "repeats": 0})
    unit = 1 if args.model == "llama" else 256

    def fits(rows: int) -> bool:
        try:
            run(arm, hooks, once, rows, device)
            return True
        except (torch.OutOfMemoryError, taskswap.OutOfMemory):
            return False
        finally:
            torch.cuda.empty_cache()

    lo, hi = 0, unit
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > unit:
        mid = (lo + hi) // (2 * unit) * unit
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["mlp", "llama"], default="mlp")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=2048, help="llama: tokens a sequence")
    ap.add_argument("--heads", type=int, default=0, help="llama: attention heads (0: width / 128)")
    ap.add_argument("--vocab", type=int, default=32000, help="llama: the vocabulary")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rows", type=int, nargs="+", help="the batches: rows (llama: sequences); default 4096 (2)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", help="the device budget (default: 3 GiB; llama: its pinned units' bytes and 2 GiB)")
    ap.add_argument("--host-gib", type=int, default=8)
    ap.add_argument("--block-mib", type=int, default=8)
    ap.add_argument("--largest", action="store_true", help="CUDA: the largest batch of each arm")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "emulated")
    args = ap.parse_args()
    args.rows = args.rows or ([2] if args.model == "llama" else [4096])
    if args.device != "cuda":
        torch.set_num_threads(1)
    ways = arms()
    shape = f", sequence {args.seq}" if args.model == "llama" else ""
    print(f"device {args.device}, {args.model}, width {args.width}, layers {args.layers}{shape}, {args.dtype}, "
          f"steps {args.steps} x {args.repeats}")
    print(f"{'rows':>6} {'arm':>12} {'ms/step':>9} {'/none':>7} {'/save_on_cpu':>13} {'peak MiB':>9}")
    for rows in args.rows:
        measured = {arm: run(arm, hooks, args, rows, args.device) for arm, hooks in ways.items()}
        for arm, (t, peak) in measured.items():
            print(f"{rows:>6} {arm:>12} {t * 1e3:>9.2f} {t / measured['none'][0]:>7.3f} "
                  f"{t / measured['save_on_cpu'][0]:>13.3f} {peak / 2**20 if peak else float('nan'):>9.0f}")
    if args.largest and args.device == "cuda":
        what = "sequences" if args.model == "llama" else "rows"
        for arm, hooks in ways.items():
            print(f"largest batch {arm}: {largest(arm, hooks, args, args.device)} {what}")


if __name__ == "__main__":
    main()
