#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A rehearsal at a real size: a Llama-style model built from a config (random weights, no
download) whose frozen base streams through a device budget of a fraction of its bytes, beside many
LoRA adapters, one per task, homed on disk; against the same model with every unit resident, in the
same run. Prints both step times and their ratio, and what each run moved.

    python3 bench/python/rehearsal.py samples/configs/rehearsal-7b-cuda.toml
    python3 bench/python/rehearsal.py samples/configs/rehearsal-emulated.toml   # a small shape, CPU

The config's [model] table is samples/python/peft_multitask.py's, plus: ``dtype`` ("bfloat16" or
"float32"), ``checkpointing`` (transformers' gradient checkpointing of the decoder layers: "none",
"non_reentrant", "reentrant"), ``base_fraction`` (the budget: this fraction of the streamed layers'
bytes, plus the pinned rest of the base and room for ``adapter_room`` adapters), ``warmup`` and
``steps`` (timed). Its [storage] table and a [[units]] rule with home = "disk" for "adapter/*" home
the adapters in unit files; the resident run keeps them in host memory, pinned on the device.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import warnings

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

import torch

warnings.filterwarnings("ignore", category=FutureWarning)

from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import taskswap  # noqa: E402
import taskswap.torch as tt  # noqa: E402
import taskswap.torch.peft as tpeft  # noqa: E402
from taskswap import _core  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build(m: dict, device: torch.device) -> torch.nn.Module:
    """The model, made on `device` in the config's dtype (no copy through the host), and its adapters."""
    torch.manual_seed(m["seed"])
    config = LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                         num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                         num_key_value_heads=m["kv_heads"], max_position_embeddings=2 * m["sequence"],
                         tie_word_embeddings=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[m.get("dtype", "float32")])
    try:
        with torch.device(device):
            base = LlamaForCausalLM(config)
            lora = LoraConfig(r=m["rank"], lora_alpha=2 * m["rank"], target_modules=m["targets"], lora_dropout=0.0)
            model = get_peft_model(base, lora, adapter_name="task0")
            # PEFT's add_adapter walks every adapter of every layer each time (minutes for 256):
            # each LoRA layer takes the adapter directly, as add_adapter would give it.
            layers = [mod for mod in model.modules() if isinstance(mod, LoraLayer)]
            for t in range(1, m["tasks"]):
                model.peft_config[f"task{t}"] = copy.copy(lora)
                for layer in layers:
                    layer.update_layer(f"task{t}", r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=0.0,
                                       init_lora_weights=True, use_rslora=False, config=lora)
    finally:
        torch.set_default_dtype(default)
    checkpointing = m.get("checkpointing", "none")
    if checkpointing != "none":
        reentrant = checkpointing == "reentrant"
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if reentrant:
            model.base_model.model.enable_input_require_grads()
    return model


def device_bytes(rt: tt.Runtime, u: tt.Unit) -> int:
    """What the unit takes on the device under the runtime's rules."""
    spec = u.spec()
    return _core.footprint(spec, _core.policy_for(spec, rt.options).optimizer).device_bytes


def run(m: dict, model: torch.nn.Module, options: taskswap.Options, resident: bool) -> dict:
    """One side of the rehearsal on `model`, which gets its values back at the end."""
    cuda = options.device.backend == taskswap.Backend.cuda
    device = torch.device("cuda", options.device.index) if cuda else torch.device("cpu")
    t_build = time.perf_counter()
    rt = tt.Runtime(options=options, comm="none")
    if resident:
        rt.options.add_rule("adapter/*", home="host", origin="rehearsal: all resident")
    adapters = tpeft.register(rt, model, base="per_layer", base_residency="pinned" if resident else None,
                              residency="pinned" if resident else None, stream=not resident)
    layer_names = {b.name for b in adapters.base if b._layer is not None}
    streamed = sum(device_bytes(rt, u) for u in rt.units if u.name in layer_names)
    if resident:
        rt.options.device.budget = rt.all_pinned_budget()
    else:
        rest = sum(device_bytes(rt, u) for u in adapters.base if u.name not in layer_names)
        one_adapter = max(device_bytes(rt, adapters[n]) for n in adapters)
        rt.options.device.budget = int(m["base_fraction"] * streamed + rest + m.get("adapter_room", 3) * one_adapter)
    rt.start()
    build_s = time.perf_counter() - t_build
    steps = m["warmup"] + m["steps"]
    g = torch.Generator().manual_seed(m["seed"] + 7)
    sched = torch.randint(0, m["tasks"], (steps,), generator=g).tolist()
    rt.plan([adapters.uses(f"task{t}") for t in sched])
    times, losses = [], []
    for t in sched:
        x = torch.randint(0, m["vocab"], (m["batch"], m["sequence"]), generator=g).to(device)
        start = time.perf_counter()
        with adapters.step(f"task{t}"):
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     x.roll(-1, dims=1).reshape(-1))
            loss.backward()
        losses.append(loss.item())  # waits for the step's device work
        times.append(time.perf_counter() - start)
    st = rt.stats()
    out = {"build_s": build_s, "step_s": statistics.median(times[m["warmup"]:]), "steps": times,
           "losses": losses, "budget": st.budget, "streamed_bytes": streamed, "units": len(rt.units),
           "h2d_per_step": st.total.h2d_bytes / steps, "d2h_per_step": st.total.d2h_bytes / steps,
           "stall_ms": st.total.stall_ms, "peak": st.total.peak_device_bytes,
           "disk_read": st.disk.read_bytes, "disk_written": st.disk.written_bytes,
           "torch_peak": torch.cuda.max_memory_allocated(device) if cuda else 0}
    rt.close()
    del adapters, rt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a taskswap configuration with a [model] table (samples/configs/rehearsal-*.toml)")
    ap.add_argument("--only", choices=["streamed", "resident"], help="run one side only")
    args = ap.parse_args()
    with open(args.config, "rb") as f:
        m = tomllib.load(f)["model"]
    torch.set_num_threads(m.get("threads", os.cpu_count() or 1))
    options = taskswap.load_config(args.config, ["model"])
    gib, mib = 2**30, 2**20
    cuda = options.device.backend == taskswap.Backend.cuda
    device = torch.device("cuda", options.device.index) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    model = build(m, device)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters with {m['tasks']} adapters, "
          f"made in {time.perf_counter() - t0:.1f} s", flush=True)
    results = {}
    for side in ("streamed", "resident"):
        if args.only not in (None, side):
            continue
        r = run(m, model, options, side == "resident")
        results[side] = r
        print(f"{side}: {r['units']} units, budget {r['budget'] / gib:.3f} GiB (streamed layers "
              f"{r['streamed_bytes'] / gib:.3f} GiB), started in {r['build_s']:.1f} s; step {r['step_s'] * 1e3:.1f} ms "
              f"(median of {m['steps']} after {m['warmup']}); per step h2d {r['h2d_per_step'] / mib:.1f} MiB, "
              f"d2h {r['d2h_per_step'] / mib:.1f} MiB; stall {r['stall_ms']:.0f} ms in all; peak "
              f"{r['peak'] / mib:.1f} MiB of the budget, torch's peak {r['torch_peak'] / gib:.2f} GiB; disk read "
              f"{r['disk_read'] / mib:.1f} MiB, written {r['disk_written'] / mib:.1f} MiB", flush=True)
        print(f"  steps (s): {' '.join(f'{t:.3f}' for t in r['steps'])}", flush=True)
    if len(results) == 2:
        ratio = results["streamed"]["step_s"] / results["resident"]["step_s"]
        print(f"ratio streamed / all-resident: {ratio:.3f} (the base through {m['base_fraction']:.3f} of its bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
