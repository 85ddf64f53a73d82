"""The CUDA codec op's DeepSpeed builder: compiles with nvcc where no GPU is visible, fails clearly where no toolkit
is, finds the real toolkit behind a wrapper nvcc; on a GPU, the op runs on the current stream and checks its inputs.

Bit-exactness on a GPU is covered by test_codec_backends.py (backend 'cuda'); the kernels' logic is also checked
on the CPU by test_codec_cuda_emulated.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepspeed_sdp4bit.codec import reference as ref
from deepspeed_sdp4bit.ops.builder import CodecCUDABuilder, cuda_toolkit_root
from sdp4bit_testing import toolkit

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
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _toolkit() -> Path | None:
    try:
        return cuda_toolkit_root()
    except RuntimeError:
        return None


@pytest.fixture
def toolkit_root() -> Path:
    """The CUDA toolkit; without one (or without a CUDA build of torch) the test skips, or fails under
    SDP4BIT_REQUIRE_TOOLKIT=1 (CI)."""
    root = _toolkit()
    if root is None or torch.version.cuda is None:
        toolkit.missing("needs a CUDA toolkit (nvcc) and a CUDA build of torch")
    return root


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter from the checkout with `env` (nothing loaded or cached in this process)."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False
    )


@pytest.mark.slow  # compiles the op from scratch
def test_cuda_op_compiles_into_a_fresh_cache(tmp_path: Path, toolkit_root: Path) -> None:
    """JIT build through .load() with nvcc, TORCH_CUDA_ARCH_LIST=9.0, no GPU needed; the module has all functions."""
    env = dict(
        os.environ,
        TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
        TORCH_CUDA_ARCH_LIST="9.0",
        MAX_JOBS=os.environ.get("MAX_JOBS", "2"),
    )
    code = (
        "import json, time; t = time.time()\n"
        "from deepspeed_sdp4bit.ops import CodecCUDABuilder\n"
        "m = CodecCUDABuilder().load()\n"
        "print(json.dumps({'names': sorted(n for n in dir(m) if not n.startswith('_')), "
        "'seconds': round(time.time() - t, 1)}))"
    )
    done = _run(code, env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["names"] == FUNCTIONS
    assert list((tmp_path / "ext").glob("*/sdp4bit_codec_cuda*.so")), "the built module is in the fresh cache"
    print(f"CUDA codec op built in {result['seconds']} s")


def test_load_without_nvcc_raises_a_clear_error(tmp_path: Path) -> None:
    """CUDA_HOME without bin/nvcc and no nvcc on PATH: RuntimeError naming the cause, not a compiler crash."""
    env = dict(os.environ, CUDA_HOME=str(tmp_path), PATH="/usr/bin:/bin", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    code = (
        "from deepspeed_sdp4bit.ops import CodecCUDABuilder\n"
        "try:\n"
        "    CodecCUDABuilder().load()\n"
        "except RuntimeError as err:\n"
        "    print('ERROR:', err)\n"
        "else:\n"
        "    print('LOADED')\n"
    )
    done = _run(code, env)
    assert done.returncode == 0, done.stderr[-4000:]
    message = done.stdout.strip().splitlines()[-1]
    assert message.startswith("ERROR: cannot build the sdp4bit_codec_cuda op"), message
    assert "nvcc" in message or "CUDA support" in message, message
    assert not list(tmp_path.glob("ext/*")), "nothing was compiled"


def test_is_compatible_reports_a_missing_toolkit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    builder = CodecCUDABuilder()
    assert builder.is_compatible() is False
    assert "nvcc" in builder.error_log or "CUDA support" in builder.error_log


def test_toolkit_root_is_found_behind_a_wrapper_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, toolkit_root: Path
) -> None:
    """An nvcc on PATH that is a script exec'ing the real one (as /usr/local/bin/nvcc here) resolves to the toolkit."""
    real = toolkit_root
    assert (real / "bin" / "nvcc").is_file()
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {real / "bin" / "nvcc"} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{wrapper.parent}:{os.environ['PATH']}")
    assert cuda_toolkit_root() == real.resolve()


def test_cuda_home_without_nvcc_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="has no bin/nvcc"):
        cuda_toolkit_root()


def test_nvcc_flags_keep_ieee_arithmetic_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags that bit-exactness depends on are there even when DeepSpeed builds 'for CPU' (no visible GPU)."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    builder = CodecCUDABuilder()
    builder.build_for_cpu = True
    args = builder.nvcc_args()
    for flag in ("-fmad=false", "-prec-div=true", "-ftz=false", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"):
        assert flag in args
    assert not {"--use_fast_math", "-use_fast_math", "-ffast-math"} & set(args + builder.cxx_args())


@pytest.fixture(scope="module")
def op() -> object:
    return CodecCUDABuilder().load()


@pytest.mark.gpu
@gpu
def test_gpu_smoke_round_trip_on_a_side_stream(op: object) -> None:
    """quantize -> dequantize on a non-default stream, equal to the reference computed on the CPU."""
    from deepspeed_sdp4bit.codec.compiled import CompiledBackend

    backend = CompiledBackend(op, "cuda")
    x = torch.randn(100003, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        xd = x.cuda(non_blocking=False)
        codes, scales = backend.quantize(xd, bits=4, group_size=2048, stochastic=True, seed=1, offset=2)
        out = backend.dequantize(codes, scales, numel=x.numel(), bits=4, group_size=2048, dtype=torch.bfloat16)
    stream.synchronize()
    want_codes, want_scales = ref.quantize(x, bits=4, group_size=2048, stochastic=True, seed=1, offset=2)
    assert torch.equal(codes.cpu(), want_codes)
    assert torch.equal(scales.cpu(), want_scales)
    want = ref.dequantize(want_codes, want_scales, numel=x.numel(), bits=4, group_size=2048, dtype=torch.bfloat16)
    assert torch.equal(out.cpu(), want)


@pytest.mark.gpu
@gpu
def test_gpu_bindings_check_their_tensors(op: object) -> None:
    x = torch.randn(64, device="cuda")
    codes = torch.empty(32, dtype=torch.uint8, device="cuda")
    scales = torch.empty(2, dtype=torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="quantize: x must be a CUDA tensor"):
        op.quantize(x.cpu(), codes, scales, 4, 32, False, 0, 0, 64, False)
    with pytest.raises(RuntimeError, match="quantize: codes has 16 bytes"):
        op.quantize(x, codes[:16], scales, 4, 32, False, 0, 0, 64, False)
    with pytest.raises(RuntimeError, match="quantize: scales must be float32"):
        op.quantize(x, codes, scales.double(), 4, 32, False, 0, 0, 64, False)
    with pytest.raises(RuntimeError, match="quantize: group_size must be a multiple of 32"):
        op.quantize(x, codes, scales, 4, 48, False, 0, 0, 64, False)
    with pytest.raises(RuntimeError, match="dequantize: out dtype"):
        op.dequantize(codes, scales, torch.empty(64, dtype=torch.float64, device="cuda"), 4, 32)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        op.hadamard32(torch.randn(64, 2, device="cuda")[:, 0], torch.empty(64, device="cuda"), False)
