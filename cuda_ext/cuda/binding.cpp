// Python bindings of the CUDA codec: the same eight functions and argument orders as the CPU op (see
// deepspeed_sdp4bit/codec/compiled.py). Each checks every tensor (device, dtype, contiguity, size) with a message
// naming it, launches on the current stream of the input's device (codec_cuda.cu) and checks the launch. Outputs
// are allocated by the caller; nothing here allocates device memory or synchronises. Two more say what the kernels
// were compiled for and whether a device can run them (the loader's check, deepspeed_sdp4bit/ops/builder.py).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <string>
#include <vector>

#include "codec_cuda.cuh"
#include "sdp4bit_codec_math.h"

namespace {

namespace gpu = sdp4bit::gpu;

using sdp4bit::codes_nbytes;
using sdp4bit::kHadamard;
using sdp4bit::kMaxGroup;
using sdp4bit::kMinGroup;
using sdp4bit::num_groups;

constexpr int64_t kMaxSwizzleNumel = int64_t{1} << 37;

// A CUDA tensor on the same device as `first` (the call's first tensor).
void check_device(const at::Tensor& t, const char* name, const at::Tensor& first) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == first.device(), name, " is on ", t.device(), " but the first input is on ",
              first.device());
}

// A CUDA tensor, contiguous, on the same device as `first` (the call's first tensor).
void check_tensor(const at::Tensor& t, const char* name, const at::Tensor& first) {
  check_device(t, name, first);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// A CUDA tensor on the same device as `first`, 2-D, each row contiguous (at any stride between rows).
void check_rows_tensor(const at::Tensor& t, const std::string& name, const at::Tensor& first) {
  check_device(t, name.c_str(), first);
  TORCH_CHECK(t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1), name,
              " must be 2-D with contiguous rows, got shape ", t.sizes(), " with strides ", t.strides());
}

gpu::DType float_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return gpu::DType::kFloat32;
    case at::kBFloat16:
      return gpu::DType::kBFloat16;
    case at::kHalf:
      return gpu::DType::kFloat16;
    default:
      TORCH_CHECK(false, name, " dtype ", t.scalar_type(), " is not one of float32, bfloat16, float16");
  }
}

void check_bits(int64_t bits, const char* name) {
  TORCH_CHECK(bits == 4 || bits == 8, name, " must be 4 or 8, got ", bits);
}

void check_group(int64_t group_size, const char* name) {
  TORCH_CHECK(group_size % kMinGroup == 0 && group_size >= kMinGroup && group_size <= kMaxGroup, name,
              " must be a multiple of ", kMinGroup, " in [", kMinGroup, ", ", kMaxGroup, "], got ", group_size);
}

// uint8 codes and fp32 scales sized exactly for `numel` elements at `bits` in groups of `group_size`.
void check_codes(const at::Tensor& codes, const at::Tensor& scales, int64_t numel, int64_t bits, int64_t group_size,
                 const at::Tensor& first, const char* codes_name, const char* scales_name) {
  check_tensor(codes, codes_name, first);
  check_tensor(scales, scales_name, first);
  TORCH_CHECK(codes.scalar_type() == at::kByte, codes_name, " must be uint8, got ", codes.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, scales_name, " must be float32, got ", scales.scalar_type());
  TORCH_CHECK(codes.numel() == codes_nbytes(numel, bits), codes_name, " has ", codes.numel(), " bytes; ", numel,
              " elements at ", bits, " bits need ", codes_nbytes(numel, bits));
  TORCH_CHECK(scales.numel() == num_groups(numel, group_size), scales_name, " has ", scales.numel(), " entries; ",
              numel, " elements in groups of ", group_size, " need ", num_groups(numel, group_size));
}

uint32_t check_key(int64_t key) {
  TORCH_CHECK(key >= 0 && key <= 0xFFFFFFFFLL, "key must be a 32-bit unsigned value (spec.seed_key), got ", key);
  return static_cast<uint32_t>(key);
}

// Elements per piece of a buffer of `pieces` equal pieces of whole groups (spec.pieces_numel).
int64_t piece_numel(const at::Tensor& codes, int64_t pieces, int64_t bits, int64_t group_size, const char* what) {
  const int64_t total = codes.numel() * 8 / bits;
  TORCH_CHECK(pieces >= 1 && total % pieces == 0 && (total / pieces) % group_size == 0, what, ": ", total,
              " elements do not split into ", pieces, " pieces of whole ", group_size, "-groups");
  return total / pieces;
}

gpu::QuantTarget target(const at::Tensor& codes, const at::Tensor& scales, int64_t numel, int64_t bits,
                        int64_t group_size, bool stochastic, int64_t key, int64_t offset) {
  return {codes.data_ptr<uint8_t>(),
          scales.data_ptr<float>(),
          numel,
          static_cast<int>(bits),
          static_cast<int>(group_size),
          stochastic,
          check_key(key),
          static_cast<uint64_t>(offset),
          0,
          1,
          1,
          1};
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void quantize(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
              int64_t group_size, bool stochastic, int64_t key, int64_t offset, int64_t valid, bool hadamard) {
  check_tensor(x, "quantize: x", x);
  const gpu::DType dtype = float_dtype(x, "quantize: x");
  check_bits(bits, "quantize: bits");
  check_group(group_size, "quantize: group_size");
  const int64_t numel = x.numel();
  TORCH_CHECK(valid >= 0 && valid <= numel, "quantize: valid must be in [0, ", numel, "], got ", valid);
  TORCH_CHECK(!hadamard || numel % kHadamard == 0, "quantize: hadamard needs a multiple of ", kHadamard,
              " elements, got ", numel);
  check_codes(codes, scales, numel, bits, group_size, x, "quantize: codes", "quantize: scales");
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  gpu::launch_quantize({x.data_ptr(), dtype}, 0, valid, hadamard,
                       target(codes, scales, numel, bits, group_size, stochastic, key, offset), stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void diff_quantize(const at::Tensor& next, const at::Tensor& ref, const at::Tensor& codes, const at::Tensor& scales,
                   int64_t bits, int64_t group_size, bool stochastic, int64_t key, int64_t offset, int64_t valid) {
  check_tensor(next, "diff_quantize: new", next);
  check_tensor(ref, "diff_quantize: ref", next);
  const gpu::DType next_dtype = float_dtype(next, "diff_quantize: new");
  const gpu::DType ref_dtype = float_dtype(ref, "diff_quantize: ref");
  check_bits(bits, "diff_quantize: bits");
  check_group(group_size, "diff_quantize: group_size");
  const int64_t numel = next.numel();
  TORCH_CHECK(ref.numel() == numel, "diff_quantize: new has ", numel, " elements, ref has ", ref.numel());
  TORCH_CHECK(valid >= 0 && valid <= numel, "diff_quantize: valid must be in [0, ", numel, "], got ", valid);
  check_codes(codes, scales, numel, bits, group_size, next, "diff_quantize: codes", "diff_quantize: scales");
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(next.device());
  gpu::launch_diff_quantize({next.data_ptr(), next_dtype}, {ref.data_ptr(), ref_dtype}, valid,
                            target(codes, scales, numel, bits, group_size, stochastic, key, offset), stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void swizzle_quantize(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                      int64_t group_size, int64_t nodes, int64_t ranks_per_node, int64_t slices, bool stochastic,
                      int64_t key, int64_t offset, int64_t valid, bool hadamard) {
  check_tensor(x, "swizzle_quantize: x", x);
  const gpu::DType dtype = float_dtype(x, "swizzle_quantize: x");
  check_bits(bits, "swizzle_quantize: bits");
  check_group(group_size, "swizzle_quantize: group_size");
  TORCH_CHECK(nodes >= 1 && ranks_per_node >= 1 && slices >= 1, "swizzle_quantize: nodes ", nodes,
              ", ranks_per_node ", ranks_per_node, " and slices ", slices, " must be >= 1");
  const int64_t numel = x.numel();
  TORCH_CHECK(numel < kMaxSwizzleNumel, "swizzle_quantize: at most 2^37 - 1 elements (32-bit group indices), got ",
              numel);
  const int64_t blocks = nodes * ranks_per_node * slices;
  TORCH_CHECK(numel % blocks == 0, "swizzle_quantize: ", numel, " elements do not split into ",
              nodes * ranks_per_node, " partitions x ", slices, " slices");
  const int64_t block = numel / blocks;
  TORCH_CHECK(block % group_size == 0 && block % kHadamard == 0, "swizzle_quantize: block of ", block,
              " elements is not a multiple of group_size ", group_size, " and of ", kHadamard);
  const int64_t partition = block * slices;
  TORCH_CHECK(valid >= 0 && valid <= partition, "swizzle_quantize: valid must be in [0, ", partition,
              "] (the elements of a partition), got ", valid);
  check_codes(codes, scales, numel, bits, group_size, x, "swizzle_quantize: codes", "swizzle_quantize: scales");
  if (numel == 0) return;
  gpu::QuantTarget t = target(codes, scales, numel, bits, group_size, stochastic, key, offset);
  t.block_groups = block / group_size;
  t.nodes = nodes;
  t.ranks_per_node = ranks_per_node;
  t.slices = slices;
  const c10::cuda::CUDAGuard guard(x.device());
  gpu::launch_quantize({x.data_ptr(), dtype}, partition, valid, hadamard, t, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_reduce_quantize(const at::Tensor& codes, const at::Tensor& scales, int64_t pieces, int64_t in_bits,
                                int64_t in_group, const at::Tensor& out_codes, const at::Tensor& out_scales,
                                int64_t out_bits, int64_t out_group, bool stochastic, int64_t key, int64_t offset) {
  check_bits(in_bits, "dequantize_reduce_quantize: in_bits");
  check_group(in_group, "dequantize_reduce_quantize: in_group");
  check_bits(out_bits, "dequantize_reduce_quantize: out_bits");
  check_group(out_group, "dequantize_reduce_quantize: out_group");
  check_tensor(codes, "dequantize_reduce_quantize: codes", codes);
  const int64_t numel = piece_numel(codes, pieces, in_bits, in_group, "dequantize_reduce_quantize");
  check_codes(codes, scales, numel * pieces, in_bits, in_group, codes, "dequantize_reduce_quantize: codes",
              "dequantize_reduce_quantize: scales");
  TORCH_CHECK(numel % out_group == 0, "dequantize_reduce_quantize: piece of ", numel,
              " elements is not a multiple of out_group ", out_group);
  check_codes(out_codes, out_scales, numel, out_bits, out_group, codes, "dequantize_reduce_quantize: out_codes",
              "dequantize_reduce_quantize: out_scales");
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(codes.device());
  gpu::launch_dequantize_reduce_quantize(
      {codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), static_cast<int>(in_bits), static_cast<int>(in_group)},
      pieces, target(out_codes, out_scales, numel, out_bits, out_group, stochastic, key, offset), stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The runs of `op`'s decode into `dst` (named `dst_name`): for codes that are not 2-D one run over all of dst
// (contiguous); for codes [rows, codes_nbytes(n)] one per row of dst [rows, n] (rows that do not overlap) and of scales
// [rows, num_groups(n)], each of the three with contiguous rows at any stride between them.
gpu::Rows decode_rows(const std::string& op, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& dst,
                      const char* dst_name, int64_t bits, int64_t group_size, const at::Tensor& first) {
  const std::string codes_name = op + ": codes";
  const std::string scales_name = op + ": scales";
  const std::string values_name = op + ": " + dst_name;
  if (codes.dim() != 2) {
    check_tensor(dst, values_name.c_str(), first);
    check_codes(codes, scales, dst.numel(), bits, group_size, first, codes_name.c_str(), scales_name.c_str());
    return {1, dst.numel(), 0, 0, 0};
  }
  check_rows_tensor(dst, values_name, first);
  check_rows_tensor(codes, codes_name, first);
  check_rows_tensor(scales, scales_name, first);
  const int64_t rows = codes.size(0);
  const int64_t n = dst.size(1);
  TORCH_CHECK(dst.size(0) == rows && (rows <= 1 || dst.stride(0) >= n), values_name,
              " must be [rows, n] with rows that do not overlap for codes of ", rows, " rows, got shape ", dst.sizes(),
              " with strides ", dst.strides());
  TORCH_CHECK(codes.scalar_type() == at::kByte, codes_name, " must be uint8, got ", codes.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, scales_name, " must be float32, got ", scales.scalar_type());
  TORCH_CHECK(codes.size(1) == codes_nbytes(n, bits), codes_name, " must be [rows, codes_nbytes(n)] = [", rows, ", ",
              codes_nbytes(n, bits), "] for rows of ", n, " elements at ", bits, " bits, got ", codes.sizes());
  TORCH_CHECK(scales.size(0) == rows && scales.size(1) == num_groups(n, group_size), scales_name,
              " must be [rows, num_groups(n)] = [", rows, ", ", num_groups(n, group_size), "] for rows of ", n,
              " elements in groups of ", group_size, ", got ", scales.sizes());
  return {rows, n, codes.stride(0), scales.stride(0), dst.stride(0)};
}

void dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& out, int64_t bits,
                int64_t group_size) {
  check_bits(bits, "dequantize: bits");
  check_group(group_size, "dequantize: group_size");
  const gpu::Rows rows = decode_rows("dequantize", codes, scales, out, "out", bits, group_size, codes);
  const gpu::DType dtype = float_dtype(out, "dequantize: out");
  if (rows.count == 0 || rows.numel == 0) return;
  const c10::cuda::CUDAGuard guard(codes.device());
  gpu::launch_dequantize(
      {codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), static_cast<int>(bits), static_cast<int>(group_size)},
      rows, out.data_ptr(), dtype, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_add(const at::Tensor& ref, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                    int64_t group_size) {
  check_device(ref, "dequantize_add: ref", ref);
  const gpu::DType dtype = float_dtype(ref, "dequantize_add: ref");
  check_bits(bits, "dequantize_add: bits");
  check_group(group_size, "dequantize_add: group_size");
  const gpu::Rows rows = decode_rows("dequantize_add", codes, scales, ref, "ref", bits, group_size, ref);
  if (rows.count == 0 || rows.numel == 0) return;
  const c10::cuda::CUDAGuard guard(ref.device());
  gpu::launch_dequantize_add(
      {codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), static_cast<int>(bits), static_cast<int>(group_size)},
      rows, ref.data_ptr(), dtype, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_reduce(const at::Tensor& codes, const at::Tensor& scales, int64_t pieces, int64_t bits,
                       int64_t group_size, const at::Tensor& out, bool hadamard, double mul, int64_t valid) {
  check_bits(bits, "dequantize_reduce: bits");
  check_group(group_size, "dequantize_reduce: group_size");
  check_tensor(codes, "dequantize_reduce: codes", codes);
  const int64_t numel = piece_numel(codes, pieces, bits, group_size, "dequantize_reduce");
  check_codes(codes, scales, numel * pieces, bits, group_size, codes, "dequantize_reduce: codes",
              "dequantize_reduce: scales");
  check_tensor(out, "dequantize_reduce: out", codes);
  const gpu::DType dtype = float_dtype(out, "dequantize_reduce: out");
  TORCH_CHECK(out.numel() == numel, "dequantize_reduce: out has ", out.numel(), " elements, a piece has ", numel);
  TORCH_CHECK(valid >= 0 && valid <= numel, "dequantize_reduce: valid must be in [0, ", numel,
              "] (the elements of a piece), got ", valid);
  if (numel == 0) return;
  // As the reference: fp32(mul), times 1/32 in fp32 for the blocks whose Hadamard transform is undone.
  const float plain = static_cast<float>(mul);
  const float transformed = plain * (1.0f / static_cast<float>(kHadamard));
  const c10::cuda::CUDAGuard guard(codes.device());
  gpu::launch_dequantize_reduce(
      {codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), static_cast<int>(bits), static_cast<int>(group_size)},
      pieces, numel, out.data_ptr(), dtype, hadamard ? valid : 0, transformed, plain, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void hadamard32(const at::Tensor& x, const at::Tensor& out, bool inverse) {
  check_tensor(x, "hadamard32: x", x);
  const gpu::DType dtype = float_dtype(x, "hadamard32: x");
  check_tensor(out, "hadamard32: out", x);
  TORCH_CHECK(out.scalar_type() == at::kFloat, "hadamard32: out must be float32, got ", out.scalar_type());
  const int64_t numel = x.numel();
  TORCH_CHECK(numel % kHadamard == 0, "hadamard32 needs a multiple of ", kHadamard, " elements, got ", numel);
  TORCH_CHECK(out.numel() == numel, "hadamard32: out has ", out.numel(), " elements, x has ", numel);
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  gpu::launch_hadamard32({x.data_ptr(), dtype}, numel, out.data_ptr<float>(), inverse, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::vector<int> compiled_archs() { return gpu::compiled_archs(); }

// Empty where CUDA device `device` can run the kernels, else the CUDA runtime's error (codec_cuda.cu).
std::string device_error(int64_t device) {
  TORCH_CHECK(device >= 0, "device_error: device must be a CUDA device index, got ", device);
  const c10::cuda::CUDAGuard guard(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  return gpu::kernel_image_error();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "SDP4Bit quantization codec, CUDA kernels (bit-identical to deepspeed_sdp4bit.codec.reference)";
  m.def("quantize", &quantize, "Groupwise abs-max quantization into preallocated codes and scales", py::arg("x"),
        py::arg("codes"), py::arg("scales"), py::arg("bits"), py::arg("group_size"), py::arg("stochastic"),
        py::arg("key"), py::arg("offset"), py::arg("valid"), py::arg("hadamard"));
  m.def("diff_quantize", &diff_quantize, "Quantize fp32(new) - fp32(ref) in one pass", py::arg("new"),
        py::arg("ref"), py::arg("codes"), py::arg("scales"), py::arg("bits"), py::arg("group_size"),
        py::arg("stochastic"), py::arg("key"), py::arg("offset"), py::arg("valid"));
  m.def("swizzle_quantize", &swizzle_quantize, "Quantize into the two-level all-to-all layout", py::arg("x"),
        py::arg("codes"), py::arg("scales"), py::arg("bits"), py::arg("group_size"), py::arg("nodes"),
        py::arg("ranks_per_node"), py::arg("slices"), py::arg("stochastic"), py::arg("key"), py::arg("offset"),
        py::arg("valid"), py::arg("hadamard"));
  m.def("dequantize_reduce_quantize", &dequantize_reduce_quantize,
        "Sum quantized pieces in fp32 and quantize the sum again", py::arg("codes"), py::arg("scales"),
        py::arg("pieces"), py::arg("in_bits"), py::arg("in_group"), py::arg("out_codes"), py::arg("out_scales"),
        py::arg("out_bits"), py::arg("out_group"), py::arg("stochastic"), py::arg("key"), py::arg("offset"));
  m.def("dequantize", &dequantize, "Codes and scales to values of out's dtype", py::arg("codes"), py::arg("scales"),
        py::arg("out"), py::arg("bits"), py::arg("group_size"));
  m.def("dequantize_add", &dequantize_add, "ref += dequantized delta, one rounding to ref's dtype", py::arg("ref"),
        py::arg("codes"), py::arg("scales"), py::arg("bits"), py::arg("group_size"));
  m.def("dequantize_reduce", &dequantize_reduce, "Sum quantized pieces, optional inverse Hadamard, scale, cast",
        py::arg("codes"), py::arg("scales"), py::arg("pieces"), py::arg("bits"), py::arg("group_size"),
        py::arg("out"), py::arg("hadamard"), py::arg("mul"), py::arg("valid"));
  m.def("hadamard32", &hadamard32, "Walsh-Hadamard transform of every 32-block, in fp32", py::arg("x"),
        py::arg("out"), py::arg("inverse"));
  m.def("compiled_archs", &compiled_archs,
        "Architectures the kernels were compiled for, as __CUDA_ARCH__ values (900 for 9.0); none for a host build");
  m.def("device_error", &device_error,
        "Empty where the CUDA device can run the kernels, else the CUDA error (no kernel image for its architecture)",
        py::arg("device"));
}
