"""The CPU codec op's DeepSpeed builder, and the codec dispatch that uses it.

Builds run in fresh interpreters (subprocesses) so that a fresh TORCH_EXTENSIONS_DIR takes effect and no op is
already loaded; the dispatch checks run in this process against the shared cache that conftest.py sets up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepspeed_sdp4bit import codec
from deepspeed_sdp4bit.ops import load_codec_op

ROOT = Path(__file__).resolve().parents[1]
FUNCTIONS = [
    "dequantize",
    "dequantize_add",
    "dequantize_reduce",
    "dequantize_reduce_quantize",
    "diff_quantize",
    "hadamard32",
    "quantize",
    "swizzle_quantize",
]


def _run(code: str, env: dict[str, str]) -> dict:
    """Run `code` in a fresh interpreter from the checkout; it prints one JSON object as its last line."""
    env = {k: v for k, v in env.items() if k != "SDP4BIT_CODEC_BACKEND"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # compiles the op from scratch
def test_cpu_op_compiles_into_a_fresh_cache_and_is_reused_from_any_environment(tmp_path: Path) -> None:
    """CodecCPUBuilder().load() JIT-compiles into an empty TORCH_EXTENSIONS_DIR and the op equals the reference;
    loading it again from an interpreter started another way (an activated venv, or system tools first on PATH,
    which brings a different ninja) reuses that build: the .so and the ninja log stay untouched.

    Where an install-time build exists (SDP4BIT_BUILD_OPS=1), load() must return it; the JIT build is then run
    explicitly, so the compile from sources is checked either way.
    """
    code = """
import json, time, torch
from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.codec.compiled import CompiledBackend
from deepspeed_sdp4bit.ops import CodecCPUBuilder
builder = CodecCPUBuilder()
start = time.time()
module = builder.load()
prebuilt = module.__name__ == builder.absolute_name()
if prebuilt:
    module = builder.jit_load(verbose=False)
seconds = time.time() - start
x = torch.randn(10_000)
kw = dict(bits=4, group_size=128, stochastic=True, seed=3, offset=2**32 - 100)
got = CompiledBackend(module, "cpu").quantize(x, **kw)
want = reference.quantize(x, **kw)
print(json.dumps({"file": module.__file__, "prebuilt": prebuilt, "seconds": round(seconds, 1),
                  "names": sorted(n for n in dir(module) if not n.startswith("_")),
                  "equal": torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])}))
"""
    cache = tmp_path / "ext"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache))
    result = _run(code, env)
    library = Path(result["file"])
    assert library.resolve().is_relative_to(cache.resolve()), result["file"]
    assert result["names"] == FUNCTIONS
    assert result["equal"]
    print(f"CPU codec op built in {result['seconds']} s (prebuilt module present: {result['prebuilt']})")

    built = (library.stat().st_mtime_ns, (library.parent / ".ninja_log").read_text())
    venv_bin = str(Path(sys.executable).parent)
    system_first = os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin", venv_bin])
    for name, path in (
        ("activated venv", os.pathsep.join([venv_bin, env["PATH"]])),
        ("system tools first", system_first),
    ):
        again = _run(code, {**env, "PATH": path})
        assert again["file"] == result["file"] and again["equal"], name
        assert (library.stat().st_mtime_ns, (library.parent / ".ninja_log").read_text()) == built, (
            f"loading from an {name} rebuilt the op"
        )
        print(f"loaded again ({name}) in {again['seconds']} s without a rebuild")


@pytest.mark.compat
def test_dispatch_picks_the_cpu_op_and_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SDP4BIT_CODEC_BACKEND", raising=False)
    x = torch.randn(3000)
    kw = dict(bits=8, group_size=256, stochastic=True, seed=17)
    assert codec.backend_name(x) == "cpu"
    compiled = codec.quantize(x, **kw)
    try:
        codec.set_backend("reference")
        assert codec.backend_name(x) == "reference"
        forced = codec.quantize(x, **kw)
        monkeypatch.setenv("SDP4BIT_CODEC_BACKEND", "")  # empty: as if unset
        assert codec.backend_name(x) == "reference"
        monkeypatch.setenv("SDP4BIT_CODEC_BACKEND", "auto")  # the variable wins over set_backend
        assert codec.backend_name(x) == "cpu"
        monkeypatch.delenv("SDP4BIT_CODEC_BACKEND")
    finally:
        codec.set_backend("auto")
    assert codec.backend_name(x) == "cpu"
    assert torch.equal(compiled[0], forced[0]) and torch.equal(compiled[1], forced[1])
    monkeypatch.setenv("SDP4BIT_CODEC_BACKEND", "reference")
    assert codec.backend_name(x) == "reference"
    monkeypatch.setenv("SDP4BIT_CODEC_BACKEND", "cuda")
    with pytest.raises(ValueError, match="'cuda' is forced but the tensor is on cpu"):
        codec.quantize(x, **kw)
    monkeypatch.setenv("SDP4BIT_CODEC_BACKEND", "fastest")
    with pytest.raises(ValueError, match="backend must be one of"):
        codec.quantize(x, **kw)


def test_unbuildable_op_falls_back_to_the_reference_with_one_warning(tmp_path: Path) -> None:
    """A builder whose source does not compile: one RuntimeWarning, then the reference for every call; forcing
    'cpu' then raises instead of silently running something else."""
    broken = tmp_path / "broken.cpp"
    broken.write_text('#error "this codec source is broken on purpose"\n')
    code = f"""
import json, warnings, torch
import deepspeed_sdp4bit.ops as ops
from deepspeed_sdp4bit import codec
from deepspeed_sdp4bit.codec import reference

class BrokenCPUBuilder(ops.CodecCPUBuilder):
    NAME = "sdp4bit_codec_cpu_broken"

    def sources(self):
        return [{str(broken)!r}]

ops.CodecCPUBuilder = BrokenCPUBuilder  # what load_codec_op('cpu') builds from now on
x = torch.randn(5000)
kw = dict(bits=4, group_size=128, stochastic=True, seed=1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    results = [codec.quantize(x, **kw) for _ in range(3)]
    name = codec.backend_name(x)
want = reference.quantize(x, **kw)
codec.set_backend("cpu")
try:
    codec.quantize(x, **kw)
    forced = "ran"
except RuntimeError as err:
    forced = str(err)
print(json.dumps({{"warnings": [f"{{w.category.__name__}}: {{w.message}}" for w in caught
                                if "codec op" in str(w.message)],
                  "backend": name, "forced": forced,
                  "equal": all(torch.equal(c, want[0]) and torch.equal(s, want[1]) for c, s in results)}}))
"""
    result = _run(code, dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")))
    assert len(result["warnings"]) == 1, result["warnings"]
    assert result["warnings"][0].startswith("RuntimeWarning: deepspeed_sdp4bit: the cpu codec op could not be built")
    assert result["backend"] == "reference"
    assert result["equal"]
    assert "codec backend 'cpu' is forced but could not be built" in result["forced"], result["forced"]


def test_cpu_op_checks_its_inputs() -> None:
    """The bindings refuse bad tensors and arguments themselves (direct callers bypass the Python adapter)."""
    op = load_codec_op("cpu")
    x = torch.randn(256)
    codes, scales = torch.empty(128, dtype=torch.uint8), torch.empty(2)
    good = (x, codes, scales, 4, 128, True, 5, 0, 256, False)

    def call(**change):
        args = list(good)
        for index, value in change.items():
            args[int(index[1:])] = value
        op.quantize(*args)

    call()
    cases = [
        (dict(a0=x.double()), "x dtype must be float32, bfloat16 or float16"),
        (dict(a0=torch.randn(512)[::2]), "x must be contiguous"),
        (dict(a0=torch.empty(256, device="meta")), "x must be a CPU tensor"),
        (dict(a1=torch.empty(127, dtype=torch.uint8)), "codes has 127 bytes, 256 elements at 4 bits need 128"),
        (dict(a1=torch.empty(128, dtype=torch.int8)), "codes must be uint8"),
        (dict(a2=torch.empty(3)), "scales has 3 entries"),
        (dict(a3=3), "bits must be 4 or 8, got 3"),
        (dict(a4=48), "group_size must be a multiple of 32 in \\[32, 8192\\], got 48"),
        (dict(a6=2**32), "key must be in \\[0, 2\\^32\\)"),
        (dict(a8=257), "valid must be in \\[0, 256\\], got 257"),
        (
            dict(a0=torch.randn(250), a1=torch.empty(125, dtype=torch.uint8), a8=250, a9=True),
            "hadamard needs a multiple of 32 elements, got 250",
        ),
    ]
    for change, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call(**change)
    with pytest.raises(RuntimeError, match="do not split into 3 pieces"):
        op.dequantize_reduce(codes, scales, 3, 4, 128, torch.empty(256), False, 1.0, 256)
    with pytest.raises(RuntimeError, match=r"valid must be in \[0, 128\] \(the elements of a piece\), got 129"):
        op.dequantize_reduce(codes, scales, 2, 4, 128, torch.empty(128), True, 1.0, 129)
    with pytest.raises(RuntimeError, match=r"valid must be in \[0, 128\] \(the elements of a partition\), got 129"):
        op.swizzle_quantize(x, codes, scales, 4, 128, 1, 2, 1, False, 0, 0, 129, False)
    with pytest.raises(RuntimeError, match="out must be float32"):
        op.hadamard32(x, torch.empty(256, dtype=torch.bfloat16), False)
