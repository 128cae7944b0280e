#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A multi-task LoRA trainer on taskswap: a Llama-style model from transformers (built from a small
config, seeded, no downloads) with its base frozen, and one PEFT LoRA adapter per task. Each step
trains one task, drawn by a seeded sampler and planned ahead; the frozen base (a unit per decoder
layer, pinned) costs its parameters alone, and the adapters with their AdamW state are swapped in
and out of a device budget that holds a few of them.

    python3 samples/python/peft_multitask.py samples/configs/peft-emulated.toml
    python3 samples/python/peft_multitask.py samples/configs/peft-emulated.toml --all-resident
    python3 samples/python/peft_multitask.py samples/configs/peft-emulated.toml --reference torch
    python3 samples/python/peft_multitask.py samples/configs/peft-stream.toml   # a base 9x the budget
    python3 samples/python/peft_multitask.py samples/configs/peft-emulated.toml --tasks-per-step 8

``--tasks-per-step k`` trains k tasks in each step over one pass of the base: the step's batch is
the k tasks' batches, each routed through its own adapter (``adapters.step({adapter: rows})``),
and the loss is the sum of the tasks' mean losses, so each adapter's gradient is its own task's.

With ``[model] stream = true`` the base's decoder layers stream through the device within each
step (``taskswap.torch.peft.register(..., stream=True)``): a base larger than the device budget
trains; ``--all-resident`` then holds every layer instead (the baseline).
    mpirun -np 2 python3 samples/python/peft_multitask.py samples/configs/peft-emulated.toml --comm mpi

``--reference torch`` trains the same model with plain torch, peft and torch.optim.AdamW on the
CPU (``--adamw`` picks torch's for-loop, foreach or fused implementation): what the tests compare
taskswap with.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

import torch

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations, seen through peft

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import taskswap  # noqa: E402
import taskswap.torch as tt  # noqa: E402
import taskswap.torch.peft as tpeft  # noqa: E402

PLAN_AHEAD = 64  # steps planned at a time


class Int8Linear(torch.nn.Linear):
    """A frozen linear layer of int8 weights with a float scale per output row (weight-only
    quantization, as torchao's int8 weight-only does it), dequantized in forward. Its tensors
    are plain tensors (an int8 parameter, a scale buffer), so a taskswap unit holds and streams
    them; PEFT's LoRA wraps it as it wraps nn.Linear."""

    def __init__(self, linear: torch.nn.Linear):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return torch.nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def quantize_int8(layers: torch.nn.Module) -> None:
    """Every nn.Linear inside ``layers`` becomes an Int8Linear, in place."""
    for module in list(layers.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, Int8Linear(child))


def build_model(m: dict, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The base model and its task adapters, the same for every run with the same [model] table.
    ``[model] base_weights = "int8"``: the decoder layers' linear weights are int8 with a float scale."""
    torch.manual_seed(m["seed"])
    config = LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                         num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                         num_key_value_heads=m["kv_heads"], max_position_embeddings=2 * m["sequence"],
                         tie_word_embeddings=False, attn_implementation="eager")
    base = LlamaForCausalLM(config).to(dtype)
    weights = m.get("base_weights", "float")
    if weights not in ("float", "int8"):
        raise ValueError(f"[model] base_weights is \"float\" or \"int8\", not {weights!r}")
    if weights == "int8":
        quantize_int8(base.model.layers)
    lora = LoraConfig(r=m["rank"], lora_alpha=2 * m["rank"], target_modules=m["targets"], lora_dropout=0.0)
    model = get_peft_model(base, lora, adapter_name="task0")
    for t in range(1, m["tasks"]):
        model.add_adapter(f"task{t}", lora)
    return model


def task_answers(m: dict) -> torch.Tensor:
    """Each task's two answer tokens: the target of token x is answers[task][x % 2]."""
    g = torch.Generator().manual_seed(m["seed"] + 1)
    return torch.randint(0, m["vocab"], (m["tasks"], 2), generator=g)


def schedule(m: dict, steps: int, rank: int = 0) -> list[int]:
    """The task of every step, as a seeded sampler draws them (each rank its own)."""
    g = torch.Generator().manual_seed(1000 + 17 * rank + m["seed"])
    return torch.randint(0, m["tasks"], (steps,), generator=g).tolist()


def schedule_mixed(m: dict, steps: int, k: int, rank: int = 0) -> list[list[int]]:
    """The k distinct tasks of every step, as a seeded sampler draws them (each rank its own)."""
    g = torch.Generator().manual_seed(2000 + 17 * rank + m["seed"])
    return [torch.randperm(m["tasks"], generator=g)[:k].tolist() for _ in range(steps)]


def batch(m: dict, answers: torch.Tensor, task: int, step: int, rank: int = 0,
          part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch of `task` (`part`: its place among a mixed-task step's tasks)."""
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 13 + 1000003 * part)
    x = torch.randint(0, m["vocab"], (m["batch"], m["sequence"]), generator=g)
    return x, answers[task][x % 2]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def adapter_state(model: torch.nn.Module, tasks: int) -> dict[str, torch.Tensor]:
    """Every adapter's parameters, keyed as taskswap.torch.peft names them ("adapter/taskN.<name>")."""
    out = {}
    for name, p in model.named_parameters():
        for t in range(tasks):
            if f".task{t}." in name:
                out[f"adapter/task{t}.{name}"] = p.detach().clone()
    return out


def train_taskswap(m: dict, options: taskswap.Options, steps: int, all_resident: bool = False, comm=None,
                   log_every: int = 0, dtype: torch.dtype = torch.float32, checkpointing: str | None = None,
                   tasks_per_step: int = 1) -> dict:
    """``checkpointing``: None, "reentrant" or "non_reentrant": transformers' gradient checkpointing
    of the decoder layers (their forward runs again in backward). ``tasks_per_step`` > 1: mixed-task
    steps; the run's "schedule" and "losses" then list each task of each step with its loss."""
    cuda = options.device.backend == taskswap.Backend.cuda
    device = torch.device("cuda", options.device.index) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = build_model(m, dtype).to(device)  # what the runtime does not hold (none here) computes there too
    if checkpointing is not None:
        llama = model.base_model.model
        reentrant = checkpointing == "reentrant"
        llama.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if reentrant:  # the frozen embeddings' output must require grad for it
            llama.enable_input_require_grads()
    rt = tt.Runtime(options=options, comm=comm)
    pin = "pinned" if all_resident else None
    stream = bool(m.get("stream", False)) and not all_resident
    adapters = tpeft.register(rt, model, base="per_layer", base_residency=None if stream else "pinned",
                              residency=pin, stream=stream)
    if all_resident:  # the baseline: the budget every unit needs, each resident
        rt.options.device.budget = rt.all_pinned_budget()
    rt.start()
    rank = rt.rank
    if tasks_per_step > 1:
        return _train_mixed(m, rt, adapters, model, device, steps, tasks_per_step, log_every)
    sched, answers = schedule(m, steps, rank), task_answers(m)
    losses: list[float] = []
    t0 = time.perf_counter()
    for i, t in enumerate(sched):
        if i % PLAN_AHEAD == 0:  # the plan: the next steps' units, as the sampler drew them
            rt.plan([adapters.uses(f"task{u}") for u in sched[i:i + PLAN_AHEAD]])
        x, y = (v.to(device) for v in batch(m, answers, t, i, rank))
        with adapters.step(f"task{t}"):
            loss = loss_of(model, x, y)
            loss.backward()
        losses.append(loss.item())  # synchronises on CUDA: the per-step losses are what the tests compare
        if log_every and rank == 0 and (i + 1) % log_every == 0:
            s = rt.last_step
            print(f"step {i + 1:5d}  loss {sum(losses[-log_every:]) / log_every:.4f}  h2d {s.h2d_bytes / 1024:.0f} KiB"
                  f"  hits {s.hits} misses {s.misses}", flush=True)
    elapsed = time.perf_counter() - t0
    stats = rt.stats()
    state = rt.state_dict()
    layer_names = {b.name for b in adapters.base if b._layer is not None}  # the streamed base layers
    streamed = sum(u.device_bytes for u in stats.units if u.name in layer_names)
    out = {"schedule": sched, "losses": losses, "seconds": elapsed, "rank": rank, "world": rt.world_size,
           "stats": stats, "budget": stats.budget, "units": len(rt.units), "streamed_bytes": streamed,
           "state": {k: v for k, v in state.items() if k.startswith("adapter/")}}
    rt.close()  # the model gets its trained adapters back
    out["model_state"] = {k: v.cpu() for k, v in adapter_state(model, m["tasks"]).items()}
    return out


def _train_mixed(m: dict, rt: tt.Runtime, adapters: tpeft.Adapters, model: torch.nn.Module, device: torch.device,
                 steps: int, k: int, log_every: int) -> dict:
    """train_taskswap's loop with k tasks per step (mixed-task steps)."""
    sched, answers = schedule_mixed(m, steps, k, rt.rank), task_answers(m)
    rows = m["batch"]
    tasks_done: list[int] = []
    losses: list[float] = []
    t0 = time.perf_counter()
    for i, tasks in enumerate(sched):
        if i % PLAN_AHEAD == 0:
            rt.plan([adapters.uses([f"task{u}" for u in step]) for step in sched[i:i + PLAN_AHEAD]])
        parts = [batch(m, answers, t, i, rt.rank, part=j) for j, t in enumerate(tasks)]
        x = torch.cat([p[0] for p in parts]).to(device)
        y = torch.cat([p[1] for p in parts]).to(device)
        routing = {f"task{t}": range(j * rows, (j + 1) * rows) for j, t in enumerate(tasks)}
        with adapters.step(routing):
            logits = model(input_ids=x).logits.float()
            per_task = [torch.nn.functional.cross_entropy(logits[j * rows:(j + 1) * rows].reshape(-1, logits.shape[-1]),
                                                          y[j * rows:(j + 1) * rows].reshape(-1))
                        for j in range(len(tasks))]
            torch.stack(per_task).sum().backward()
        tasks_done += tasks
        losses += [v.item() for v in per_task]
        if log_every and rt.rank == 0 and (i + 1) % log_every == 0:
            print(f"step {i + 1:5d}  loss {sum(losses[-log_every * k:]) / (log_every * k):.4f}", flush=True)
    elapsed = time.perf_counter() - t0
    stats = rt.stats()
    state = rt.state_dict()
    out = {"schedule": tasks_done, "losses": losses, "seconds": elapsed, "rank": rt.rank, "world": rt.world_size,
           "stats": stats, "budget": stats.budget, "units": len(rt.units), "streamed_bytes": 0,
           "state": {key: v for key, v in state.items() if key.startswith("adapter/")}}
    rt.close()
    out["model_state"] = {key: v.cpu() for key, v in adapter_state(model, m["tasks"]).items()}
    return out


def fast_switch(model: torch.nn.Module):
    """An adapter switch that leaves requires_grad alone (for DDP, whose parameters are fixed when it
    wraps the model); the PEFT tuner layers' active adapter, as set_adapter sets it."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    layers = [mod for mod in model.modules() if isinstance(mod, BaseTunerLayer)]

    def switch(name: str) -> None:
        for layer in layers:
            layer._active_adapter = [name]
        model.base_model.active_adapter = name
    return switch


def train_torch(m: dict, opt: dict, steps: int, adamw: str = "foreach", rank: int = 0, wrap=None) -> dict:
    """Plain torch + peft + torch.optim.AdamW on the CPU: set_adapter, zero_grad, backward, step.
    With ``wrap`` (DDP), every adapter requires gradients and the switch leaves them so."""
    model = build_model(m)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    kinds = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[adamw]
    optimizer = torch.optim.AdamW(params, lr=opt["lr"], betas=tuple(opt.get("betas", (0.9, 0.999))),
                                  eps=opt.get("eps", 1e-8), weight_decay=opt.get("weight_decay", 0.01), **kinds)
    net, switch = model, model.set_adapter
    if wrap is not None:
        for p in params:
            p.requires_grad_(True)
        net, switch = wrap(model), fast_switch(model)
    sched, answers = schedule(m, steps, rank), task_answers(m)
    losses: list[float] = []
    t0 = time.perf_counter()
    for i, t in enumerate(sched):
        switch(f"task{t}")
        x, y = batch(m, answers, t, i, rank)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(net, x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"schedule": sched, "losses": losses, "seconds": time.perf_counter() - t0,
            "model_state": adapter_state(model, m["tasks"])}


def per_task(sched: list[int], losses: list[float]) -> tuple[dict[int, float], dict[int, float]]:
    """Each task's mean loss over its first two and its last two steps, for the tasks trained at
    least four times (one batch is too noisy a measure)."""
    seen: dict[int, list[float]] = {}
    for t, loss in zip(sched, losses):
        seen.setdefault(t, []).append(loss)
    first = {t: sum(v[:2]) / 2 for t, v in seen.items() if len(v) >= 4}
    last = {t: sum(v[-2:]) / 2 for t, v in seen.items() if len(v) >= 4}
    return first, last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a taskswap configuration with a [model] table (samples/configs/peft-*.toml)")
    ap.add_argument("--steps", type=int, help="override [model] steps")
    ap.add_argument("--all-resident", action="store_true", help="every unit pinned, budget = their bytes (baseline)")
    ap.add_argument("--comm", choices=["config", "none", "mpi"], default="config",
                    help="the communicator: the config's [comm] table, none, or MPI (emulated devices, under mpirun)")
    ap.add_argument("--reference", choices=["torch"], help="train with plain torch + peft + torch.optim.AdamW instead")
    ap.add_argument("--adamw", choices=["for-loop", "foreach", "fused"], default="foreach",
                    help="the reference's AdamW implementation")
    ap.add_argument("--save", help="torch.save the run (schedule, per-step losses, adapters) to this file")
    ap.add_argument("--tasks-per-step", type=int, default=1,
                    help="tasks trained in each step over one pass of the base (mixed-task steps)")
    args = ap.parse_args()

    with open(args.config, "rb") as f:
        tables = tomllib.load(f)
    m = tables["model"]
    steps = args.steps or m["steps"]
    torch.set_num_threads(m.get("threads", 1))
    if args.reference:
        run = train_torch(m, tables.get("optimizer", {}), steps, args.adamw)
        label = f"torch + peft + AdamW ({args.adamw})"
    else:
        options = taskswap.load_config(args.config, ["model"])
        comm = {"config": None, "none": "none", "mpi": tt.mpi()}[args.comm]
        run = train_taskswap(m, options, steps, args.all_resident, comm, m.get("log_every", 0),
                             tasks_per_step=args.tasks_per_step)
        label = "all-resident" if args.all_resident else "taskswap"
    first, last = per_task(run["schedule"], run["losses"])
    fell = [t for t in first if last[t] < first[t]]
    if run.get("rank", 0) == 0:
        print(f"{label}: {steps} steps, {m['tasks']} LoRA adapters, {len(first)} tasks trained 4 times or more, "
              f"{1e3 * run['seconds'] / steps:.2f} ms/step")
        print(f"loss fell on {len(fell)} of {len(first)} tasks (mean first {sum(first.values()) / len(first):.4f}, "
              f"last {sum(last.values()) / len(last):.4f})")
        if "stats" in run:
            s = run["stats"].total
            print(f"h2d {s.h2d_bytes / 2**20:.1f} MiB, d2h {s.d2h_bytes / 2**20:.1f} MiB, hits {s.hits}, "
                  f"misses {s.misses}, unplanned {s.unplanned}, stall {s.stall_ms:.1f} ms, evictions {s.evictions}, "
                  f"peak device {s.peak_device_bytes / 2**20:.2f} MiB of a {run['budget'] / 2**20:.2f} MiB budget, "
                  f"{run['units']} units")
            if run["streamed_bytes"]:
                print(f"streamed base layers: {run['streamed_bytes'] / 2**20:.2f} MiB, "
                      f"{run['streamed_bytes'] / run['budget']:.1f}x the budget")
    if args.save:
        keep = {k: run[k] for k in ("schedule", "losses", "seconds", "model_state")}
        if "stats" in run:
            keep["state"] = run["state"]
            keep["reduced_bytes"] = run["stats"].total.reduced_bytes
        path = args.save if run.get("world", 1) == 1 else f"{args.save}.rank{run['rank']}"
        torch.save(keep, path)
    return 0 if len(fell) == len(first) else 1


if __name__ == "__main__":
    sys.exit(main())
