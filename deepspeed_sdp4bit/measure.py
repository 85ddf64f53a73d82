"""sdp4bit-measure: what your own nodes achieve, measured before a job commits to a plan, for `sdp4bit-plan`.

The planner's answer rests on two inputs nobody knows before a job runs: the share of the nominal link rate the
collectives reach, and the compute each GPU achieves on the model. Run this under the launcher you train with, on
the nodes you train on; every rank takes part:

    deepspeed --hostfile hosts --module deepspeed_sdp4bit.measure --out measured.json --model 1.3b
    torchrun --nnodes 2 --nproc-per-node 8 ... -m deepspeed_sdp4bit.measure --out measured.json
    sdp4bit-plan --measured measured.json --model 1.3b

It measures the links SDP4Bit uses (`collectives.probe`, the same code `"auto": true` runs at initialize, here with
messages grown until a transfer takes `--target-s`): each node sending to another one direction at a time (the
inter-node rate), an all-gather over each node's ranks (the intra-node rate), and the smallest all-gather over the
world, the inter-node groups and the intra-node groups (what every collective costs whatever its size); then the
gradient quantizer on this device (`core.auto.codec_bytes_s`), and, with `--model`, forward and backward passes of that
model at the job's sequence length and micro-batch (a few `--layers` of it where the whole does not fit one device),
then a few plain ZeRO optimizer steps of it in a DeepSpeed engine built from `--deepspeed_config` (the planner fits its
compute to them, as `"auto"` fits its plain steps). Each figure is the slowest rank's. Rank 0 prints them with the
planner command to run and writes them to `--out` (JSON, with the commit, versions and machine), which `sdp4bit-plan
--measured` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdp4bit_cost.plan import FORMAT, PlanError, read_ds_config
from sdp4bit_cost.shapes import ModelShape, ShapeError, card, from_hf_config

from .collectives import probe
from .core.auto import codec_bytes_s
from .provenance import provenance
from .topology import build_topology

TARGET_S = 0.5  # an inter- or intra-node gather grows until it takes this long: long enough to reach the link's rate
MAX_BYTES = 1 << 28
TIMED_PASSES = 3
ENGINE_STEPS = 3


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sdp4bit-measure", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("sdp4bit_measured.json"), help="the JSON file rank 0 writes")
    p.add_argument(
        "--ranks-per-node",
        default="auto",
        help="ranks per node: auto (from the launcher's LOCAL_WORLD_SIZE or the host names), or a number",
    )
    p.add_argument(
        "--target-s", type=float, default=TARGET_S, help=f"seconds each timed gather should take (default {TARGET_S})"
    )
    p.add_argument(
        "--model",
        help="a card of sdp4bit-plan or a Hugging Face config.json: time its forward and backward (needs transformers)",
    )
    p.add_argument("--layers", type=int, help="time this many of the model's layers (default: all)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length of the timed passes (default 2048)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per timed pass (default 1)")
    p.add_argument("--local_rank", type=int, help="passed by the deepspeed launcher; LOCAL_RANK gives the same")
    p.add_argument(
        "--dtype", choices=("bf16", "fp32"), help="the timed passes' dtype (default bf16 on a GPU, fp32 on CPU ranks)"
    )
    p.add_argument(
        "--deepspeed_config",
        type=Path,
        help="with --model: the job's DeepSpeed config, whose ZeRO settings the timed engine steps use (its sdp4bit "
        "block left out; default: ZeRO stage 3 with DeepSpeed's defaults); give the planner the same with --config",
    )
    p.add_argument(
        "--engine-steps",
        type=int,
        default=ENGINE_STEPS,
        help=f"with --model: plain ZeRO steps of a DeepSpeed engine on the model to time (default {ENGINE_STEPS}; "
        "0: none)",
    )
    return p


def _check(args: argparse.Namespace) -> None:
    """Refuse bad flags before anything is measured, naming the flag and the allowed values."""
    for flag in ("seq", "micro_batch", "layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SystemExit(f"sdp4bit-measure: --{flag.replace('_', '-')} {value}: must be an integer >= 1")
    if args.engine_steps < 0:
        raise SystemExit(f"sdp4bit-measure: --engine-steps {args.engine_steps}: must be an integer >= 0")
    if args.deepspeed_config is not None:
        if not args.model:
            raise SystemExit("sdp4bit-measure: --deepspeed_config needs --model (the engine steps time the model)")
        _engine_config(args.deepspeed_config, 1, "fp32")
    if not args.target_s > 0:
        raise SystemExit(f"sdp4bit-measure: --target-s {args.target_s}: must be > 0")
    if args.ranks_per_node != "auto" and not str(args.ranks_per_node).isdigit():
        raise SystemExit(f"sdp4bit-measure: --ranks-per-node {args.ranks_per_node!r}: allowed: auto or an integer")


def _device() -> torch.device:
    """This rank's GPU (LOCAL_RANK), or the CPU where there is none."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _shape(args: argparse.Namespace) -> ModelShape:
    """The model's shape as the planner counts its FLOPs, cut to --layers."""
    try:
        shape = from_hf_config(args.model) if args.model.endswith(".json") else card(args.model)
    except ShapeError as exc:
        raise SystemExit(f"sdp4bit-measure: {exc}") from None
    return replace(shape, layers=args.layers) if args.layers else shape


def _hf_model(args: argparse.Namespace, shape: ModelShape) -> torch.nn.Module:
    """The model to time: the config.json's architecture, or a GPT-2 of the card's shape, with --layers layers."""
    try:
        import transformers
    except ImportError:
        raise SystemExit(
            "sdp4bit-measure: --model needs transformers (pip install deepspeed-sdp4bit[examples])"
        ) from None
    if args.model.endswith(".json"):
        config = transformers.AutoConfig.from_pretrained(args.model)
        for key in ("num_hidden_layers", "n_layer"):
            if hasattr(config, key):
                setattr(config, key, shape.layers)
    else:
        config = transformers.GPT2Config(
            n_layer=shape.layers,
            n_embd=shape.hidden,
            n_head=shape.heads,
            vocab_size=shape.vocab,
            n_positions=max(args.seq, shape.positions),
        )
    # transformers leaves from_config unannotated; it builds a torch module
    model: torch.nn.Module = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return model


def pass_seconds(model: torch.nn.Module, tokens: torch.Tensor, device: torch.device) -> float:
    """Median seconds of a forward and backward pass on `tokens` (one untimed pass first)."""
    times = []
    for i in range(TIMED_PASSES + 1):
        probe.synchronize(device)
        began = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        probe.synchronize(device)
        if i:
            times.append(time.perf_counter() - began)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def time_model(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Achieved TFLOP/s of this device on the model (the slowest rank's), as the planner counts FLOPs."""
    shape = _shape(args)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    model = _hf_model(args, shape).to(device=device, dtype=dtype)
    tokens = torch.randint(0, shape.vocab, (args.micro_batch, args.seq), device=device)
    seconds = probe.slowest(pass_seconds(model, tokens, device), device)
    flops = shape.flops_per_token(args.seq) * args.seq * args.micro_batch
    return {
        "model": args.model,
        "layers": shape.layers,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "dtype": str(dtype).removeprefix("torch."),
        "pass_s": seconds,
        "tflops": flops / seconds / 1e12,
        "engine": engine_steps(args, model, tokens) if args.engine_steps else None,
    }


def _engine_config(path: Path | None, micro_batch: int, dtype: str) -> dict[str, Any]:
    """The plain engine's config: the job's (or ZeRO-3's defaults) without its sdp4bit block, one micro-batch of
    `micro_batch` per step in `dtype`; SystemExit naming the flag where the file cannot be read."""
    config: dict[str, Any] = {"zero_optimization": {"stage": 3}}
    if path is not None:
        try:
            config = read_ds_config(path, "--deepspeed_config")
        except PlanError as exc:
            raise SystemExit(f"sdp4bit-measure: {exc}") from None
    config = {k: v for k, v in config.items() if k not in ("sdp4bit", "train_batch_size", "optimizer", "scheduler")}
    config.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=1)
    config["bf16"] = {"enabled": dtype == "bf16"}
    config.pop("fp16", None)
    return config


def engine_steps(args: argparse.Namespace, model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, Any]:
    """Median seconds (slowest rank) of a plain ZeRO optimizer step of `model` on `tokens` (forward, backward, step)
    in a DeepSpeed engine built from --deepspeed_config, one untimed step first: the compute as a ZeRO step achieves
    it, the framework's own work and the job's collectives included (the planner separates them)."""
    import deepspeed

    dtype = "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"
    config = _engine_config(args.deepspeed_config, args.micro_batch, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    times = []
    for i in range(args.engine_steps + 1):
        probe.synchronize(tokens.device)
        began = time.perf_counter()
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
        probe.synchronize(tokens.device)
        if i:
            times.append(time.perf_counter() - began)
    stage = engine.zero_optimization_stage()
    engine.destroy()
    return {
        "zero_stage": stage,
        "steps": args.engine_steps,
        "step_s": probe.slowest(statistics.median(times), tokens.device),
        "deepspeed_config": str(args.deepspeed_config) if args.deepspeed_config else None,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure (collective: every rank calls it; every rank returns the same numbers)."""
    device = _device()
    topology = build_topology(args.ranks_per_node if args.ranks_per_node == "auto" else int(args.ranks_per_node))
    links = probe.measure_links(topology, device, target_s=args.target_s, max_bytes=MAX_BYTES)
    codec = probe.slowest(-codec_bytes_s(device), device)
    found: dict[str, Any] = {
        "format": FORMAT,
        "nodes": topology.nodes,
        "ranks_per_node": topology.ranks_per_node,
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "inter_node_gbps": _finite(links.inter_bytes_s * 8 / 1e9),
        "intra_node_gbs": _finite(links.intra_bytes_s / 1e9),
        "latency_us": _latency_us(links.latency, topology.nodes, topology.ranks_per_node),
        "codec_gbs": -codec / 1e9,
        "timed_model": time_model(args, device) if args.model else None,
    }
    found["tflops"] = found["timed_model"]["tflops"] if found["timed_model"] else None
    return found


def _latency_us(latency: probe.Latencies, nodes: int, per_node: int) -> dict[str, float | None]:
    """Microseconds of the smallest collective per kind of group (None where the job has no such group)."""
    present = {"world": nodes * per_node > 1, "inter": nodes > 1, "intra": per_node > 1}
    return {group: seconds * 1e6 if present[group] else None for group, seconds in zip(present, latency, strict=True)}


def _latencies(latency_us: dict[str, float | None]) -> str:
    """The latencies as rank 0 prints them."""
    names = {"world": "world", "inter": "inter-node", "intra": "intra-node"}
    return ", ".join(
        f"{names[group]} {'-' if value is None else f'{value:,.0f} us'}" for group, value in latency_us.items()
    )


def _finite(value: float) -> float | None:
    """A rate, or None where there is no such link (one node, or one rank per node)."""
    return None if value == float("inf") else value


def summary(found: dict[str, Any], out: Path) -> str:
    """What rank 0 prints: the figures and the planner command that reads them."""
    inter = found["inter_node_gbps"]
    intra = found["intra_node_gbs"]
    lines = [
        f"sdp4bit-measure: {found['nodes']} node(s) x {found['ranks_per_node']} rank(s) on {found['device_name']}",
        f"  inter-node: {'no link (one node)' if inter is None else f'{inter:,.3f} Gbit/s per node'}",
        f"  intra-node: {'no link (one rank per node)' if intra is None else f'{intra:,.3f} GB/s per rank'}",
        f"  latency per collective: {_latencies(found['latency_us'])}",
        f"  codec: {found['codec_gbs']:,.2f} GB/s (bytes read and written)",
    ]
    model = found["timed_model"]
    if model:
        lines.append(
            f"  {model['model']} ({model['layers']} layers, {model['micro_batch']} x {model['seq']} tokens, "
            f"{model['dtype']}): {model['pass_s']:.3f} s per forward and backward = {model['tflops']:,.2f} "
            "TFLOP/s achieved"
        )
    engine = model["engine"] if model else None
    if engine:
        lines.append(
            f"  plain ZeRO-{engine['zero_stage']} engine on it: {engine['step_s']:.3f} s per optimizer step "
            f"(median of {engine['steps']})"
        )
    command = f"sdp4bit-plan --measured {out}" + (
        f" --model {model['model']} --seq {model['seq']} --micro-batch {model['micro_batch']}"
        if model
        else " --model <your model>"
    )
    if engine and engine["deepspeed_config"]:
        command += f" --config {engine['deepspeed_config']}"
    lines += [f"written to {out}; plan with:", f"  {command}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _check(args)
    import deepspeed

    deepspeed.init_distributed()
    found = measure(args)
    if dist.get_rank() == 0:
        found["provenance"] = provenance()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(found, indent=1) + "\n")
        print(summary(found, args.out), flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
