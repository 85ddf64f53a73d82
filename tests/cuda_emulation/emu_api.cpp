// C entry points over the CUDA codec launchers for the host-emulated build (see emu.h), called through ctypes.
// Each mirrors one binding.cpp function after its checks: the same launcher, the same arguments.
#include <cstdint>

#include "codec_cuda.cuh"
#include "fast_div.cuh"

namespace {

using sdp4bit::gpu::CodesInput;
using sdp4bit::gpu::DType;
using sdp4bit::gpu::FloatInput;
using sdp4bit::gpu::QuantTarget;

QuantTarget target(uint8_t* codes, float* scales, int64_t numel, int bits, int group_size, bool stochastic,
                   uint32_t key, uint64_t offset) {
  return {codes, scales, numel, bits, group_size, stochastic, key, offset, 0, 1, 1, 1};
}

}  // namespace

extern "C" {

void emu_quantize(const void* x, int dtype, int64_t numel, uint8_t* codes, float* scales, int bits, int group_size,
                  bool stochastic, uint32_t key, uint64_t offset, int64_t valid, bool hadamard) {
  sdp4bit::gpu::launch_quantize({x, static_cast<DType>(dtype)}, valid, hadamard,
                                target(codes, scales, numel, bits, group_size, stochastic, key, offset), nullptr);
}

void emu_swizzle_quantize(const void* x, int dtype, int64_t numel, uint8_t* codes, float* scales, int bits,
                          int group_size, int64_t nodes, int64_t ranks_per_node, int64_t slices, bool stochastic,
                          uint32_t key, uint64_t offset, bool hadamard) {
  QuantTarget t = target(codes, scales, numel, bits, group_size, stochastic, key, offset);
  t.block_groups = numel / (nodes * ranks_per_node * slices) / group_size;
  t.nodes = nodes;
  t.ranks_per_node = ranks_per_node;
  t.slices = slices;
  sdp4bit::gpu::launch_quantize({x, static_cast<DType>(dtype)}, numel, hadamard, t, nullptr);
}

void emu_diff_quantize(const void* next, int next_dtype, const void* ref, int ref_dtype, int64_t numel,
                       uint8_t* codes, float* scales, int bits, int group_size, bool stochastic, uint32_t key,
                       uint64_t offset, int64_t valid) {
  sdp4bit::gpu::launch_diff_quantize({next, static_cast<DType>(next_dtype)}, {ref, static_cast<DType>(ref_dtype)},
                                     valid, target(codes, scales, numel, bits, group_size, stochastic, key, offset),
                                     nullptr);
}

void emu_dequantize_reduce_quantize(const uint8_t* codes, const float* scales, int64_t pieces, int64_t piece_numel,
                                    int in_bits, int in_group, uint8_t* out_codes, float* out_scales, int out_bits,
                                    int out_group, bool stochastic, uint32_t key, uint64_t offset) {
  sdp4bit::gpu::launch_dequantize_reduce_quantize(
      {codes, scales, in_bits, in_group}, pieces,
      target(out_codes, out_scales, piece_numel, out_bits, out_group, stochastic, key, offset), nullptr);
}

void emu_dequantize(const uint8_t* codes, const float* scales, int bits, int group_size, int64_t numel, void* out,
                    int dtype) {
  sdp4bit::gpu::launch_dequantize({codes, scales, bits, group_size}, numel, out, static_cast<DType>(dtype), nullptr);
}

void emu_dequantize_add(const uint8_t* codes, const float* scales, int bits, int group_size, int64_t numel, void* ref,
                        int dtype) {
  sdp4bit::gpu::launch_dequantize_add({codes, scales, bits, group_size}, numel, ref, static_cast<DType>(dtype),
                                      nullptr);
}

void emu_dequantize_reduce(const uint8_t* codes, const float* scales, int bits, int group_size, int64_t pieces,
                           int64_t piece_numel, void* out, int dtype, bool hadamard, double mul) {
  float factor = static_cast<float>(mul);
  if (hadamard) factor = factor * (1.0f / 32.0f);
  sdp4bit::gpu::launch_dequantize_reduce({codes, scales, bits, group_size}, pieces, piece_numel, out,
                                         static_cast<DType>(dtype), hadamard, factor, nullptr);
}

void emu_hadamard32(const void* x, int dtype, int64_t numel, float* out, bool inverse) {
  sdp4bit::gpu::launch_hadamard32({x, static_cast<DType>(dtype)}, numel, out, inverse, nullptr);
}

// Count of n in [first, first + count * stride) (step stride, wrapping at 2^32) where FastDiv(d) differs from n / d.
uint64_t emu_fastdiv_mismatches(uint32_t d, uint32_t first, uint64_t count, uint32_t stride) {
  const sdp4bit::gpu::FastDiv fd = sdp4bit::gpu::FastDiv::make(d);
  uint64_t bad = 0;
  uint32_t n = first;
  for (uint64_t i = 0; i < count; ++i, n += stride) {
    bad += (fd.div(n) != n / d) || (fd.mod(n) != n % d);
  }
  return bad;
}

}  // extern "C"
