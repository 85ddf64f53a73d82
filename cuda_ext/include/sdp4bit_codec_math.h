// Per-element arithmetic of the SDP4Bit quantizer contract, shared by the CPU and CUDA ops.
//
// deepspeed_sdp4bit/codec/reference.py is the definition; every function here is the scalar form of one step
// there, in the same order, with fp32 IEEE round-to-nearest-even operations and no contraction (both builders
// compile with FMA contraction off), so all backends produce the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define SDP4BIT_HD __host__ __device__ __forceinline__
#else
#define SDP4BIT_HD inline
#endif

namespace sdp4bit {

// The contract's sizes (deepspeed_sdp4bit/codec/spec.py): Hadamard blocks of 32; group sizes are multiples of
// kMinGroup in [kMinGroup, kMaxGroup], so Hadamard blocks and nibble pairs never straddle groups.
constexpr int kHadamard = 32;
constexpr int64_t kMinGroup = 32;
constexpr int64_t kMaxGroup = 8192;
constexpr float kFltMin = 1.17549435082228750797e-38f;  // smallest normal fp32; smaller scales encode as zero
constexpr float kFltMax = 3.40282346638528859812e+38f;
constexpr float kU24 = 5.9604644775390625e-08f;  // 2^-24

// Largest level magnitude at `bits` (4 or 8): 7 (levels -7..7) or 127 (spec.qmax_for).
SDP4BIT_HD constexpr int qmax_for(int bits) { return (1 << (bits - 1)) - 1; }

// Bytes of packed codes for `numel` elements: one per element at 8 bits, one per pair at 4 (spec.codes_nbytes).
SDP4BIT_HD constexpr int64_t codes_nbytes(int64_t numel, int64_t bits) { return bits == 8 ? numel : (numel + 1) / 2; }

// Quantization groups of `numel` elements, the last one possibly partial (spec.num_groups).
SDP4BIT_HD constexpr int64_t num_groups(int64_t numel, int64_t group_size) {
  return (numel + group_size - 1) / group_size;
}

// Wellons' lowbias32 integer hash.
SDP4BIT_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// Hash of a counter's high 32 bits under the per-call key: constant over counters sharing a high word, so a
// kernel may compute it once per run of counters that does not cross a 2^32 boundary.
SDP4BIT_HD uint32_t counter_key(uint32_t key, uint32_t hi) { return mix32(hi ^ key); }

// Uniform fp32 in [0, 1) for the counter whose high word hashed to `inner` and whose low word is `lo`.
SDP4BIT_HD float uniform_lo(uint32_t inner, uint32_t lo) {
  return static_cast<float>(mix32(lo ^ inner) >> 8) * kU24;
}

// Uniform fp32 in [0, 1) for the 64-bit counter offset + index under a per-call key (spec.seed_key).
SDP4BIT_HD float uniform(uint32_t key, uint64_t offset, uint64_t index) {
  const uint64_t c = offset + index;
  return uniform_lo(counter_key(key, static_cast<uint32_t>(c >> 32)), static_cast<uint32_t>(c));
}

// True for NaN and +-Inf; written as one compare so loops over it vectorise.
SDP4BIT_HD bool nonfinite(float x) { return !(fabsf(x) <= kFltMax); }

// Group scale from its abs-max: NaN for a group holding NaN/Inf, 0 when absmax/qmax is below FLT_MIN.
SDP4BIT_HD float group_scale(float absmax, bool has_nonfinite, int qmax) {
  if (has_nonfinite) return NAN;
  const float s = absmax / static_cast<float>(qmax);
  return s < kFltMin ? 0.0f : s;
}

// Whether a group's values are encoded (finite, non-negligible scale); other groups get all-zero codes.
SDP4BIT_HD bool usable(float scale) { return scale >= kFltMin; }

// Reciprocal of a usable scale (one fp32 division per group).
SDP4BIT_HD float inverse_scale(float scale) { return usable(scale) ? 1.0f / scale : 0.0f; }

// v = x * inverse_scale rounded to an integral fp32, before the clamp: nearest-even, or floor(v) + (u < v - floor(v)).
SDP4BIT_HD float rounded(float v, bool stochastic, float u) {
  if (stochastic) {
    const float fl = floorf(v);
    return fl + ((u < (v - fl)) ? 1.0f : 0.0f);
  }
  return rintf(v);
}

// Integer level (as fp32): rounded(v) clamped to [-qmax, qmax] with compares (like torch.clamp, a NaN stays NaN).
SDP4BIT_HD float level(float v, bool stochastic, float u, float qmax) {
  const float q = rounded(v, stochastic, u);
  const float low = q < -qmax ? -qmax : q;
  return low > qmax ? qmax : low;
}

// The same level as an int, for v of a usable group: there |v| <= qmax * (1 + 2^-22), so rounded(v) is an integer of
// magnitude <= qmax + 1, converts exactly, and clamping after the conversion equals clamping before it. (Integer
// min/max vectorise well on CPUs; GCC turns the float clamp into mask juggling.)
SDP4BIT_HD int level_int(float v, bool stochastic, float u, int qmax) {
  const int q = static_cast<int>(rounded(v, stochastic, u));
  const int low = q < -qmax ? -qmax : q;
  return low > qmax ? qmax : low;
}

// Two 4-bit levels into one byte, even element in the high nibble (two's complement nibbles).
SDP4BIT_HD uint8_t pack4(int even, int odd) {
  return static_cast<uint8_t>(((even & 0xF) << 4) | (odd & 0xF));
}

// An 8-bit level as its two's-complement byte.
SDP4BIT_HD uint8_t pack8(int q) { return static_cast<uint8_t>(q & 0xFF); }

// Signed level of element `i` from packed codes.
SDP4BIT_HD int unpack(const uint8_t* codes, int bits, int64_t i) {
  if (bits == 8) return static_cast<int>(static_cast<int8_t>(codes[i]));
  const int byte = codes[i >> 1];
  const int nib = (i & 1) ? (byte & 0xF) : (byte >> 4);
  return nib >= 8 ? nib - 16 : nib;
}

// Dequantized value: fp32(q) * scale, one rounding.
SDP4BIT_HD float dequant(int q, float scale) { return static_cast<float>(q) * scale; }

// One butterfly stage of stride H on a 32-block: (a, b) -> (a + b, a - b) for every pair (j, j + H). The stride is
// a template argument so every loop has a constant trip count (CPU compilers vectorise it, nvcc unrolls it).
template <int H>
SDP4BIT_HD void butterfly(float* v) {
  for (int i = 0; i < kHadamard; i += 2 * H) {
    for (int j = i; j < i + H; ++j) {
      const float a = v[j];
      const float b = v[j + H];
      v[j] = a + b;
      v[j + H] = a - b;
    }
  }
}

// In-place butterfly of one 32-block: strides 1, 2, 4, 8, 16 in that order. Unnormalised.
SDP4BIT_HD void hadamard32(float* v) {
  butterfly<1>(v);
  butterfly<2>(v);
  butterfly<4>(v);
  butterfly<8>(v);
  butterfly<16>(v);
}

// Swizzled block index: input block (partition z, slice y) goes to output position [y][z % D][z / D].
SDP4BIT_HD int64_t swizzled_block(int64_t z, int64_t y, int64_t nodes, int64_t ranks_per_node) {
  const int64_t world = nodes * ranks_per_node;
  return y * world + (z % ranks_per_node) * nodes + z / ranks_per_node;
}

}  // namespace sdp4bit
