"""The CUDA codec op's DeepSpeed builder: compiles with nvcc where no GPU is visible, for the architectures both
nvcc and torch support unless TORCH_CUDA_ARCH_LIST names others (checked against nvcc before any compile); accepts
an nvcc of torch's CUDA major release; fails clearly where no toolkit is, finds the real toolkit behind a wrapper
nvcc; hands out only a module that holds code for the current GPU. On a GPU, the op runs on the current stream and
checks its inputs.

Bit-exactness on a GPU is covered by test_codec_backends.py (backend 'cuda'); the kernels' logic is also checked
on the CPU by test_codec_cuda_emulated.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension
from deepspeed.ops.op_builder import builder as ds_builder
from deepspeed.ops.op_builder.builder import OpBuilder

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
CUDA_FUNCTIONS = sorted([*FUNCTIONS, "compiled_archs", "device_error"])
NO_IMAGE = "cudaErrorNoKernelImageForDevice: no kernel image is available for execution on the device"
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
        "'archs': sorted(set(m.compiled_archs())), 'seconds': round(time.time() - t, 1)}))"
    )
    done = _run(code, env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["names"] == CUDA_FUNCTIONS
    assert result["archs"] == [900], "__CUDA_ARCH_LIST__ of a build for 9.0"
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


def test_nvcc_flags_keep_ieee_arithmetic_without_a_gpu(monkeypatch: pytest.MonkeyPatch, toolkit_root: Path) -> None:
    """The flags that bit-exactness depends on are there even when DeepSpeed builds 'for CPU' (no visible GPU)."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    builder = CodecCUDABuilder()
    builder.build_for_cpu = True
    args = builder.nvcc_args()
    for flag in ("-fmad=false", "-prec-div=true", "-ftz=false", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"):
        assert flag in args
    assert not {"--use_fast_math", "-use_fast_math", "-ffast-math"} & set(args + builder.cxx_args())


def _listed(nvcc: Path, flag: str) -> set[str]:
    """The plain names `nvcc --list-gpu-arch` (compute_XY) or `--list-gpu-code` (sm_XY) prints."""
    out = subprocess.run([str(nvcc), flag], capture_output=True, text=True, check=True).stdout
    return {name for name in out.split() if re.fullmatch(r"(sm|compute)_\d+", name)}


def _assert_nvcc_and_torch_archs(flags: list[str], nvcc: Path) -> None:
    """-gencode flags for every architecture both nvcc and this torch support, each one nvcc lists, and PTX for the
    newest only."""
    pairs = re.findall(r"-gencode=arch=(compute_\d+),code=((?:sm|compute)_\d+)", " ".join(flags))
    virtual, real = _listed(nvcc, "--list-gpu-arch"), _listed(nvcc, "--list-gpu-code")
    assert pairs and all(arch in virtual and code in real | virtual for arch, code in pairs), (flags, virtual)
    torch_names = torch.cuda.get_arch_list() or torch._C._cuda_getArchFlags().split()
    shared = {int(name[3:]) for name in real} & {int(name.split("_")[1]) for name in torch_names}
    built = sorted({int(code[3:]) for _, code in pairs if code.startswith("sm_")})
    assert built == sorted(shared)
    assert [code for _, code in pairs if code.startswith("compute_")] == [f"compute_{built[-1]}"]


@pytest.fixture
def no_gpu_no_arch_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_CUDA_ARCH_LIST unset (and put back after the test, whatever a build set it to) and no GPU visible."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "restored-after-the-test")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_install_time_build_without_arch_list_or_gpu_targets_what_nvcc_and_torch_share(
    tmp_path: Path, toolkit_root: Path
) -> None:
    """setup.py with SDP4BIT_BUILD_OPS=1 (setuptools' setup() stubbed: nothing compiles): the CUDA extension's
    -gencode flags are the architectures both nvcc and torch support, not DeepSpeed's 6.0;6.1;7.0 that nvcc 13
    refuses; setup.py loads the builders outside the package."""
    code = (
        "import json, runpy, setuptools\n"
        "captured = {}\n"
        "setuptools.setup = lambda **kw: captured.update(kw)\n"
        "runpy.run_path('setup.py')\n"
        "cuda = [e for e in captured['ext_modules'] if e.name.endswith('cuda_op')]\n"
        "print(json.dumps(cuda[0].extra_compile_args['nvcc'] if cuda else None))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"}
    env.update(SDP4BIT_BUILD_OPS="1", CUDA_VISIBLE_DEVICES="", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    done = _run(code, env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    flags = json.loads(done.stdout.strip().splitlines()[-1])
    assert flags is not None, "setup.py prebuilds the CUDA op where nvcc and a CUDA torch are found"
    _assert_nvcc_and_torch_archs(flags, toolkit_root / "bin" / "nvcc")


def test_jit_build_without_arch_list_or_gpu_targets_what_nvcc_and_torch_share(
    monkeypatch: pytest.MonkeyPatch, toolkit_root: Path, no_gpu_no_arch_list: None
) -> None:
    """DeepSpeed's JIT build up to the compile (torch's load stubbed): the -gencode flags torch derives are the
    architectures both nvcc and torch support (DeepSpeed alone stops with "found no CUDA devices")."""
    seen: dict[str, list[str]] = {}

    def load(name: str, extra_cuda_cflags: list[str], **_: object) -> SimpleNamespace:
        seen["flags"] = cpp_extension._get_cuda_arch_flags(extra_cuda_cflags)
        return SimpleNamespace(__file__=f"/cache/{name}.so")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    CodecCUDABuilder().jit_load(verbose=False)
    _assert_nvcc_and_torch_archs(seen["flags"], toolkit_root / "bin" / "nvcc")
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ, "the variable is left as the build found it"


@pytest.mark.parametrize("arch_list", ["6.0;9.0", "9.0 Hopper", "7.0+PTX"])
def test_an_arch_list_nvcc_cannot_build_is_refused_before_compiling(
    arch_list: str, monkeypatch: pytest.MonkeyPatch, toolkit_root: Path
) -> None:
    """TORCH_CUDA_ARCH_LIST naming an architecture this nvcc lacks: an error naming the variable, its value, the
    entry and the architectures nvcc builds, for a JIT build (before torch's load, so before nvcc) and setup.py's."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    monkeypatch.setattr(cpp_extension, "load", lambda **_: pytest.fail("nvcc ran"))
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    builds = sorted(int(name[3:]) for name in _listed(toolkit_root / "bin" / "nvcc", "--list-gpu-code"))
    accepted = ", ".join(f"{a // 10}.{a % 10}" for a in builds)
    bad = arch_list.replace(";", " ").split()[-1 if "Hopper" in arch_list else 0]
    for build in (CodecCUDABuilder().jit_load, CodecCUDABuilder().builder):
        with pytest.raises(RuntimeError) as err:
            build()
        message = str(err.value)
        assert f"TORCH_CUDA_ARCH_LIST={arch_list!r}" in message and repr(bad) in message, message
        assert f"it builds {accepted} " in message, message


@pytest.mark.parametrize("nvcc_cuda", [(13, 0), (13, 2), (13, 5)])
def test_an_nvcc_of_another_cuda_minor_release_is_accepted(
    nvcc_cuda: tuple[int, int], monkeypatch: pytest.MonkeyPatch, toolkit_root: Path
) -> None:
    """nvcc 13.x against a torch built with CUDA 13.0 (CUDA's minor-version compatibility): setup.py's extension is
    made (DeepSpeed's own check, whose table stops at CUDA 12, would raise) and the table is left as it was."""
    monkeypatch.setattr(ds_builder, "installed_cuda_version", lambda name="": nvcc_cuda)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    table = {major: list(minors) for major, minors in ds_builder.cuda_minor_mismatch_ok.items()}
    builder = CodecCUDABuilder()
    assert builder.is_compatible()
    extension = builder.builder()
    assert "-gencode=arch=compute_90,code=sm_90" in extension.extra_compile_args["nvcc"]
    assert ds_builder.cuda_minor_mismatch_ok == table


def test_an_nvcc_of_another_cuda_major_release_is_refused(monkeypatch: pytest.MonkeyPatch, toolkit_root: Path) -> None:
    """nvcc 12.9 against a torch built with CUDA 13.0: RuntimeError naming both, before anything is compiled, and
    is_compatible says why."""
    monkeypatch.setattr(ds_builder, "installed_cuda_version", lambda name="": (12, 9))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(cpp_extension, "load", lambda **_: pytest.fail("nvcc ran"))
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    builder = CodecCUDABuilder()
    want = "nvcc is CUDA 12.9 but torch .* was built with CUDA 13.0; install a CUDA 13.x toolkit"
    for build in (builder.load, builder.builder):
        with pytest.raises(RuntimeError, match=want):
            build()
    assert builder.is_compatible() is False and "CUDA 12.9" in builder.error_log


def _op_module(name: str, archs: list[int], error: str) -> SimpleNamespace:
    """A stand-in CUDA op module compiled for `archs` whose device check answers `error` ('' where it runs)."""
    return SimpleNamespace(
        __name__=name, __file__=f"/somewhere/{name}.so", compiled_archs=lambda: archs, device_error=lambda device: error
    )


@pytest.fixture
def on_an_a100(monkeypatch: pytest.MonkeyPatch) -> None:
    """A visible GPU of compute capability 8.0 as device 0, nothing loaded yet, TORCH_CUDA_ARCH_LIST=9.0, and the
    toolkit checks passed (the builds themselves are stand-ins)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setattr(CodecCUDABuilder, "check_buildable", lambda self: None)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")


def _provide(monkeypatch: pytest.MonkeyPatch, prebuilt: SimpleNamespace | None, jit: SimpleNamespace) -> None:
    """Make `prebuilt` the install-time build (none where None) and `jit` what a JIT build gives, cached as DeepSpeed
    caches it."""
    builder = CodecCUDABuilder()
    if prebuilt is not None:
        monkeypatch.setitem(sys.modules, builder.absolute_name(), prebuilt)
    monkeypatch.setattr(CodecCUDABuilder, "prebuilt_path", lambda self: prebuilt and prebuilt.__file__)

    def jit_load(self: CodecCUDABuilder, verbose: bool = True) -> SimpleNamespace:
        OpBuilder._loaded_ops[self.name] = jit
        return jit

    monkeypatch.setattr(CodecCUDABuilder, "jit_load", jit_load)


def test_a_prebuilt_op_without_code_for_the_gpu_is_replaced_by_a_jit_build(
    monkeypatch: pytest.MonkeyPatch, on_an_a100: None
) -> None:
    prebuilt = _op_module("deepspeed_sdp4bit.ops.sdp4bit_codec_cuda_op", [900], NO_IMAGE)
    jit = _op_module("sdp4bit_codec_cuda", [800], "")
    _provide(monkeypatch, prebuilt, jit)
    want = (
        r"the prebuilt sdp4bit_codec_cuda op at /somewhere/\S+ cannot run on CUDA device 0 \(compute capability "
        r"8\.0\): it was compiled for 9\.0 \(cudaErrorNoKernelImageForDevice.*\); building it just in time instead"
    )
    with pytest.warns(RuntimeWarning, match=want):
        assert CodecCUDABuilder().load() is jit
    assert OpBuilder._loaded_ops["sdp4bit_codec_cuda"] is jit


def test_a_prebuilt_op_with_code_for_the_gpu_is_used(monkeypatch: pytest.MonkeyPatch, on_an_a100: None) -> None:
    prebuilt = _op_module("deepspeed_sdp4bit.ops.sdp4bit_codec_cuda_op", [800, 900], "")
    _provide(monkeypatch, prebuilt, _op_module("sdp4bit_codec_cuda", [800], ""))
    assert CodecCUDABuilder().load() is prebuilt


def test_a_jit_op_without_code_for_the_gpu_raises_naming_the_archs(
    monkeypatch: pytest.MonkeyPatch, on_an_a100: None
) -> None:
    """The error names the GPU's compute capability, what the module was compiled for and TORCH_CUDA_ARCH_LIST; the
    module is not kept as the loaded op."""
    _provide(monkeypatch, None, _op_module("sdp4bit_codec_cuda", [900, 1000], NO_IMAGE))
    with pytest.raises(RuntimeError) as err:
        CodecCUDABuilder().load()
    message = str(err.value)
    for part in ("compute capability 8.0", "compiled for 9.0, 10.0", "TORCH_CUDA_ARCH_LIST is '9.0'", NO_IMAGE):
        assert part in message, message
    assert "sdp4bit_codec_cuda" not in OpBuilder._loaded_ops


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


@pytest.mark.gpu
@gpu
def test_gpu_the_loaded_op_holds_code_for_this_gpu(op: object) -> None:
    """The real device check of the op load() handed out: no error on this device, and the architectures it holds."""
    assert op.device_error(torch.cuda.current_device()) == ""
    assert op.compiled_archs()
    assert CodecCUDABuilder().device_problem(op) is None


@pytest.mark.gpu
@pytest.mark.slow  # compiles the op for another architecture
@gpu
def test_gpu_a_build_for_another_architecture_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The op compiled (without PTX) only for an architecture of another major release than this GPU's: the real
    check reports no kernel image, naming the GPU's compute capability and the architecture built."""
    major, minor = torch.cuda.get_device_capability()
    real = _listed(cuda_toolkit_root() / "bin" / "nvcc", "--list-gpu-code")
    other = min(int(name[3:]) for name in real if int(name[3:]) // 10 != major)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", f"{other // 10}.{other % 10}")
    builder = CodecCUDABuilder()
    builder.check_buildable()
    module = cpp_extension.load(
        name="sdp4bit_codec_cuda_other_arch",
        sources=builder.sources(),
        extra_include_paths=builder.include_paths(),
        extra_cflags=builder.cxx_args(),
        extra_cuda_cflags=builder.nvcc_args(),
        build_directory=str(tmp_path),
        verbose=False,
    )
    assert module.compiled_archs() == [other * 10]
    assert "cudaErrorNoKernelImageForDevice" in module.device_error(torch.cuda.current_device())
    problem = builder.device_problem(module)
    assert problem is not None and f"compute capability {major}.{minor}" in problem
    assert f"compiled for {other // 10}.{other % 10} " in problem
