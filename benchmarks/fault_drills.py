"""Fault drills and resumes on namespaced nodes (benchmarks/two_nodes.py), with the GPT example's tiny model in fp32.

    sudo .venv/bin/python benchmarks/fault_drills.py fault --fault cut --block on --data DATA --out runs/drills/cut
    sudo .venv/bin/python benchmarks/fault_drills.py train --nodes 2 --ranks_per_node 2 --block on --iters 30 \\
        --save_interval 10 --data DATA --out runs/drills/saved
    sudo .venv/bin/python benchmarks/fault_drills.py universal --checkpoint runs/drills/saved/checkpoint
    sudo .venv/bin/python benchmarks/fault_drills.py train --nodes 3 --ranks_per_node 1 --block on --iters 30 \\
        --load runs/drills/saved/checkpoint --data DATA --out runs/drills/resumed

`layouts` trains each layout (default 3 x 1, 4 x 1, 3 x 2) with the block and without it for 100 steps and compares the
losses, the replicas' check and SDP4Bit's accounting of cross-node bytes with what the links carried. `resumes` saves a
2 x 2 job with the block, makes the checkpoint universal and resumes it on each layout (default 4 x 1, 1 x 4, 3 x 1)
with the block and without it (`--config`: the ZeRO stage's config). `fault` starts a job on N nodes of one rank each
with a job timeout of one minute (DEEPSPEED_TIMEOUT=1), saving a checkpoint every 5 steps; after 8 steps it faults the
last node: `cut` takes its link down at the switch (no FIN or reset reaches anyone, as when a switch port or the node's
power fails), `kill` kills every process on it. It times how long each surviving node's job takes to stop and keeps the
errors each survivor's log reports. `train` runs the example on N x R nodes (from a checkpoint with `--load`: a
universal one, made by `universal`, which runs DeepSpeed's `ds_to_universal` on a checkpoint's latest tag). Each prints
its result as JSON and writes it, with the commit, versions and machine, to `--out`/result.json. DATA is a token file
prefix made by examples/prepare_data.py. Every job uses the same global batch (24 sequences of 64 tokens, micro-batches
of 2), so the data order, which the example draws independently of the world size, is the same on every layout; each
rank runs one torch thread, so that several jobs share the machine without oversubscribing it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deepspeed_sdp4bit.provenance import write_result
from sdp4bit_benchmarks import cost_model, two_nodes, wire

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
CONFIG = ROOT / "configs" / "cpu" / "tiny_sdp4bit.json"
TIMEOUT_MIN = 1
GLOBAL_BATCH, MICRO_BATCH = 24, 2
RATE_MBIT = 200


@dataclass
class Drill:
    """What a fault drill did and saw: the fault, when it struck, how each node's job ended and what it said."""

    fault: str
    block: bool
    nodes: int
    struck_after_step: int
    exit_codes: list[int | None] = field(default_factory=list)
    exit_after_s: list[float | None] = field(default_factory=list)
    errors: list[list[str]] = field(default_factory=list)


def example_args(
    data: Path, out: Path, block: bool, iters: int, extra: list[str] | None = None, config: Path = CONFIG
) -> list[str]:
    """The example's arguments: the tiny model in fp32 with the paper's block in `config` (enabled or not) for `iters`
    steps."""
    return [
        "--model",
        "tiny",
        "--deepspeed_config",
        str(config),
        "--ds_set",
        f"sdp4bit.enabled={json.dumps(block)}",
        "--ds_set",
        "sdp4bit.ranks_per_node=auto",
        "--precision",
        "fp32",
        "--data",
        str(data),
        "--train_iters",
        str(iters),
        "--eval_interval",
        "100000",
        "--eval_samples",
        "16",
        "--seq_len",
        "64",
        "--global_batch",
        str(GLOBAL_BATCH),
        "--micro_batch",
        str(MICRO_BATCH),
        "--threads",
        "1",
        "--out",
        str(out),
        *(extra or []),
    ]


def losses(out: Path) -> dict[str, float]:
    """Step (a string, as result.json holds it) -> mean training loss, from the log.csv rank 0 wrote."""
    log = out / "log.csv"
    if not log.exists():
        return {}
    with log.open() as f:
        return {row["step"]: float(row["loss"]) for row in csv.DictReader(f) if row.get("loss")}


def error_lines(log: Path, keep: int = 6) -> list[str]:
    """The last lines of a node's log that report an error."""
    words = ("Error", "error", "sdp4bit:", "Timed out", "timed out", "closed")
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if any(w in line for w in words)]
    return lines[-keep:]


def _wait_for_step(procs: list[subprocess.Popen], out: Path, step: int, limit: float) -> None:
    """Until rank 0 logged `step` steps; raises when a node's job ends first or time runs out."""
    deadline = time.monotonic() + limit
    while len(losses(out)) < step:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            codes = [p.poll() for p in procs]
            raise two_nodes.NodesError(f"the job did not reach step {step}: exit codes {codes}")
        time.sleep(0.2)


def _exit_times(procs: list[subprocess.Popen], watched: int, struck: float, limit: float) -> list[float | None]:
    """Seconds from the fault to each node's job ending, for the first `watched` nodes (None: still running)."""
    exits: list[float | None] = [None] * len(procs)
    while time.monotonic() < struck + limit and any(exits[i] is None for i in range(watched)):
        for i, proc in enumerate(procs):
            if exits[i] is None and proc.poll() is not None:
                exits[i] = time.monotonic() - struck
        time.sleep(0.2)
    return exits


def fault_drill(
    fault: str, block: bool, data: Path, out: Path, nodes: int = 3, steps_before: int = 8, save_interval: int = 5
) -> Drill:
    """Start the job, fault the last node once rank 0 logged `steps_before` steps, and time the survivors' exits
    (checkpoints every `save_interval` steps in out/checkpoint)."""
    drill = Drill(fault, block, nodes, steps_before)
    save = ["--save_dir", str(out / "checkpoint"), "--save_interval", str(save_interval)]
    args = example_args(data, out / "job", block, 100000, save)
    with two_nodes.Nodes(ranks_per_node=1, count=nodes) as cluster:
        cluster.shape(two_nodes.Link(rate_mbit=RATE_MBIT))
        procs = cluster.launch(str(EXAMPLE), args, out / "logs", {"DEEPSPEED_TIMEOUT": str(TIMEOUT_MIN)})
        _wait_for_step(procs, out / "job", steps_before, 900)
        struck = time.monotonic()
        (cluster.cut if fault == "cut" else cluster.kill)(nodes - 1)
        drill.exit_after_s = _exit_times(procs, nodes - 1, struck, TIMEOUT_MIN * 60 + 120)
        drill.exit_codes = [p.poll() for p in procs]
    drill.errors = [error_lines(out / "logs" / f"node{i}.log") for i in range(nodes)]
    return drill


def train(
    data: Path,
    out: Path,
    nodes: int,
    ranks_per_node: int,
    block: bool,
    iters: int,
    load: Path | None = None,
    save_interval: int = 0,
    config: Path = CONFIG,
    capture: bool = False,
) -> dict:
    """The example on `nodes` x `ranks_per_node` namespaced nodes (resumed from the universal checkpoint in `load`);
    the job's exit codes, topology and link bytes, rank 0's summary and the loss of every step; with `capture`, what
    the links carried per steady step, by protocol (benchmarks/wire.py)."""
    extra = []
    if load is not None:
        extra += ["--load_dir", str(load), "--ds_set", "checkpoint.load_universal=true"]
    if save_interval:
        extra += ["--save_dir", str(out / "checkpoint"), "--save_interval", str(save_interval)]
    extra += ["--link_counters", two_nodes.LINK]
    args = example_args(data, out / "job", block, iters, extra, config)
    with two_nodes.Nodes(ranks_per_node=ranks_per_node, count=nodes) as cluster:
        cluster.shape(two_nodes.Link(rate_mbit=RATE_MBIT))
        with cluster.captured(out / "wire") if capture else contextlib.nullcontext([]) as captures:
            job = two_nodes.run_job(cluster, str(EXAMPLE), args, out / "logs", timeout=1800)
    summary_file = out / "job" / "summary.json"
    job["summary"] = json.loads(summary_file.read_text()) if summary_file.exists() else None
    if captures and job["summary"] is not None:
        job["wire_per_step"] = wire_per_step(captures, job["summary"]["steady_spans_unix"])
    job["losses"] = losses(out / "job")
    job["log_tail"] = "".join((out / "logs" / f"node{i}.log").read_text(errors="replace")[-1500:] for i in range(nodes))
    return job


def wire_per_step(captures: list[Path], spans: list[list[float]]) -> dict[str, float]:
    """Bytes per class (benchmarks/wire.py) that left all nodes, per steady step; the streams the capture could
    not follow from their start, and frames it dropped, as counts over the whole job."""
    results = [json.loads(path.read_text()) for path in captures]
    summed = {name: 0.0 for name in wire.CLASSES}
    for result in results:
        for name, count in wire.window(result, spans).items():
            summed[name] += count / len(spans)
    summed["streams_broken"] = sum(
        r["streams"]["gloo_broken"] + r["streams"]["started_before_capture"] for r in results
    )
    summed["capture_drops"] = sum(r["capture_drops"] for r in results)
    return summed


def universal(checkpoint: Path, tag: str | None = None) -> str:
    """Convert one tag of the checkpoint (default: its latest) with DeepSpeed's ds_to_universal, which points
    `latest_universal` beside it to the result; returns the universal tag. ZeRO-1/2 checkpoints need its
    `--inject_missing_state` (the layout information Megatron-DeepSpeed saves and plain DeepSpeed does not)."""
    tag = tag or (checkpoint / "latest").read_text().strip()
    target = f"{tag}_universal"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(checkpoint / tag),
            "--output_folder",
            str(checkpoint / target),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            "--inject_missing_state",  # ZeRO-1/2 checkpoints lack the universal_checkpoint_info Megatron would add
        ],
        check=True,
        capture_output=True,
        timeout=900,
    )
    return target


def tail_mean(losses: dict[str, float], last: int, count: int) -> float:
    """Mean loss of steps last-count+1 .. last."""
    return sum(losses[str(step)] for step in range(last - count + 1, last + 1)) / count


def compare_layouts(data: Path, out: Path, layouts: list[tuple[int, int]], iters: int) -> dict:
    """Each layout (nodes, ranks per node) trained with the block and without it: the loss gap over the last 10
    steps, whether the replicas verified, and SDP4Bit's accounting of cross-node bytes against what the links
    carried: their TCP payload (link counters), and the part of it that is collectives' data (gloo's framing and the
    TCP store's traffic set apart by a capture of the run with the block)."""
    rows = []
    for nodes, per_node in layouts:
        runs = {
            block: train(
                data, out / f"{nodes}x{per_node}_{block}", nodes, per_node, block == "on", iters, capture=block == "on"
            )
            for block in ("on", "off")
        }
        on = runs["on"]["summary"]
        payload = two_nodes.tcp_payload(on["link_tx_bytes_per_step"], on["link_tx_packets_per_step"])
        accounted = cost_model.accounted_cross_node_bytes(on, "sdp4bit_node", "fp32", nodes=nodes)
        captured = runs["on"]["wire_per_step"]
        losses = {block: tail_mean(run["losses"], iters - 1, 10) for block, run in runs.items()}
        rows.append(
            {
                "layout": f"{nodes}x{per_node}",
                "exit_codes": {block: run["exit_codes"] for block, run in runs.items()},
                "topology": runs["on"]["topology"],
                "loss_last10": losses,
                "loss_gap": losses["on"] / losses["off"] - 1,
                "verified": on["sdp4bit_verified"],
                "accounted_cross_bytes_per_step": accounted,
                "link_bytes_per_step": on["link_tx_bytes_per_step"],
                "link_payload_bytes_per_step": payload,
                "accounting_gap": accounted / payload - 1,
                "wire_per_step": captured,
                "accounting_gap_to_data": accounted / captured["gloo_data"] - 1,
            }
        )
        print(layout_line(rows[-1]), flush=True)
    return {"iters": iters, "layouts": rows}


def layout_line(row: dict) -> str:
    """One layout's comparison, as printed."""
    losses, captured = row["loss_last10"], row["wire_per_step"]
    return (
        f"{row['layout']}: loss (last 10 steps) {losses['on']:.4f} with the block, {losses['off']:.4f} without "
        f"({row['loss_gap']:+.2%}); verified {row['verified']}; cross-node bytes/step accounted "
        f"{row['accounted_cross_bytes_per_step']:,.0f}, on the links {row['link_payload_bytes_per_step']:,.0f} "
        f"({row['accounting_gap']:+.2%}): collectives' data {captured['gloo_data']:,.0f} "
        f"({row['accounting_gap_to_data']:+.2%}), gloo's framing {captured['gloo_framing']:,.0f}, the TCP store "
        f"{captured['store']:,.0f}, unparsed {captured['unparsed']:,.0f} (captured {captured['frame_bytes']:,.0f} "
        f"frame bytes, the link counters {row['link_bytes_per_step']:,.0f}; {captured['streams_broken']:.0f} streams "
        f"not followed, {captured['capture_drops']:.0f} frames dropped)"
    )


def compare_resumes(
    data: Path, out: Path, targets: list[tuple[int, int]], config: Path, saved_at: int = 10, until: int = 30
) -> dict:
    """A 2 x 2 job with the block saves at step `saved_at` and goes on to `until`; the checkpoint, made universal,
    resumes on each target layout with the block and without it, to `until`: the first resumed step against the
    saved run's, the mean loss after the resume with the block against without, and the replicas' check."""
    saved = train(data, out / "saved", 2, 2, True, until, save_interval=saved_at, config=config)
    checkpoint = out / "saved" / "checkpoint"
    universal(checkpoint, f"global_step{saved_at}")
    rows = []
    for nodes, per_node in targets:
        runs = {
            block: train(
                data,
                out / f"{nodes}x{per_node}_{block}",
                nodes,
                per_node,
                block == "on",
                until,
                checkpoint,
                config=config,
            )
            for block in ("on", "off")
        }
        means = {block: tail_mean(run["losses"], until - 1, until - saved_at) for block, run in runs.items()}
        first = runs["on"]["losses"][str(saved_at)]
        row = {
            "layout": f"{nodes}x{per_node}",
            "exit_codes": {block: run["exit_codes"] for block, run in runs.items()},
            "first_step_loss": first,
            "saved_run_loss": saved["losses"][str(saved_at)],
            "mean_loss_after_resume": means,
            "gap": means["on"] / means["off"] - 1,
            "verified": runs["on"]["summary"]["sdp4bit_verified"],
        }
        rows.append(row)
        print(
            f"2x2 -> {row['layout']}: step {saved_at} loss {first:.4f} (saved run {row['saved_run_loss']:.4f}); "
            f"mean over steps {saved_at}-{until - 1}: {means['on']:.4f} with the block, {means['off']:.4f} without "
            f"({row['gap']:+.2%}); verified {row['verified']}",
            flush=True,
        )
    return {"config": str(config), "saved_at": saved_at, "until": until, "resumes": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    fault = commands.add_parser("fault", help="fault the last node of a running job")
    fault.add_argument("--fault", choices=("cut", "kill"), required=True)
    fault.add_argument("--nodes", type=int, default=3)
    run = commands.add_parser("train", help="train (or resume) on N x R nodes")
    run.add_argument("--nodes", type=int, required=True)
    run.add_argument("--ranks_per_node", type=int, required=True)
    run.add_argument("--iters", type=int, required=True, help="train until this step")
    run.add_argument("--load", help="resume from the universal checkpoint in this folder")
    run.add_argument("--save_interval", type=int, default=0, help="a checkpoint every N steps in --out/checkpoint")
    for sub in (fault, run):
        sub.add_argument("--block", choices=("on", "off"), required=True)
        sub.add_argument("--data", required=True, help="token file prefix (examples/prepare_data.py)")
        sub.add_argument("--out", required=True)
    compare = commands.add_parser("layouts", help="train each layout with the block and without it")
    compare.add_argument("--layouts", nargs="+", default=["3x1", "4x1", "3x2"], help="NODESxRANKS, e.g. 3x2")
    compare.add_argument("--iters", type=int, default=100)
    resumes = commands.add_parser("resumes", help="a 2 x 2 checkpoint resumed on other layouts, with and without")
    resumes.add_argument("--layouts", nargs="+", default=["4x1", "1x4", "3x1"], help="NODESxRANKS, e.g. 3x1")
    resumes.add_argument("--config", default=str(CONFIG), help="DeepSpeed config with the block (its ZeRO stage)")
    for sub in (compare, resumes):
        sub.add_argument("--data", required=True, help="token file prefix (examples/prepare_data.py)")
        sub.add_argument("--out", required=True)
    convert = commands.add_parser("universal", help="convert a checkpoint's latest tag to a universal checkpoint")
    convert.add_argument("--checkpoint", required=True)
    convert.add_argument("--tag", help="which tag (default: the latest)")
    args = parser.parse_args(argv)
    if args.command == "universal":
        print(json.dumps({"universal_tag": universal(Path(args.checkpoint), args.tag)}))
        return 0
    out = Path(args.out)
    with two_nodes.signals_raise():
        if args.command in ("layouts", "resumes"):
            layouts = [(int(layout.split("x")[0]), int(layout.split("x")[1])) for layout in args.layouts]
            if args.command == "layouts":
                result = compare_layouts(Path(args.data), out, layouts, args.iters)
            else:
                result = compare_resumes(Path(args.data), out, layouts, Path(args.config))
        elif args.command == "fault":
            result = asdict(fault_drill(args.fault, args.block == "on", Path(args.data), out, args.nodes))
        else:
            load = Path(args.load) if args.load else None
            block = args.block == "on"
            result = train(
                Path(args.data), out, args.nodes, args.ranks_per_node, block, args.iters, load, args.save_interval
            )
    result = write_result(out / "result.json", {"command": sys.argv, **result})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
