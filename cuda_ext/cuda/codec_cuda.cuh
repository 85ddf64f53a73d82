// Launchers of the CUDA codec kernels: plain pointers, sizes and a stream, no torch types; and what the kernels were
// compiled for, and whether the current device can run them.
//
// binding.cpp validates the tensors and calls these; codec_cuda.cu implements them. Keeping torch out of the
// .cu file keeps the nvcc part of the build short. Every launcher enqueues its kernels on `stream` and returns
// without synchronising; the caller checks the launch (C10_CUDA_KERNEL_LAUNCH_CHECK).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

namespace sdp4bit::gpu {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// A contiguous float input of one of the three codec dtypes.
struct FloatInput {
  const void* data;
  DType dtype;
};

// Packed codes and their fp32 group scales.
struct CodesInput {
  const uint8_t* codes;
  const float* scales;
  int bits;
  int group_size;
};

// Where and how a quantizing kernel writes its groups. With block_groups > 0 the output is the swizzled layout:
// input groups come in blocks of block_groups groups, block z * slices + y going to output block
// sdp4bit::swizzled_block(z, y, nodes, ranks_per_node); with block_groups == 0 the order is unchanged.
struct QuantTarget {
  uint8_t* codes;
  float* scales;
  int64_t numel;  // encoded elements; codes holds codes_nbytes(numel, bits) bytes
  int bits;
  int group_size;
  bool stochastic;
  uint32_t key;
  uint64_t offset;
  int64_t block_groups;
  int64_t nodes;
  int64_t ranks_per_node;
  int64_t slices;
};

// Quantize x[0, t.numel), optionally Hadamard-transformed first. x is made of partitions of `partition` elements
// (0: one partition, the whole buffer); elements of a partition at index >= valid are read as zero, and the
// transform applies to the 32-blocks lying wholly below valid.
void launch_quantize(FloatInput x, int64_t partition, int64_t valid, bool hadamard, const QuantTarget& t,
                     cudaStream_t stream);

// Quantize fp32(new) - fp32(ref) over t.numel elements; elements at index >= valid read neither input.
void launch_diff_quantize(FloatInput next, FloatInput ref, int64_t valid, const QuantTarget& t, cudaStream_t stream);

// Sum `pieces` consecutive pieces of t.numel elements each (in fp32, piece 0 first) and quantize the sum into t.
void launch_dequantize_reduce_quantize(CodesInput in, int64_t pieces, const QuantTarget& t, cudaStream_t stream);

// The runs of a decoding launch: `count` rows of `numel` elements each, each its own run (group tiling from its first
// element, a partial last group); row r's codes, scales and values start r times `codes` bytes, `scales` entries and
// `values` elements after row 0's. A 1-D call is one row.
struct Rows {
  int64_t count;
  int64_t numel;
  int64_t codes;
  int64_t scales;
  int64_t values;
};

// out[r][i] = dtype(fp32(q_ri) * scale) for every row r and i < rows.numel.
void launch_dequantize(CodesInput in, Rows rows, void* out, DType out_dtype, cudaStream_t stream);

// ref[r][i] = dtype(fp32(q_ri) * scale + fp32(ref[r][i])) for every row r and i < rows.numel, in place.
void launch_dequantize_add(CodesInput in, Rows rows, void* ref, DType ref_dtype, cudaStream_t stream);

// out = dtype(H(sum of pieces) * transformed) on the 32-blocks lying wholly below `inverse_below`, and
// dtype(sum of pieces * plain) on the others, over piece_numel elements (a multiple of 32).
void launch_dequantize_reduce(CodesInput in, int64_t pieces, int64_t piece_numel, void* out, DType out_dtype,
                              int64_t inverse_below, float transformed, float plain, cudaStream_t stream);

// out = fp32 Walsh-Hadamard transform of every 32-block of x (numel a multiple of 32), times 1/32 if inverse.
void launch_hadamard32(FloatInput x, int64_t numel, float* out, bool inverse, cudaStream_t stream);

// The architectures nvcc compiled the kernels for (__CUDA_ARCH_LIST__), as __CUDA_ARCH__ values: 900 for 9.0. Empty
// for a host build (the emulation), which nvcc did not compile.
std::vector<int> compiled_archs();

// Empty where the current device can run the kernels, else the CUDA runtime's error for one of them, e.g.
// cudaErrorNoKernelImageForDevice where they hold no code the device's architecture runs. A host build runs
// every kernel itself: empty.
std::string kernel_image_error();

}  // namespace sdp4bit::gpu
