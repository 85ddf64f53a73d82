"""Mutation testing of the test suite: hand-made mutants of the codec reference, the collectives and the ZeRO-3
runtime, each run against the smallest test selection that covers its file; prints a score per file.

A mutant is one small, plausible bug (a flipped comparison, a dropped term, a swapped constant), written as the exact
text it replaces. The checkout is never modified: its committed state is cloned with git into a scratch folder that
this run creates (a fresh temporary folder, or --work, which must not exist yet) and removes at the end unless
--keep; a folder it did not create is never deleted. Each mutant is applied there, the selection runs with that
clone first on PYTHONPATH (spawned ranks inherit it), and the file is restored. A mutant is killed when the
selection fails or times out, and survives when it passes. A mutant that no input can tell apart from the original
carries the reason; surviving, it counts as equivalent, and the score is killed / (mutants - equivalent).

    python benchmarks/mutation.py                       # every file (about an hour on 2 cores)
    python benchmarks/mutation.py --files grad_reduce --only G15 --keep  # one mutant; keep the scratch clone

Output: one line per mutant, a table per file, and with --json the same as a JSON file with its provenance
(commit, versions, machine, command).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from deepspeed_sdp4bit.provenance import write_result

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    """One bug: in `path`, the text `old` (found exactly once) becomes `new`."""

    id: str
    path: str
    old: str
    new: str
    what: str
    equivalent: str = ""  # why no input can tell this mutant from the original, if none can
    target: str = ""  # the target whose tests run it, where not every target of its file


@dataclass(frozen=True)
class Target:
    """A mutated file and the tests run against its mutants."""

    name: str
    path: str
    tests: tuple[str, ...]


REF = "deepspeed_sdp4bit/codec/reference.py"
SPEC = "deepspeed_sdp4bit/codec/spec.py"
GRAD = "deepspeed_sdp4bit/collectives/grad_reduce.py"
ROUNDING = "deepspeed_sdp4bit/collectives/rounding.py"
STORE = "deepspeed_sdp4bit/collectives/weight_store.py"
RUNTIME = "deepspeed_sdp4bit/core/runtime.py"
BUILD = "deepspeed_sdp4bit/core/build.py"
SERVING3 = "deepspeed_sdp4bit/zero3/serving.py"
OWNER = "deepspeed_sdp4bit/collectives/owner_reduce.py"
LEVELS = "deepspeed_sdp4bit/collectives/levels.py"
SERVING12 = "deepspeed_sdp4bit/zero12/serving.py"
TRAFFIC = "sdp4bit_cost/traffic.py"
LAYOUT = "sdp4bit_cost/layout.py"
TIMING = "sdp4bit_cost/timing.py"
AUTO = "deepspeed_sdp4bit/core/auto.py"
FAULTS = "deepspeed_sdp4bit/collectives/faults.py"
ERRORS = "deepspeed_sdp4bit/collectives/errors.py"
QUALITY = "deepspeed_sdp4bit/core/quality.py"
REPLICATED = "deepspeed_sdp4bit/zero12/replicated.py"
TOPOLOGY = "deepspeed_sdp4bit/topology.py"
RUNTIME_TESTS = (
    "tests/test_zero3_training.py",
    "-k",
    "every_replica_mode or verify_finds or paper_setting_trains and float32",
)
COST_TESTS = ("tests/test_cost_model.py", "tests/test_planner.py", "-k", "not console_script")

TARGETS = {
    "reference": Target(
        "reference",
        REF,
        (
            "tests/test_codec_literals.py",
            "tests/test_codec_reference.py",
            "tests/test_codec_backends.py",
            "-k",
            "not cuda",
        ),
    ),
    "spec": Target(
        "spec",
        SPEC,
        (
            "tests/test_codec_literals.py",
            "tests/test_codec_reference.py",
            "tests/test_codec_backends.py",
            "-k",
            "not cuda",
        ),
    ),
    "grad_reduce": Target("grad_reduce", GRAD, ("tests/test_grad_reduce.py", "-k", "world1 or world4 or world6")),
    "rounding": Target("rounding", ROUNDING, ("tests/test_grad_reduce.py", "-k", "world1 or world4 or world6")),
    "weight_store": Target("weight_store", STORE, ("tests/test_weight_store.py", "-k", "4 or 6")),
    "runtime": Target("runtime", RUNTIME, RUNTIME_TESTS),
    "runtime_rules": Target("runtime_rules", RUNTIME, ("tests/test_runtime_rules.py",)),
    "errors": Target("errors", ERRORS, ("tests/test_errors.py",)),
    "quality": Target("quality", QUALITY, ("tests/test_errors.py",)),
    "build": Target("build", BUILD, RUNTIME_TESTS),
    "zero3_serving": Target("zero3_serving", SERVING3, RUNTIME_TESTS),
    "owner_reduce": Target("owner_reduce", OWNER, ("tests/test_owner_reduce.py", "-k", "2 or 4 or merge")),
    "levels": Target(
        "levels",
        LEVELS,
        ("tests/test_grad_reduce.py", "tests/test_owner_reduce.py", "-k", "world1 or world4 or world6 or merge"),
    ),
    "zero12_serving": Target(
        "zero12_serving", SERVING12, ("tests/test_zero12_training.py", "-k", "rpn2 or unstarted or comms")
    ),
    "traffic": Target("traffic", TRAFFIC, COST_TESTS),
    "layout": Target(
        "layout",
        LAYOUT,
        (
            "tests/test_grad_reduce.py",
            "tests/test_layout.py",
            "tests/test_cost_model.py",
            "-k",
            "world1 or world4 or world6 or test_layout or test_cost_model",
        ),
    ),
    "timing": Target("timing", TIMING, COST_TESTS),
    "auto": Target("auto", AUTO, ("tests/test_auto.py",)),
    "faults": Target("faults", FAULTS, ("tests/test_faults.py",)),
    "tensor_parallel": Target("tensor_parallel", REPLICATED, ("tests/test_tensor_parallel.py",)),
    "topology": Target("topology", TOPOLOGY, ("tests/test_topology.py",)),
}

MUTANTS = [
    # codec/reference.py
    Mutant(
        "R01",
        SPEC,
        "    hi = ((x * (c >> 16)) & 0xFFFF) << 16",
        "    hi = ((x * (c >> 16)) & 0xFFFF) << 15",
        "32-bit multiply: high half shifted by 15",
    ),
    Mutant("R02", SPEC, "    x = x ^ (x >> 15)", "    x = x ^ (x >> 16)", "hash: second xor-shift by 16"),
    Mutant("R03", SPEC, "    x = _mul32(x, 0x846CA68B)", "    x = _mul32(x, 0x846CA68A)", "hash: constant off by one"),
    Mutant(
        "R04",
        REF,
        "    return (h >> 8).to(torch.float32) * (2.0**-24)",
        "    return (h >> 9).to(torch.float32) * (2.0**-24)",
        "uniforms from 23 bits: u < 0.5 always",
    ),
    Mutant("R05", REF, "    hi = (lo >> 32) + hi0", "    hi = hi0 + 0 * lo", "counter: carry into the high word lost"),
    Mutant(
        "R06",
        REF,
        "        y = torch.stack((a + b, a - b), dim=2).reshape(-1)",
        "        y = torch.stack((a + b, b - a), dim=2).reshape(-1)",
        "Hadamard butterfly: b - a",
    ),
    Mutant(
        "R07",
        REF,
        "        y = y * (1.0 / HADAMARD_BLOCK)",
        "        y = y * (1.0 / 16)",
        "inverse Hadamard scaled by 1/16",
    ),
    Mutant(
        "R08",
        REF,
        "    scale = torch.where(scale < _FLT_MIN, torch.zeros_like(scale), scale)",
        "    scale = torch.where(scale <= _FLT_MIN, torch.zeros_like(scale), scale)",
        "FLT_MIN rule: scale FLT_MIN itself zeroed",
    ),
    Mutant(
        "R09",
        REF,
        '    return torch.where(nonfinite, torch.full_like(scale, float("nan")), scale)',
        "    return scale",
        "a NaN/Inf group keeps a finite scale",
    ),
    Mutant(
        "R10",
        REF,
        "        return torch.round(v)",
        "        return torch.floor(v + 0.5)",
        "nearest rounding: ties away from zero upwards instead of to even",
    ),
    Mutant(
        "R11",
        REF,
        "    return fl + (u < (v - fl)).to(torch.float32)",
        "    return fl + (u <= (v - fl)).to(torch.float32)",
        "stochastic rounding: u <= frac",
    ),
    Mutant(
        "R12",
        REF,
        "    u = uniform(seed, offset, v.numel(), v.device).view_as(v)",
        "    u = uniform(seed, offset + 1, v.numel(), v.device).view_as(v)",
        "stochastic rounding: counter + 1",
    ),
    Mutant(
        "R13",
        REF,
        "    return (((pairs[:, 0] & 0xF) << 4) | (pairs[:, 1] & 0xF)).to(torch.uint8)",
        "    return (((pairs[:, 1] & 0xF) << 4) | (pairs[:, 0] & 0xF)).to(torch.uint8)",
        "nibble order swapped",
    ),
    Mutant(
        "R14",
        REF,
        "        q = torch.where(q >= 8, q - 16, q)",
        "        q = torch.where(q >= 9, q - 16, q)",
        "4-bit unpack: -8 read as +8",
    ),
    Mutant(
        "R15",
        REF,
        "        q = torch.where(c >= 128, c - 256, c)",
        "        q = torch.where(c > 128, c - 256, c)",
        "8-bit unpack: -128 read as +128",
    ),
    Mutant(
        "R16",
        REF,
        "    qmax = qmax_for(bits)\n    groups = xf.view(-1, group_size)",
        "    qmax = 100 if bits == 8 else qmax_for(bits)\n    groups = xf.view(-1, group_size)",
        "8-bit levels +-100 instead of +-127",
    ),
    Mutant(
        "R17",
        REF,
        "    q = _round(v, stochastic, seed, offset).clamp(-qmax, qmax)",
        "    q = _round(v, stochastic, seed, offset).clamp(-qmax - 1, qmax)",
        "clamp admits -qmax - 1",
    ),
    Mutant(
        "R18",
        REF,
        "    v = groups * inv[:, None]",
        "    v = groups / torch.where(usable, scale, torch.ones_like(scale))[:, None]",
        "v = x / scale (one rounding) instead of x * fl(1/scale)",
    ),
    Mutant(
        "R19", REF, "    valid = part if valid is None else valid", "    valid = part", "valid ignored: padding read"
    ),
    Mutant(
        "R20",
        REF,
        "        view[:, :whole] = hadamard32(view[:, :whole].reshape(-1)).view(partitions, whole)",
        "        view[:, :whole] = hadamard32(view[:, :whole].reshape(-1), inverse=True).view(partitions, whole)",
        "quantize applies the inverse Hadamard transform",
    ),
    Mutant(
        "R21",
        REF,
        "        target.copy_((delta + target.to(torch.float32) if add else delta).to(values.dtype))",
        "        target.copy_((delta.to(values.dtype) + target if add else delta).to(values.dtype))",
        "dequantize_add_: two roundings",
    ),
    Mutant(
        "R22",
        REF,
        "        return _prepared(new_tile, live - c.start, False, padded)"
        " - _prepared(ref_tile, live - c.start, False, padded)",
        "        return _prepared(new_tile - ref_tile.to(new_tile.dtype), live - c.start, False, padded)",
        "diff_quantize subtracts in the input dtype",
    ),
    Mutant("R23", REF, "    z = n * ranks_per_node + l", "    z = l * nodes + n", "swizzle: node-major partitions"),
    Mutant(
        "R24",
        REF,
        "    for k in range(1, pieces):\n        acc = acc + _decoded(codes[k : k + 1]",
        "    for k in range(2, pieces):\n        acc = acc + _decoded(codes[k : k + 1]",
        "reduction drops piece 1",
    ),
    Mutant(
        "R25",
        REF,
        "        factor[:whole] = factor[:whole] * (1.0 / HADAMARD_BLOCK)",
        "        factor[:whole] = factor[:whole] * 1.0",
        "dequantize_reduce forgets the 1/32 of the inverse transform",
    ),
    Mutant(
        "R26",
        SPEC,
        "    if block % group_size or block % HADAMARD_BLOCK:",
        "    if block % group_size:",
        "swizzle check: blocks not a multiple of 32 accepted",
        "group sizes are multiples of 32 (check_group_size runs first), so whole groups are whole 32-blocks",
    ),
    Mutant(
        "R27",
        REF,
        "        check_out_codes(out, device, numel, bits, group_size)\n        return out\n",
        "        check_out_codes(out, device, numel, bits, group_size)\n",
        "out=: the caller's buffers checked, then fresh ones written and returned",
    ),
    Mutant(
        "R28",
        REF,
        "    per_elem = groups.repeat_interleave(group_size, dim=1)[:, skip : skip + n]",
        "    per_elem = groups.repeat_interleave(group_size, dim=1)[:, -n:]",
        "dequantize: scales aligned to the end",
    ),
    # collectives/grad_reduce.py
    Mutant(
        "G01",
        LAYOUT,
        "    chunks = tuple(shard_numel(n, world) for n in numels)",
        "    chunks = tuple(n // world + 1 for n in numels)",
        "chunk size n // W + 1 (wrong when W divides n)",
    ),
    Mutant(
        "G02",
        LAYOUT,
        "    part = max(1, -(-(lead + used) // unit)) * unit",
        "    part = max(1, (lead + used) // unit) * unit",
        "part rounded down",
    ),
    Mutant(
        "G03",
        GRAD,
        "        if rest:",
        "        if rest and False:",
        "the last, partial chunk of a tensor is dropped",
    ),
    Mutant(
        "G04",
        GRAD,
        "    return [part.narrow(0, offset, layout.length(i, rank)) for i, offset in enumerate(layout.offsets)]",
        "    return [part.narrow(0, offset, layout.chunks[i]) for i, offset in enumerate(layout.offsets)]",
        "outputs not trimmed to the rank's partition",
    ),
    Mutant(
        "G05",
        LAYOUT,
        "        return valid_numel(self.numels[index], self.world, rank)",
        "        return min(self.chunks[index], valid_numel(self.numels[index], self.world, rank) + 1)",
        "partition length one too long at the end",
    ),
    Mutant(
        "G06",
        GRAD,
        "    if ranks != expected:",
        "    if len(ranks) != len(expected):",
        "group check: any group of as many ranks accepted",
        "ZeRO-3, the only user of this reducer, partitions over every rank wherever sdp4bit serves it, and there the "
        "only group of W ranks is the world (torch lists a group's ranks sorted)",
    ),
    Mutant("G07", LAYOUT, "    unit = group * slices", "    unit = group", "padding unit ignores the pipeline"),
    Mutant(
        "G08",
        ROUNDING,
        "        self.requant_stream = RoundingStream(seed, rank, STAGE_REQUANTIZE)",
        "        self.requant_stream = RoundingStream(seed, rank, STAGE_QUANTIZE)",
        "requantization reuses the quantization stage's random numbers",
    ),
    Mutant(
        "G09",
        GRAD,
        "        if topo.nodes > 1 and topo.ranks_per_node > 1:",
        "        if topo.nodes > 1:",
        "one rank per node takes the two-level path",
    ),
    Mutant(
        "G10",
        GRAD,
        "            self.stats.add_logical(kind, dests * layout.used * elem_size)",
        "            self.stats.add_logical(kind, dests * layout.part * elem_size)",
        "logical bytes include padding",
    ),
    Mutant(
        "G11",
        GRAD,
        "        seed, offset = self.quant_stream.take(flat.numel())",
        "        seed, offset = self.quant_stream.take(layout.part)",
        "quantization counter advances by one part",
    ),
    Mutant(
        "G12",
        LEVELS,
        "        pieces, intra, inter = self.topo.ranks_per_node, self.intra, self.inter",
        "        pieces, intra, inter = self.topo.nodes, self.intra, self.inter",
        "requantization sums `nodes` pieces instead of ranks per node",
    ),
    Mutant(
        "G13",
        GRAD,
        "            mul=1.0 / self.topo.world,",
        "            mul=1.0 / self.topo.nodes,",
        "mean over nodes instead of over all ranks (scale off)",
    ),
    Mutant(
        "G14",
        GRAD,
        "            lambda y: _Exchange(*_slice(codes, scales, level, run, y), group, self.stats, kind),",
        "            lambda y: _Exchange(*_slice(codes, scales, level, run, 0), group, self.stats, kind),",
        "one-level pipeline sends slice 0 every time",
    ),
    Mutant(
        "G15",
        GRAD,
        "            requantized = self._requantize(*intra.wait(), topo.nodes * layout.slice_len)",
        "            requantized = self._requantize(*intra.wait(), layout.world * layout.slice_len)",
        "requantization told the wrong length",
    ),
    Mutant(
        "G16",
        GRAD,
        '            return _Exchange(*requantized, topo.inter, self.stats, "grad_inter")',
        '            return _Exchange(*requantized, topo.intra, self.stats, "grad_inter")',
        "inter-node exchange over the intra-node group",
    ),
    Mutant(
        "G17",
        ROUNDING,
        '        self.requant_stream.load_state_dict(state["requantize"])',
        '        self.requant_stream.load_state_dict(state["requantize"])\n        self.requant_stream.counter = 0',
        "resume restarts the requantization counter",
    ),
    Mutant(
        "G18",
        ROUNDING,
        '        return {"quantize": self.quant_stream.state_dict(), "requantize": self.requant_stream.state_dict()}',
        '        return {"quantize": self.quant_stream.state_dict(), "requantize": self.quant_stream.state_dict()}',
        "checkpoint stores the quantization counter twice",
    ),
    Mutant(
        "G19",
        GRAD,
        (
            '            self._account(layout, flat.element_size(), ("grad_intra", layout.world), ("grad_inter", top'
            "o.nodes))"
        ),
        (
            '            self._account(layout, flat.element_size(), ("grad_intra", layout.world), ("grad_inter", lay'
            "out.world))"
        ),
        "inter-node logical bytes counted for W destinations",
    ),
    Mutant(
        "G20",
        GRAD,
        "            lambda exchange, y: self._finish(exchange, level, layout.world, dtype, layout.slice_valid(y)),",
        (
            "            lambda exchange, y: self._finish(exchange, level, layout.world - 1, dtype, layout.slice_va"
            "lid(y)),"
        ),
        "one-level reduction drops the last rank's piece",
    ),
    Mutant(
        "G21",
        GRAD,
        "    if len(dtypes) != 1 or not dtypes <= FLOAT_DTYPES:",
        "    if not dtypes <= FLOAT_DTYPES:",
        "tensors of mixed dtypes accepted",
    ),
    Mutant(
        "G22",
        GRAD,
        "        return [t.reshape(-1).clone() for t in tensors]",
        "        return [t.reshape(-1)[:1].clone() for t in tensors]",
        "one rank: outputs truncated",
    ),
    # collectives/weight_store.py
    Mutant(
        "W01",
        STORE,
        "        position = mix32((cols - first[block] + 0x9E3779B9) & MASK32)",
        "        position = mix32((cols * 0 + 0x9E3779B9) & MASK32)",
        "checksum blind to element positions",
    ),
    Mutant(
        "W02",
        STORE,
        "        block = torch.searchsorted(first, cols, right=True) - 1",
        "        block = torch.searchsorted(first, cols, right=False) - 1",
        "checksum: first column of each block counted in the previous one",
    ),
    Mutant(
        "W03",
        STORE,
        "        self._totals[segment] += per_shard",
        "        self._totals[segment] += per_shard + 1",
        "storage one column too wide per param",
    ),
    Mutant(
        "W04",
        STORE,
        "            apply(inflight.bucket, [Received(slice(0, self._slots), outs)])",
        "            apply(inflight.bucket, [Received(slice(0, self._slots), [out.roll(1, 0) for out in outs])])",
        "node replica: each node's run applied to the next slot",
    ),
    Mutant(
        "W05",
        STORE,
        '        return slot if self._replica == "rank" else self._topo.global_rank(slot, self._topo.local)',
        '        return slot if self._replica == "rank" else self._topo.global_rank(slot, 0)',
        "node replica: slot owner named wrongly",
    ),
    Mutant(
        "W06",
        STORE,
        "        if quantize:\n            pinned = self._pinned_values(params)",
        "        if True:\n            pinned = self._pinned_values(params)",
        "refresh(quantize=False) still quantizes",
    ),
    Mutant(
        "W07",
        STORE,
        "                or self._slots * (p.offset + p.shard_numel - run[0].offset) > self._bucket_numel",
        "                or self._slots * (p.offset + p.shard_numel - run[0].offset) > 2 * self._bucket_numel",
        "buckets twice as large as configured",
    ),
    Mutant(
        "W08",
        STORE,
        "                p.index != run[-1].index + 1\n                or p.segment != run[0].segment",
        "                p.segment != run[0].segment",
        "non-adjacent parameters share a bucket",
    ),
    Mutant(
        "W09",
        STORE,
        "        self._stats.add_logical(kind, self._logical(bucket))\n",
        "",
        "inter-node logical bytes not counted",
    ),
    Mutant(
        "W10",
        STORE,
        "            Received(slice(local, topo.world, per_node), [dst[local] for dst in full])",
        "            Received(slice(local * topo.nodes, (local + 1) * topo.nodes), [dst[local] for dst in full])",
        "rank replica: runs routed to the wrong slots",
    ),
    Mutant(
        "W11",
        STORE,
        "            pieces.append(new[p.key][:valid])\n            if valid < p.shard_numel:",
        "            pieces.append(new[p.key][:valid])\n            if valid < p.shard_numel and False:",
        "padding not zeroed in the sent run",
    ),
    Mutant(
        "W12",
        STORE,
        "        seed, offset = self._stream.take(bucket.numel)",
        "        seed, offset = self._stream.take(bucket.numel + 1)",
        "refresh counter advances one too far",
    ),
    Mutant(
        "W13",
        STORE,
        "                self._rows(batch.slots, bucket), codes, scales,",
        "                self._rows(slice(0, codes.shape[0]), bucket), codes, scales,",
        "every local index's deltas applied to the first slots",
    ),
    Mutant(
        "W14",
        STORE,
        "        if self._slots == self._topo.world:",
        '        if self._replica == "rank":',
        "one-rank-per-node node replica gathers over a group of one",
    ),
    Mutant(
        "W15",
        STORE,
        "            copy_rank_order(out, block.transpose(0, 1))",
        "            copy_rank_order(out, block)",
        "gathered shards in node-major order",
    ),
    Mutant(
        "W16",
        STORE,
        '        comm.all_reduce(low, holders, ReduceOp.MIN, "sdp4bit_weight_checksum", self._stats)',
        '        comm.all_reduce(low, holders, ReduceOp.MAX, "sdp4bit_weight_checksum", self._stats)',
        "checksum never differs",
    ),
    Mutant(
        "W17",
        STORE,
        "            flags[:, self._source(slot)] = differ[:, slot].to(torch.int32)",
        "            flags[:, slot] = differ[:, slot].to(torch.int32)",
        "checksum names the slot, not the owner",
    ),
    Mutant(
        "W18",
        STORE,
        '        self._stream.load_state_dict(state["rounding"])',
        "        return None",
        "rounding counter not restored",
    ),
    Mutant(
        "W19",
        STORE,
        '        if self._replica == "node" or per_node == 1:',
        '        if self._replica == "node":',
        "rank replica on one rank per node gathers inside a node of one",
    ),
    Mutant(
        "W20",
        STORE,
        "        return [self._own_values(bucket, new).to(self._dtype)]",
        "        return [self._own_values(bucket, new).to(torch.bfloat16).to(self._dtype)]",
        "resync values rounded through bf16",
    ),
    Mutant(
        "W21",
        STORE,
        "        if self._finish is None:\n            raise RuntimeError",
        "        if False:\n            raise RuntimeError",
        "a gather handle completes twice",
    ),
    Mutant(
        "W22",
        STORE,
        "        return ChecksumReport(ok=not mismatches, mismatches=mismatches, regions=len(params) * topo.world)",
        "        return ChecksumReport(ok=not mismatches, mismatches=mismatches[:1], regions=len(params) * topo.world)",
        "checksum names only the first mismatch",
    ),
    # zero3/runtime.py
    Mutant(
        "Z01",
        RUNTIME,
        "        return self.engine.global_steps >= self.config.start_step",
        "        return self.engine.global_steps > self.config.start_step",
        "quantization starts one step late",
    ),
    Mutant(
        "Z02",
        RUNTIME,
        '        quantize = self.quantizing() and not self._full("weight_refresh")',
        "        quantize = True",
        "weights quantized before the start step",
    ),
    Mutant(
        "Z03",
        SERVING3,
        "        reducer = self.runtime.active().reducer",
        "        reducer = self.runtime.reducer",
        "gradients quantized before the start step (the serving bypasses what serves now)",
    ),
    Mutant(
        "Z04",
        BUILD,
        (
            "        group_intra=cfg.gq_group_size_intra,\n"
            "        bits_inter=cfg.gradient_quantization_bits_inter,\n"
            "        group_inter=cfg.gq_group_size_inter,"
        ),
        (
            "        group_intra=cfg.gq_group_size_inter,\n"
            "        bits_inter=cfg.gradient_quantization_bits_inter,\n"
            "        group_inter=cfg.gq_group_size_intra,"
        ),
        "gradient group sizes swapped",
    ),
    Mutant(
        "Z05",
        BUILD,
        "        hadamard=cfg.hadamard_transform,",
        "        hadamard=False,",
        "Hadamard setting ignored",
    ),
    Mutant(
        "Z06",
        BUILD,
        "        pipeline=cfg.gradient_alltoall_pipeline,",
        "        pipeline=1,",
        "pipeline setting ignored",
    ),
    Mutant(
        "Z07",
        BUILD,
        "        hadamard=cfg.hadamard_transform,\n        stochastic=cfg.stochastic_rounding,\n        seed=cfg.seed,",
        "        hadamard=cfg.hadamard_transform,\n        stochastic=cfg.stochastic_rounding,\n        seed=0,",
        "gradient seed ignored",
    ),
    Mutant(
        "Z08",
        BUILD,
        "        bits_intra=cfg.gradient_quantization_bits_intra,",
        "        bits_intra=8,",
        "intra-node gradient bits fixed at 8",
    ),
    Mutant(
        "Z09",
        BUILD,
        (
            "        replica=replica,\n"
            "        bits=cfg.weight_quantization_bits,\n"
            "        group_size=cfg.wq_group_size,\n"
            "        stochastic=cfg.stochastic_rounding,"
        ),
        (
            "        replica=replica,\n"
            "        bits=cfg.weight_quantization_bits,\n"
            "        group_size=cfg.wq_group_size,\n"
            "        stochastic=not cfg.stochastic_rounding,"
        ),
        "weight rounding mode inverted",
    ),
    Mutant(
        "Z10",
        RUNTIME,
        "        units_module.write(self.units, self.weights.refresh(self.shards(), quantize=quantize))",
        "        self.weights.refresh(self.shards(), quantize=quantize)",
        "ds_tensor not set to w~ after a refresh",
    ),
    Mutant(
        "Z11",
        RUNTIME,
        "        if not report.ok:\n            self.checksum_mismatches += 1",
        "        if False:\n            self.checksum_mismatches += 1",
        "verify never repairs",
    ),
    Mutant(
        "Z12",
        RUNTIME,
        "        if interval and self.store is not None and not self.measuring() and "
        "self.optimizer_steps % interval == 0:",
        "        if interval and self.store is not None and not self.measuring() and "
        "self.optimizer_steps % interval == 1:",
        "verification on the wrong steps",
    ),
    Mutant(
        "W23",
        STORE,
        "        if self._snapshots is not None:\n            own.copy_(self._reference(bucket))",
        "        if False:\n            own.copy_(self._reference(bucket))",
        "attached store: the owner's deltas added to its new weights, not to its snapshot of w~",
    ),
    Mutant(
        "W24",
        STORE,
        "        if self._snapshots is not None:\n            self._reference(bucket).copy_(own)",
        "        if False:\n            self._reference(bucket).copy_(own)",
        "attached store: the snapshot of w~ not moved with the refresh",
    ),
    Mutant(
        "W25",
        STORE,
        "        if self._snapshots is None:\n            return self._bucket_view(self._own_slot, bucket)",
        "        if True:\n            return self._bucket_view(self._own_slot, bucket)",
        "attached store: differences taken against the new weights themselves",
    ),
    # collectives/owner_reduce.py
    Mutant(
        "O01",
        OWNER,
        "        if last is not None and last.owner == run.owner and last.start + last.numel == run.start:",
        "        if last is not None and last.owner == run.owner:",
        "runs of one owner joined across a gap",
    ),
    Mutant(
        "O02",
        OWNER,
        "        padded=tuple(round_up(length, unit) for length in lengths),",
        "        padded=tuple(max(unit, round_up(length, unit)) for length in lengths),",
        "ranks that own nothing of a bucket still get a padded piece",
    ),
    Mutant(
        "O03",
        OWNER,
        "        return padding_unit(self.intra.group, self.inter.group, self.pipeline)",
        "        return padding_unit(self.intra.group, self.inter.group, 1)",
        "pieces not padded to whole groups per pipeline slice",
    ),
    Mutant(
        "O04",
        LEVELS,
        "        seed, offset = self.requant_stream.take(numel)",
        "        seed, offset = self.requant_stream.take(0)",
        "requantization counter never advances",
    ),
    Mutant(
        "O05",
        OWNER,
        "        if highest != -negated_lowest:",
        "        if False:",
        "ranks with different layouts go on to the uneven exchanges",
    ),
    Mutant("O06", OWNER, "        return piece[: layout.lengths[rank]]", "        return piece", "padding delivered"),
    # zero12/serving.py
    Mutant(
        "S01",
        SERVING12,
        "            if e.owner == rank:",
        "            if True:",
        "every entry handed a slice of this rank's runs",
    ),
    Mutant(
        "S02",
        SERVING12,
        "        if self.runtime.active().store is None:\n            deepspeed()\n        self.runtime.after_step()",
        "        deepspeed()\n        self.runtime.after_step()",
        "DeepSpeed's weight all-gather still runs beside the refresh",
    ),
    Mutant(
        "S03",
        SERVING12,
        "        reducer = self.runtime.active().reducer",
        "        reducer = self.runtime.reducer",
        "gradients quantized before the start step (the serving bypasses what serves now)",
    ),
    # core/runtime.py, checked by the one-process tests of its rules
    Mutant(
        "U01",
        RUNTIME,
        "        if self.measuring():\n            return Active(gather=None, reducer=None, store=None)",
        "        if False:\n            return Active(gather=None, reducer=None, store=None)",
        "SDP4Bit serves while auto still times plain steps",
        target="runtime_rules",
    ),
    Mutant(
        "U02",
        RUNTIME,
        '            reducer=self.reducer if quantizing and not self._full("grad_intra") else None,',
        "            reducer=self.reducer,",
        "TLq serves before the start step",
        target="runtime_rules",
    ),
    Mutant(
        "U03",
        RUNTIME,
        "        direct = self.direct if quantizing else None",
        "        direct = self.direct",
        "qW serves gathers before the start step",
        target="runtime_rules",
    ),
    Mutant(
        "U04",
        RUNTIME,
        "        if step == self._writes_agreed_at:\n            self.watch.note()\n            return",
        "        if False:\n            self.watch.note()\n            return",
        "the ranks agree on outside writes at every forward, not once per step",
        target="runtime_rules",
    ),
    Mutant(
        "U05",
        RUNTIME,
        "        self.resync()\n        self._writes_agreed_at = None",
        "        self.resync()",
        "after a load the next forward of the same step does not look for writes",
        target="runtime_rules",
    ),
    Mutant(
        "U06",
        RUNTIME,
        "        if not decision.gradients:\n            self.reducer = None",
        "        if False:\n            self.reducer = None",
        "auto keeps the reducer it decided against",
        target="runtime_rules",
    ),
    Mutant(
        "U07",
        RUNTIME,
        "        if written:\n            self.resync(written)",
        "        if False:\n            self.resync(written)",
        "a write agreed on is not resynced",
        target="runtime_rules",
    ),
    # collectives/errors.py
    Mutant(
        "E01",
        ERRORS,
        "    for row in rows[1:]:\n        total = total + row",
        "    for row in rows[2:]:\n        total = total + row",
        "the requantized sum leaves out the second piece",
    ),
    Mutant(
        "E02",
        ERRORS,
        "        start, stop = first * group, min((first + count) * group, numel)",
        "        start, stop = first * group, min((first + count) * group, numel - 1)",
        "the window drops the run's last element",
    ),
    Mutant(
        "E03",
        ERRORS,
        "                self._unread[kind] = count if unread is None else unread + count",
        "                self._unread[kind] = unread",
        "a finished step's non-finite groups are dropped",
    ),
    Mutant(
        "E04",
        ERRORS,
        "    relative = torch.where(err == 0, torch.zeros_like(relative), relative)",
        "    relative = torch.where(ref == 0, torch.zeros_like(relative), relative)",
        "a group sent as zeros but received otherwise has no error",
    ),
    Mutant(
        "E05",
        ERRORS,
        "        whole = min(max(valid // codec.HADAMARD_BLOCK * codec.HADAMARD_BLOCK - start, 0), n)",
        "        whole = min(max(valid - start, 0), n)",
        "the block cut by the valid end is transformed too",
    ),
    # core/quality.py
    Mutant(
        "Q01",
        QUALITY,
        "            above = not seen.rel_error <= bound  # NaN counts as above",
        "            above = seen.rel_error > bound",
        "a NaN error never counts as above the bound",
    ),
    Mutant(
        "Q02",
        QUALITY,
        "            self.over[kind] = self.over[kind] + 1 if above else 0",
        "            self.over[kind] = self.over[kind] + 1 if above else self.over[kind]",
        "a sample under the bound does not reset the count",
    ),
    Mutant(
        "Q03",
        QUALITY,
        "    return 8 if width == 4 else None",
        "    return 8",
        "8 bits never widen to full precision",
    ),
    Mutant(
        "Q04",
        QUALITY,
        "            if (self.config.nonfinite and seen.nonfinite_groups) or self.over[kind] >= self.config.patience:",
        "            if self.over[kind] >= self.config.patience:",
        "non-finite values wait for the patience",
    ),
    # the parameters left whole on every tensor-parallel rank (zero12/replicated.py and its lanes), and the layout
    # of the partition group (topology.py)
    Mutant(
        "P01",
        REPLICATED,
        "            ranges.append(range(start, start + p.numel()))",
        "            ranges.append(range(start, start + p.numel() - 1))",
        "a replicated gradient's last element quantized",
        target="tensor_parallel",
    ),
    Mutant(
        "P02",
        REPLICATED,
        "        torch.arange(max(r.start, start) - start, min(r.stop, start + numel) - start, dtype=torch.int64)",
        "        torch.arange(max(r.start, start) - start, min(r.stop, start + numel) - start - 1, dtype=torch.int64)",
        "a chunk's replicated run loses its last element",
        target="tensor_parallel",
    ),
    Mutant(
        "P03",
        OWNER,
        "    for row in rows[1:]:",
        "    for row in rows[1:].flip(0):",
        "exact sums added in another order than group-rank order",
        target="tensor_parallel",
    ),
    Mutant(
        "P04",
        OWNER,
        "    sums = total.to(values.dtype)",
        "    sums = rows[0].clone()",
        "the exact lane delivers one rank's values, not the sum",
        target="tensor_parallel",
    ),
    Mutant(
        "P05",
        STORE,
        "            self._snapshots[segment][plan.own_columns] = own",
        "            pass",
        "the owner's snapshot keeps w~ at the pinned positions",
        target="tensor_parallel",
    ),
    Mutant(
        "P06",
        STORE,
        "            self._storages[segment].view(-1)[plan.positions] = received[plan.gathered]",
        "            self._storages[segment].view(-1)[plan.positions] = received[plan.gathered % plan.width]",
        "every slot's pinned values taken from rank 0's",
        target="tensor_parallel",
    ),
    Mutant(
        "P07",
        TOPOLOGY,
        "        inter += [list(group[local::per_node]) for local in range(per_node)]",
        "        inter += [list(group[local::per_node]) for local in range(1)]",
        "cross-node subgroups made for local index 0 only",
        target="topology",
    ),
    Mutant(
        "P08",
        TOPOLOGY,
        "        rank=members.index(rank),",
        "        rank=rank % len(members),",
        "the group rank taken from the world rank",
        target="topology",
    ),
    Mutant(
        "P09",
        TRAFFIC,
        "        off_node = layout.world - layout.per_node",
        "        off_node = layout.world - 1",
        "the exact gradient lane's senders on the owner's node counted as crossing",
        target="tensor_parallel",
    ),
    Mutant(
        "P10",
        TRAFFIC,
        "            wire = max(counts) * weight_bytes",
        "            wire = sum(counts) // len(counts) * weight_bytes",
        "the exact weight lane not padded to the fullest partition",
        target="tensor_parallel",
    ),
    # sdp4bit_cost/traffic.py
    Mutant(
        "C01",
        TRAFFIC,
        "    return rings * layout.nodes * (group - 1) * wire",
        "    return rings * layout.nodes * group * wire",
        "a ring all-gather sends every input across nodes",
    ),
    Mutant(
        "C02",
        TRAFFIC,
        '    return 2 * ring if backend == "gloo" else ring',
        "    return ring",
        "gloo's reduce-scatter counted as a ring",
    ),
    Mutant(
        "C03",
        TRAFFIC,
        "            w * wire * (n - 1) / n,",
        "            w * wire,",
        "the inter-node piece for the own node counted as crossing",
    ),
    Mutant(
        "C04",
        TRAFFIC,
        "    for n in reversed(numels):",
        "    for n in numels:",
        "gradient buckets filled in forward order",
    ),
    Mutant(
        "C05",
        LAYOUT,
        "    return codes_nbytes(numel, bits) + SCALE_BYTES * num_groups(numel, group_size)",
        "    return codes_nbytes(numel, bits) + SCALE_BYTES * (numel // group_size)",
        "a partial last group has no scale",
    ),
    Mutant(
        "C06",
        TRAFFIC,
        '            m = 1 if t.phase == "step" else grad_accum',
        "            m = grad_accum",
        "the optimizer step's transfers repeated per micro-batch",
    ),
    Mutant(
        "C07",
        TRAFFIC,
        "    w, n, d = layout.world, layout.nodes, layout.per_node\n    slices = 2 * s.pipeline",
        "    w, n, d = layout.world, layout.nodes, layout.per_node\n    slices = s.pipeline",
        "TLq's codes and scales counted as one collective per slice",
    ),
    # sdp4bit_cost/timing.py
    Mutant(
        "M01",
        TIMING,
        "        micro += max(busy, comm) if work.overlap else busy + comm",
        "        micro += busy + comm",
        "overlap ignored",
    ),
    Mutant(
        "M02",
        TIMING,
        "        m * micro + tail,",
        "        m * micro,",
        "the post-step refresh hidden",
    ),
    Mutant(
        "M03",
        TIMING,
        "    whole = step.per_optimizer_step(m)",
        "    whole = step.per_optimizer_step(1)",
        "micro-batches' bytes counted once per step",
    ),
    Mutant(
        "M04",
        TIMING,
        "            ring += inter + intra if rates.shared_links else max(inter, intra)",
        "            ring += max(inter, intra)",
        "links shared by the same cores taken as independent",
    ),
    Mutant(
        "M06",
        TIMING,
        "    latency = sum(t.calls.dot(rates.latency) for t in transfers)",
        "    latency = 0.0",
        "the collectives' latency left out",
    ),
    Mutant(
        "M05",
        TIMING,
        "    return max(0.0, 1.0 - live_parameters / (2 * numel)) if numel else 0.0",
        "    return max(0.0, 1.0 - live_parameters / numel) if numel else 0.0",
        "the backward keeps all live parameters, not half",
    ),
    # core/auto.py
    Mutant(
        "A01",
        AUTO,
        "        weights, gradients = min(good, key=lambda o: (sum(o), predicted[o]))",
        "        weights, gradients = min(good, key=lambda o: predicted[o])",
        "the fastest, not the fewest parts",
    ),
    Mutant(
        "A02",
        AUTO,
        "    dist.all_reduce(values, op=dist.ReduceOp.MAX)",
        "    dist.all_reduce(values, op=dist.ReduceOp.MIN)",
        "the fastest rank's numbers decide",
    ),
    Mutant(
        "A03",
        AUTO,
        (
            "        options = [\n"
            "            (w, g)\n"
            "            for w, g in itertools.product((False, True), repeat=2)\n"
            "            if (not w or self.candidates[0]) and (not g or self.candidates[1])\n"
            "        ]"
        ),
        "        options = [(w, g) for w, g in itertools.product((False, True), repeat=2)]",
        "parts the block does not switch on are considered",
    ),
    Mutant(
        "A04",
        AUTO,
        "        if step + 1 < self.start_step or len(self.step_ends) < 2:",
        "        if step < self.start_step or len(self.step_ends) < 2:",
        "the decision one step late",
    ),
    Mutant(
        "F01",
        FAULTS,
        "if r != rank and after[r] == before[r] and r not in failed]",
        "if r != rank and after[r] == before[r]]",
        "a rank that failed and exited is named silent",
    ),
    Mutant(
        "F02", FAULTS, "and after[r] == before[r] and", "and after[r] != before[r] and", "beating ranks named silent"
    ),
    Mutant(
        "F03",
        FAULTS,
        'isinstance(err, dist.DistError) or "gloo" in str(err)',
        "isinstance(err, dist.DistError)",
        "gloo's failures raised by a wait() not taken for a collective's",
    ),
    Mutant(
        "F04",
        FAULTS,
        'self.store.add(f"{BEAT_KEY}{self.rank}", 1)',
        'self.store.add(f"{BEAT_KEY}{self.rank}", 0)',
        "the heartbeat never advances",
    ),
]


def runs_in(mutant: Mutant, target: Target) -> bool:
    """Whether `target`'s selection runs `mutant`: the mutants naming a target run there only; a target that some
    mutant names runs those alone, the other targets of a file every unnamed mutant of it."""
    if mutant.target:
        return mutant.target == target.name
    return mutant.path == target.path and not any(m.target == target.name for m in MUTANTS)


def apply(clone: Path, mutant: Mutant) -> str:
    """Write the mutant into the clone; returns the original text of the file."""
    path = clone / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(f"{mutant.id}: the text to replace occurs {text.count(mutant.old)} times in {mutant.path}")
    path.write_text(text.replace(mutant.old, mutant.new))
    return text


def run_tests(clone: Path, tests: tuple[str, ...], timeout: float, env: dict[str, str]) -> tuple[str, float, str]:
    """('pass' | 'fail' | 'timeout', seconds, last lines) of pytest over `tests` in the clone."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-3:])
    return ("pass" if done.returncode == 0 else "fail"), time.monotonic() - start, tail


def scratch(work: Path | None) -> Path:
    """The empty folder this run clones into, created here: `work` (whose parent must exist), or a temporary one."""
    if work is None:
        return Path(tempfile.mkdtemp(prefix="sdp4bit-mutation-"))
    work.mkdir()
    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", default=",".join(TARGETS), help="comma-separated targets: " + ", ".join(TARGETS))
    parser.add_argument("--only", nargs="*", default=None, help="mutant ids to run (default: all of the files)")
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="scratch folder to create for the clone; must not exist yet (default: a fresh temporary folder)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch clone afterwards")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    unknown = [name for name in args.files.split(",") if name not in TARGETS]
    if unknown:
        parser.error(f"--files {','.join(unknown)}: not a target; choose from {', '.join(TARGETS)}")
    targets = [TARGETS[name] for name in args.files.split(",")]
    if args.work is not None and (args.work.exists() or args.work.is_symlink()):
        parser.error(
            f"--work {args.work}: it exists, and this run removes the folder it clones into; name a folder "
            "that does not exist yet (it is created here) or leave --work out for a fresh temporary one"
        )
    args.work = scratch(args.work)
    env = {
        **os.environ,
        "PYTHONPATH": str(args.work),
        "SDP4BIT_HYPOTHESIS_PROFILE": "ci",
        "TORCH_EXTENSIONS_DIR": str(args.work / ".torch_extensions"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    results = []
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(args.work)], check=True)
        for target in targets:
            status, baseline, tail = run_tests(args.work, target.tests, 3600, env)
            print(f"{target.name}: unmutated selection {status} in {baseline:.0f} s", flush=True)
            if status != "pass":
                raise SystemExit(f"{target.name}: the selection fails without a mutant:\n{tail}")
            for mutant in (m for m in MUTANTS if runs_in(m, target) and (args.only is None or m.id in args.only)):
                original = apply(args.work, mutant)
                try:
                    status, seconds, tail = run_tests(args.work, target.tests, 3 * baseline + 120, env)
                finally:
                    (args.work / mutant.path).write_text(original)
                outcome = "killed" if status != "pass" else "equivalent" if mutant.equivalent else "survived"
                results.append(
                    {
                        **asdict(mutant),
                        "target": target.name,
                        "outcome": outcome,
                        "status": status,
                        "seconds": round(seconds, 1),
                    }
                )
                print(f"{mutant.id} {outcome:8} {status:7} {seconds:6.0f} s  {mutant.what}", flush=True)
    finally:
        if args.keep:
            print(f"mutation: the scratch clone is kept in {args.work}", flush=True)
        else:
            shutil.rmtree(args.work, ignore_errors=True)
    print("\n| file | mutants | killed | survived | equivalent | score |\n|---|---|---|---|---|---|")
    for target in targets:
        mine = [r for r in results if r["target"] == target.name]
        counts = {kind: sum(r["outcome"] == kind for r in mine) for kind in ("killed", "survived", "equivalent")}
        if mine:
            score = 100 * counts["killed"] / max(1, len(mine) - counts["equivalent"])
            print(
                f"| {target.path} | {len(mine)} | {counts['killed']} | {counts['survived']} | "
                f"{counts['equivalent']} | {score:.0f}% |"
            )
    print("survivors:", [(r["id"], r["what"]) for r in results if r["outcome"] == "survived"])
    print("equivalent:", [(r["id"], r["equivalent"]) for r in results if r["outcome"] == "equivalent"])
    if args.json:
        write_result(args.json, {"mutants": results})


if __name__ == "__main__":
    main()
