// CUDA kernels of the SDP4Bit codec (launchers declared in codec_cuda.cuh).
//
// Bit-exactness: every contract step comes from sdp4bit_codec_math.h (scale, inverse, rounding, packing, hash),
// built with -fmad=false and IEEE division, so each fp32 operation rounds once, as in the reference; the swizzled
// order is the header's swizzled_block formula with its divisions precomputed (fast_div.cuh).
// Two exact shortcuts replace conversions: an integer level n (|n| <= 127) as a float is (1.5 * 2^23 + n) - 1.5 * 2^23
// with the integer placed in the mantissa by bit operations, and back the same way; both are exact, so they equal
// static_cast<float>(n) and static_cast<int>(q) bit for bit while keeping the conversion units free.
//
// Layout: a thread works on chunks of 8 consecutive elements (one 16-byte load of 16-bit data, two of fp32; 4 or
// 8 code bytes). A quantization group of G elements (G / 8 chunks) is owned by a team of TT threads: chunk k of the
// group sits in lane k % TT, slot k / TT, so every slot's loads and stores are contiguous across the team. The
// whole group stays in registers between the abs-max reduction and the encoding: one pass over memory. A 32-block
// is 4 chunks in 4 consecutive lanes, so the Hadamard butterfly runs strides 1, 2, 4 in registers and strides 8,
// 16 as lane shuffles, in the header's stage order with its (a + b, a - b) pairs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "codec_cuda.cuh"
#include "fast_div.cuh"
#include "sdp4bit_codec_math.h"

namespace sdp4bit::gpu {
namespace {

constexpr int kChunk = 8;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: kMagic + n holds the integer n (|n| < 2^22) in its mantissa
constexpr uint32_t kMagicBits = 0x4B400000u;
constexpr int kEwThreads = 256;  // element-wise kernels: threads per block
constexpr int kEwChunks = 4;     // element-wise kernels: chunks per thread, block-strided (4 loads in flight)
constexpr int64_t kMaxGrid = 0x7FFFFFFF;  // blocks a launch may have (gridDim.x)

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---------------------------------------------------------------------------------------------------------------
// Memory: 8-element chunks in and out.

// Raw bits of the 8 elements at index e.. of a `size`-byte type (4: one per word; 2: two per word, element 2i in the
// low half of word i). Elements at index >= limit are never read and come back as zero bits (+0.0).
__device__ __forceinline__ void load_raw8(const uint8_t* __restrict__ p, int size, int64_t e, int64_t limit, bool vec,
                                          uint32_t (&r)[8]) {
  if (vec && e + kChunk <= limit) {
    const uint4* q = reinterpret_cast<const uint4*>(p + e * size);
    const uint4 a = q[0];
    r[0] = a.x, r[1] = a.y, r[2] = a.z, r[3] = a.w;
    if (size == 4) {
      const uint4 b = q[1];
      r[4] = b.x, r[5] = b.y, r[6] = b.z, r[7] = b.w;
    } else {
      r[4] = r[5] = r[6] = r[7] = 0u;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kChunk; ++j) r[j] = 0u;
  if (size == 4) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (e + j < limit) r[j] = w[e + j];
    }
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (e + j < limit) r[j / 2] |= static_cast<uint32_t>(h[e + j]) << (16 * (j & 1));
    }
  }
}

// fp32 values (exact widening) of a chunk's raw bits.
__device__ __forceinline__ void decode8(const uint32_t (&r)[8], DType dtype, float (&v)[8]) {
  if (dtype == DType::kFloat32) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[j] = __uint_as_float(r[j]);
  } else if (dtype == DType::kBFloat16) {
#pragma unroll
    for (int i = 0; i < kChunk / 2; ++i) {
      v[2 * i] = __uint_as_float(r[i] << 16);
      v[2 * i + 1] = __uint_as_float(r[i] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kChunk / 2; ++i) {
      v[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(r[i] & 0xFFFFu)));
      v[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(r[i] >> 16)));
    }
  }
}

// 16-bit patterns of fp32 values rounded to nearest-even (the conversions torch's own CUDA casts use).
__device__ __forceinline__ uint16_t bf16_bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
__device__ __forceinline__ uint16_t f16_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }

// Store a chunk's fp32 values as dtype D (one rounding) at index e..; elements at index >= limit are not written.
template <DType D>
__device__ __forceinline__ void store8(void* out, int64_t e, int64_t limit, bool vec, const float (&v)[8]) {
  if constexpr (D == DType::kFloat32) {
    float* p = static_cast<float*>(out);
    if (vec && e + kChunk <= limit) {
      float4* q = reinterpret_cast<float4*>(p + e);
      q[0] = make_float4(v[0], v[1], v[2], v[3]);
      q[1] = make_float4(v[4], v[5], v[6], v[7]);
      return;
    }
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (e + j < limit) p[e + j] = v[j];
    }
  } else {
    uint16_t h[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) h[j] = D == DType::kBFloat16 ? bf16_bits(v[j]) : f16_bits(v[j]);
    uint16_t* p = static_cast<uint16_t*>(out);
    if (vec && e + kChunk <= limit) {
      uint4 w;
      w.x = h[0] | (static_cast<uint32_t>(h[1]) << 16);
      w.y = h[2] | (static_cast<uint32_t>(h[3]) << 16);
      w.z = h[4] | (static_cast<uint32_t>(h[5]) << 16);
      w.w = h[6] | (static_cast<uint32_t>(h[7]) << 16);
      *reinterpret_cast<uint4*>(p + e) = w;
      return;
    }
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (e + j < limit) p[e + j] = h[j];
    }
  }
}

// The `bits` code bytes (4 or 8) of the chunk at element e (a multiple of 8), little-endian in w; bytes at index
// >= byte_limit are never read and come back as zero.
__device__ __forceinline__ void load_codes8(const uint8_t* __restrict__ codes, int bits, int64_t e, int64_t byte_limit,
                                            bool vec, uint32_t (&w)[2]) {
  const int64_t b0 = e * bits / 8;
  if (vec && b0 + bits <= byte_limit) {
    if (bits == 4) {
      w[0] = *reinterpret_cast<const uint32_t*>(codes + b0);
      w[1] = 0u;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(codes + b0);
      w[0] = x.x, w[1] = x.y;
    }
    return;
  }
  w[0] = w[1] = 0u;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i < bits && b0 + i < byte_limit) w[i / 4] |= static_cast<uint32_t>(codes[b0 + i]) << (8 * (i & 3));
  }
}

// Write a chunk's `bits` code bytes at byte b0; bytes at index >= byte_limit are not written.
__device__ __forceinline__ void store_codes8(uint8_t* __restrict__ codes, int bits, int64_t b0, int64_t byte_limit,
                                             bool vec, const uint32_t (&w)[2]) {
  if (vec && b0 + bits <= byte_limit) {
    if (bits == 4) {
      *reinterpret_cast<uint32_t*>(codes + b0) = w[0];
    } else {
      *reinterpret_cast<uint2*>(codes + b0) = make_uint2(w[0], w[1]);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i < bits && b0 + i < byte_limit) codes[b0 + i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i & 3)));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Per-element arithmetic around the header's steps.

// Signed levels of a chunk's 8 codes as exact floats: static_cast<float>(sdp4bit::unpack(...)) without a conversion.
// A 4-bit two's-complement nibble n maps to (n ^ 8) = level + 8 in [0, 15], an 8-bit byte b to (b ^ 0x80) = level +
// 128; placed in kMagic's mantissa and the bias subtracted, the result is exactly the level.
__device__ __forceinline__ void code_levels(const uint32_t (&w)[2], int bits, float (&q)[8]) {
  if (bits == 4) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const uint32_t nib = (w[0] >> (4 * (j ^ 1))) & 0xFu;  // element j: byte j / 2, high nibble when j is even
      q[j] = __uint_as_float(kMagicBits | (nib ^ 0x8u)) - (kMagic + 8.0f);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const uint32_t byte = (w[j / 4] >> (8 * (j & 3))) & 0xFFu;
      q[j] = __uint_as_float(kMagicBits | (byte ^ 0x80u)) - (kMagic + 128.0f);
    }
  }
}

// An integral level q (|q| <= 127, from sdp4bit::level) as an int: exact, like static_cast<int>(q).
__device__ __forceinline__ int level_int(float q) {
  return __float_as_int(q + kMagic) - static_cast<int>(kMagicBits);
}

// Packed code bytes of a chunk's integer levels, little-endian: 4 bytes (4 bits) or 8 bytes (8 bits).
__device__ __forceinline__ void pack_chunk(const int (&q)[8], int bits, uint32_t (&w)[2]) {
  if (bits == 4) {
    w[0] = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) w[0] |= static_cast<uint32_t>(pack4(q[2 * i], q[2 * i + 1])) << (8 * i);
    w[1] = 0u;
  } else {
    w[0] = w[1] = 0u;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) w[j / 4] |= static_cast<uint32_t>(pack8(q[j])) << (8 * (j & 3));
  }
}

// Stochastic-rounding uniforms of the 8 elements at input index `index`..: the header's counter hash, with the
// high-word hash computed once when the chunk's counters share their high 32 bits (always, except at a 2^32 wrap).
__device__ __forceinline__ void uniforms8(uint32_t key, uint64_t offset, int64_t index, float (&u)[8]) {
  const uint64_t c = offset + static_cast<uint64_t>(index);
  const uint32_t lo = static_cast<uint32_t>(c);
  if (lo <= 0xFFFFFFFFu - (kChunk - 1)) {
    const uint32_t inner = counter_key(key, static_cast<uint32_t>(c >> 32));
#pragma unroll
    for (int j = 0; j < kChunk; ++j) u[j] = uniform_lo(inner, lo + j);
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) u[j] = uniform(key, offset, static_cast<uint64_t>(index) + j);
  }
}

// max that returns NaN when either operand is NaN (so one running value tracks both abs-max and non-finiteness).
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#else
  return (a != a || b != b) ? __int_as_float(0x7FFFFFFF) : fmaxf(a, b);
#endif
}

// The 32-point butterfly on 32-blocks held by 4 consecutive lanes (8 contiguous elements each, lane & 3 giving the
// position in the block): strides 1, 2, 4 in registers, then 8 and 16 across lanes, the same (a + b, a - b) pairs in
// the same stage order as sdp4bit::hadamard32. Unnormalised. Every lane of the warp must call it.
__device__ __forceinline__ void hadamard_lanes(float (&v)[8]) {
#pragma unroll
  for (int h = 1; h < kChunk; h <<= 1) {
#pragma unroll
    for (int i = 0; i < kChunk; i += 2 * h) {
#pragma unroll
      for (int j = i; j < i + h; ++j) {
        const float a = v[j];
        const float b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
  const int lane = static_cast<int>(threadIdx.x & 31u);
#pragma unroll
  for (int h = 1; h <= 2; h <<= 1) {  // lane distance h = element distance 8 * h
    const bool upper = (lane & h) != 0;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const float other = __shfl_xor_sync(kFullMask, v[j], h);
      v[j] = upper ? other - v[j] : v[j] + other;  // lower lane holds a, upper lane holds b
    }
  }
}

// Whether the 32-block holding element e lies wholly below `end`: the blocks the Hadamard transform applies to.
__device__ __forceinline__ bool block_below(int64_t e, int64_t end) {
  return (e & ~int64_t{kHadamard - 1}) + kHadamard <= end;
}

// hadamard_lanes on a chunk (at element e) whose 32-block lies wholly below `end`; a chunk of a block that `end`
// cuts, or of one past it, keeps its values. Every lane of the warp must call it (the butterfly shuffles).
__device__ __forceinline__ void hadamard_below(float (&v)[8], int64_t e, int64_t end) {
  float raw[8];
#pragma unroll
  for (int j = 0; j < kChunk; ++j) raw[j] = v[j];
  hadamard_lanes(v);
  if (!block_below(e, end)) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[j] = raw[j];
  }
}

// Group index of element e (a multiple of 8): a shift for power-of-two group sizes, else a precomputed 32-bit
// division of the chunk index (a 64-bit division only past 2^35 elements).
struct GroupIndex {
  int size;
  int shift;       // log2(size), or -1
  bool small;      // every chunk index fits 32 bits
  FastDiv chunks;  // chunks per group

  __device__ __forceinline__ int64_t operator()(int64_t e) const {
    if (shift >= 0) return e >> shift;
    if (small) return chunks.div(static_cast<uint32_t>(e / kChunk));
    return e / size;
  }
};

GroupIndex group_index(int size, int64_t numel) {
  int shift = -1;
  if ((size & (size - 1)) == 0) {
    shift = 0;
    while ((1 << shift) < size) ++shift;
  }
  return {size, shift, numel / kChunk < (int64_t{1} << 32), FastDiv::make(static_cast<uint32_t>(size / kChunk))};
}

// ---------------------------------------------------------------------------------------------------------------
// Quantizing kernels: one team of TT threads per group, S chunk slots per thread.

template <int TT>
__host__ __device__ constexpr int team_block_threads() {
  return TT > 32 ? TT : 256;
}

// Abs-max (NaN-propagating) over the team; TT > 32 means the team is the whole block.
template <int TT>
__device__ __forceinline__ float team_max(float m) {
#pragma unroll
  for (int o = (TT > 32 ? 16 : TT / 2); o > 0; o >>= 1) m = max_nan(m, __shfl_xor_sync(kFullMask, m, o));
  if constexpr (TT > 32) {
    __shared__ float part[TT / 32];
    if ((threadIdx.x & 31u) == 0) part[threadIdx.x / 32] = m;
    __syncthreads();
    m = part[0];
#pragma unroll
    for (int i = 1; i < TT / 32; ++i) m = max_nan(m, part[i]);
  }
  return m;
}

// Output position of input group g: g itself, or its place in the swizzled layout, i.e. block b = z * slices + y
// (partition z, slice y) moved to sdp4bit::swizzled_block(z, y, nodes, ranks_per_node) = y * W + (z % D) * N + z / D,
// computed with divisors precomputed for the launch (group indices fit 32 bits: the binding limits numel to 2^37).
struct GroupOrder {
  bool swizzled;
  FastDiv block_groups;
  FastDiv slices;
  FastDiv ranks_per_node;
  uint32_t nodes;
  uint32_t world;

  __device__ __forceinline__ int64_t operator()(int64_t group) const {
    if (!swizzled) return group;
    const uint32_t g = static_cast<uint32_t>(group);
    const uint32_t block = block_groups.div(g);
    const uint32_t z = slices.div(block);
    const uint32_t y = block - z * slices.divisor;
    const uint32_t n = ranks_per_node.div(z);
    const uint32_t l = z - n * ranks_per_node.divisor;
    const uint32_t out_block = y * world + l * nodes + n;
    return int64_t(out_block) * block_groups.divisor + (g - block * block_groups.divisor);
  }
};

GroupOrder group_order(const QuantTarget& t) {
  if (t.block_groups == 0) return {false, FastDiv::make(1), FastDiv::make(1), FastDiv::make(1), 1, 1};
  return {true,
          FastDiv::make(static_cast<uint32_t>(t.block_groups)),
          FastDiv::make(static_cast<uint32_t>(t.slices)),
          FastDiv::make(static_cast<uint32_t>(t.ranks_per_node)),
          static_cast<uint32_t>(t.nodes),
          static_cast<uint32_t>(t.nodes * t.ranks_per_node)};
}

// A plain float input (any codec dtype) made of partitions of `partition` elements (0: one partition, the whole
// buffer; a group never straddles two), each holding `valid` real elements at its start, the rest read as zero;
// optionally Hadamard-transformed, the 32-blocks lying wholly below the valid end only.
struct PlainSource {
  const uint8_t* x;
  DType dtype;
  int64_t partition;
  int64_t valid;
  bool vec;
  bool hadamard;

  template <int TT, int S>
  __device__ __forceinline__ void load(int64_t base, int lane, int chunks, bool live, float (&v)[S][8]) const {
    const int size = dtype == DType::kFloat32 ? 4 : 2;
    const int64_t limit = partition > 0 ? base - base % partition + valid : valid;
    uint32_t r[S][8];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const int k = s * TT + lane;
      load_raw8(x, size, base + int64_t(k) * kChunk, (live && k < chunks) ? limit : 0, vec, r[s]);
    }
#pragma unroll
    for (int s = 0; s < S; ++s) decode8(r[s], dtype, v[s]);
    if (hadamard) {
#pragma unroll
      for (int s = 0; s < S; ++s) hadamard_below(v[s], base + int64_t(s * TT + lane) * kChunk, limit);
    }
  }
};

// fp32(next) - fp32(ref), both masked at `limit` (one fp32 subtraction per element).
struct DiffSource {
  const uint8_t* next;
  const uint8_t* ref;
  DType next_dtype;
  DType ref_dtype;
  int64_t limit;
  bool vec;

  template <int TT, int S>
  __device__ __forceinline__ void load(int64_t base, int lane, int chunks, bool live, float (&v)[S][8]) const {
    const int next_size = next_dtype == DType::kFloat32 ? 4 : 2;
    const int ref_size = ref_dtype == DType::kFloat32 ? 4 : 2;
    uint32_t a[S][8];
    uint32_t b[S][8];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const int k = s * TT + lane;
      const int64_t e = base + int64_t(k) * kChunk;
      const int64_t lim = (live && k < chunks) ? limit : 0;
      load_raw8(next, next_size, e, lim, vec, a[s]);
      load_raw8(ref, ref_size, e, lim, vec, b[s]);
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
      float fa[8];
      float fb[8];
      decode8(a[s], next_dtype, fa);
      decode8(b[s], ref_dtype, fb);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) v[s][j] = fa[j] - fb[j];
    }
  }
};

// The fp32 sum of `pieces` dequantized pieces of piece_numel elements each, piece 0 first.
struct ReduceSource {
  CodesInput in;
  GroupIndex in_group;
  int64_t pieces;
  int64_t piece_numel;
  int64_t piece_groups;  // in-groups per piece
  bool vec;

  template <int TT, int S>
  __device__ __forceinline__ void load(int64_t base, int lane, int chunks, bool live, float (&v)[S][8]) const {
    constexpr int kBatch = S >= 8 ? 1 : 8 / S;  // pieces whose loads are in flight together (8 chunks a thread)
    const int64_t byte_limit = codes_nbytes(pieces * piece_numel, in.bits);
    int64_t first_group[S];
    bool on[S];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const int k = s * TT + lane;
      on[s] = live && k < chunks;
      first_group[s] = in_group(base + int64_t(k) * kChunk);
    }
    for (int64_t p0 = 0; p0 < pieces; p0 += kBatch) {
      uint32_t w[kBatch][S][2];
      float sc[kBatch][S];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
          const int64_t p = p0 + b;
          const bool load = on[s] && p < pieces;
          const int64_t e = p * piece_numel + base + int64_t(s * TT + lane) * kChunk;
          load_codes8(in.codes, in.bits, e, load ? byte_limit : 0, vec, w[b][s]);
          sc[b][s] = load ? in.scales[p * piece_groups + first_group[s]] : 0.0f;
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (p0 + b >= pieces) break;
#pragma unroll
        for (int s = 0; s < S; ++s) {
          float q[8];
          code_levels(w[b][s], in.bits, q);
#pragma unroll
          for (int j = 0; j < kChunk; ++j) {
            const float d = q[j] * sc[b][s];  // sdp4bit::dequant
            v[s][j] = (p0 + b == 0) ? d : v[s][j] + d;
          }
        }
      }
    }
  }
};

// Encode one team's group from registers and store its codes (slots of absent or padding chunks are skipped).
template <bool kStochastic, int TT, int S>
__device__ __forceinline__ void encode_store(const float (&v)[S][8], int64_t base, int lane, int chunks, bool live,
                                             int64_t og, float inv, bool ok, const QuantTarget& t, bool vec) {
  const float qmax = static_cast<float>(qmax_for(t.bits));
  const int64_t byte_limit = codes_nbytes(t.numel, t.bits);
  const int64_t group_bytes = int64_t(t.group_size) * t.bits / 8;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const int k = s * TT + lane;
    const int64_t e = base + int64_t(k) * kChunk;
    if (!live || k >= chunks || e >= t.numel) continue;
    float u[8] = {};
    if (kStochastic) uniforms8(t.key, t.offset, e, u);
    int q[8];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const float x = v[s][j] * inv;
      q[j] = ok ? level_int(level(x, kStochastic, u[j], qmax)) : 0;
    }
    uint32_t w[2];
    pack_chunk(q, t.bits, w);
    store_codes8(t.codes, t.bits, og * group_bytes + int64_t(k) * t.bits, byte_limit, vec, w);
  }
}

template <int TT, int S, class Source>
__global__ void __launch_bounds__(team_block_threads<TT>())
    quantize_groups_kernel(const Source src, const QuantTarget t, const GroupOrder order, int64_t num_groups,
                           bool vec_codes) {
  constexpr int kTeams = team_block_threads<TT>() / TT;
  const int lane = static_cast<int>(threadIdx.x % TT);
  const int64_t g = int64_t(blockIdx.x) * kTeams + threadIdx.x / TT;
  const bool live = g < num_groups;
  const int chunks = t.group_size / kChunk;
  const int64_t base = g * t.group_size;

  float v[S][8];
  src.template load<TT, S>(base, lane, chunks, live, v);
  float m = 0.0f;
#pragma unroll
  for (int s = 0; s < S; ++s) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) m = max_nan(m, fabsf(v[s][j]));
  }
  m = team_max<TT>(m);

  const float scale = group_scale(m, nonfinite(m), qmax_for(t.bits));
  const float inv = inverse_scale(scale);
  const bool ok = usable(scale);
  const int64_t og = live ? order(g) : 0;
  if (live && lane == 0) t.scales[og] = scale;
  if (t.stochastic) {
    encode_store<true, TT, S>(v, base, lane, chunks, live, og, inv, ok, t, vec_codes);
  } else {
    encode_store<false, TT, S>(v, base, lane, chunks, live, og, inv, ok, t, vec_codes);
  }
}

template <int TT, int S, class Source>
void run_groups(const Source& src, const QuantTarget& t, int64_t num_groups, cudaStream_t stream) {
  constexpr int kThreads = team_block_threads<TT>();
  constexpr int64_t kTeams = kThreads / TT;
  const int64_t blocks = (num_groups + kTeams - 1) / kTeams;
  quantize_groups_kernel<TT, S, Source>
      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(src, t, group_order(t), num_groups,
                                                               aligned16(t.codes));
}

// Pick the team shape for the group size: the smallest team (power of two) or slot count holding G / 8 chunks.
template <class Source>
void launch_groups(const Source& src, const QuantTarget& t, int64_t num_groups, cudaStream_t stream) {
  const int chunks = t.group_size / kChunk;
  if (chunks <= 4) {
    run_groups<4, 1>(src, t, num_groups, stream);
  } else if (chunks <= 8) {
    run_groups<8, 1>(src, t, num_groups, stream);
  } else if (chunks <= 16) {
    run_groups<16, 1>(src, t, num_groups, stream);
  } else if (chunks <= 32) {
    run_groups<32, 1>(src, t, num_groups, stream);
  } else if (chunks <= 64) {
    run_groups<32, 2>(src, t, num_groups, stream);
  } else if (chunks <= 128) {
    run_groups<32, 4>(src, t, num_groups, stream);
  } else if (chunks <= 256) {
    run_groups<32, 8>(src, t, num_groups, stream);
  } else {
    run_groups<128, 8>(src, t, num_groups, stream);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Element-wise kernels: kEwChunks chunks per thread, chunk (block * kEwChunks + u) * kEwThreads + thread.

__device__ __forceinline__ int64_t ew_element(int64_t block, int u) {
  return ((block * kEwChunks + u) * kEwThreads + threadIdx.x) * kChunk;
}

__device__ __forceinline__ int64_t ew_element(int u) { return ew_element(blockIdx.x, u); }

unsigned ew_blocks(int64_t numel) {
  constexpr int64_t kPerBlock = int64_t(kEwThreads) * kEwChunks * kChunk;
  return static_cast<unsigned>((numel + kPerBlock - 1) / kPerBlock);
}

// Where the rows of a decoding launch lie: grid blocks per row, and the strides between rows (code bytes, scales,
// values).
struct RowLayout {
  unsigned blocks;
  int64_t codes;
  int64_t scales;
  int64_t values;
};

// dst = dequantized codes, or (kAdd) dst += them: an fp32 multiply, an fp32 add, one rounding to D (no FMA). Block b
// decodes part b % rows.blocks of row b / rows.blocks, each row a run of numel elements of its own.
template <DType D, bool kAdd>
__global__ void __launch_bounds__(kEwThreads)
    decode_kernel(const CodesInput batch, const GroupIndex gi, int64_t numel, void* first_row, const RowLayout rows,
                  bool vec_codes, bool vec_dst) {
  constexpr int kSize = D == DType::kFloat32 ? 4 : 2;
  const int64_t row = blockIdx.x / rows.blocks;
  const int64_t block = blockIdx.x - row * rows.blocks;
  CodesInput in = batch;
  in.codes += row * rows.codes;
  in.scales += row * rows.scales;
  void* dst = static_cast<uint8_t*>(first_row) + row * rows.values * kSize;
  const int64_t byte_limit = codes_nbytes(numel, in.bits);
  uint32_t w[kEwChunks][2];
  uint32_t r[kEwChunks][8];
  float sc[kEwChunks];
#pragma unroll
  for (int u = 0; u < kEwChunks; ++u) {
    const int64_t e = ew_element(block, u);
    const bool on = e < numel;
    load_codes8(in.codes, in.bits, e, on ? byte_limit : 0, vec_codes, w[u]);
    if constexpr (kAdd) load_raw8(static_cast<const uint8_t*>(dst), kSize, e, on ? numel : 0, vec_dst, r[u]);
    sc[u] = on ? in.scales[gi(e)] : 0.0f;
  }
#pragma unroll
  for (int u = 0; u < kEwChunks; ++u) {
    const int64_t e = ew_element(block, u);
    if (e >= numel) continue;
    float v[8];
    code_levels(w[u], in.bits, v);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[j] = v[j] * sc[u];  // sdp4bit::dequant
    if constexpr (kAdd) {
      float base[8];
      decode8(r[u], D, base);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) v[j] = v[j] + base[j];
    }
    store8<D>(dst, e, numel, vec_dst, v);
  }
}

template <DType D>
__global__ void __launch_bounds__(kEwThreads)
    dequantize_reduce_kernel(const CodesInput in, const GroupIndex gi, int64_t pieces, int64_t piece_numel,
                             int64_t piece_groups, void* out, int64_t inverse_below, float transformed, float plain,
                             bool vec_codes, bool vec_out) {
  constexpr int kBatch = 2;  // pieces whose loads are in flight together
  const int64_t byte_limit = codes_nbytes(pieces * piece_numel, in.bits);
  float acc[kEwChunks][8];
  int64_t first_group[kEwChunks];
#pragma unroll
  for (int u = 0; u < kEwChunks; ++u) first_group[u] = gi(ew_element(u));
  for (int64_t p0 = 0; p0 < pieces; p0 += kBatch) {
    uint32_t w[kBatch][kEwChunks][2];
    float sc[kBatch][kEwChunks];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
#pragma unroll
      for (int u = 0; u < kEwChunks; ++u) {
        const int64_t p = p0 + b;
        const int64_t e = ew_element(u);
        const bool on = e < piece_numel && p < pieces;
        load_codes8(in.codes, in.bits, p * piece_numel + e, on ? byte_limit : 0, vec_codes, w[b][u]);
        sc[b][u] = on ? in.scales[p * piece_groups + first_group[u]] : 0.0f;
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (p0 + b >= pieces) break;
#pragma unroll
      for (int u = 0; u < kEwChunks; ++u) {
        float q[8];
        code_levels(w[b][u], in.bits, q);
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          const float d = q[j] * sc[b][u];  // sdp4bit::dequant
          acc[u][j] = (p0 + b == 0) ? d : acc[u][j] + d;
        }
      }
    }
  }
  if (inverse_below > 0) {  // the same for every thread, so every lane of a warp shuffles
#pragma unroll
    for (int u = 0; u < kEwChunks; ++u) hadamard_below(acc[u], ew_element(u), inverse_below);
  }
#pragma unroll
  for (int u = 0; u < kEwChunks; ++u) {
    const int64_t e = ew_element(u);
    if (e >= piece_numel) continue;
    const float factor = block_below(e, inverse_below) ? transformed : plain;
    float v[8];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[j] = acc[u][j] * factor;
    store8<D>(out, e, piece_numel, vec_out, v);
  }
}

template <DType D>
__global__ void __launch_bounds__(kEwThreads)
    hadamard32_kernel(const uint8_t* __restrict__ x, int64_t numel, float* out, bool inverse, bool vec_in,
                      bool vec_out) {
  constexpr int kSize = D == DType::kFloat32 ? 4 : 2;
  uint32_t r[kEwChunks][8];
#pragma unroll
  for (int u = 0; u < kEwChunks; ++u) {
    const int64_t e = ew_element(u);
    load_raw8(x, kSize, e, e < numel ? numel : 0, vec_in, r[u]);
  }
#pragma unroll
  for (int u = 0; u < kEwChunks; ++u) {
    float v[8];
    decode8(r[u], D, v);
    hadamard_lanes(v);
    if (inverse) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) v[j] = v[j] * (1.0f / kHadamard);
    }
    store8<DType::kFloat32>(out, ew_element(u), numel, vec_out, v);
  }
}

// Run kernel<D> for the runtime dtype.
template <template <DType> class K, class... Args>
void dispatch_dtype(DType dtype, Args&&... args) {
  switch (dtype) {
    case DType::kFloat32:
      K<DType::kFloat32>::run(args...);
      break;
    case DType::kBFloat16:
      K<DType::kBFloat16>::run(args...);
      break;
    case DType::kFloat16:
      K<DType::kFloat16>::run(args...);
      break;
  }
}

// Decode every row, as many rows per launch as the grid holds. Rows take the 16-byte paths only where every row
// starts on a 16-byte boundary.
template <DType D>
struct Decode {
  static void run(const CodesInput& in, const Rows& rows, void* dst, bool add, cudaStream_t stream) {
    constexpr int64_t kSize = D == DType::kFloat32 ? 4 : 2;
    const auto kernel = add ? decode_kernel<D, true> : decode_kernel<D, false>;
    const RowLayout layout{ew_blocks(rows.numel), rows.codes, rows.scales, rows.values};
    const bool one = rows.count == 1;
    const bool vec_codes = aligned16(in.codes) && (one || rows.codes % 16 == 0);
    const bool vec_dst = aligned16(dst) && (one || rows.values * kSize % 16 == 0);
    const int64_t per_launch = std::max<int64_t>(1, kMaxGrid / layout.blocks);
    for (int64_t first = 0; first < rows.count; first += per_launch) {
      CodesInput part = in;
      part.codes += first * rows.codes;
      part.scales += first * rows.scales;
      const int64_t count = std::min(per_launch, rows.count - first);
      kernel<<<static_cast<unsigned>(count * layout.blocks), kEwThreads, 0, stream>>>(
          part, group_index(in.group_size, rows.numel), rows.numel,
          static_cast<uint8_t*>(dst) + first * rows.values * kSize, layout, vec_codes, vec_dst);
    }
  }
};

template <DType D>
struct DequantizeReduce {
  static void run(const CodesInput& in, int64_t pieces, int64_t piece_numel, void* out, int64_t inverse_below,
                  float transformed, float plain, cudaStream_t stream) {
    dequantize_reduce_kernel<D><<<ew_blocks(piece_numel), kEwThreads, 0, stream>>>(
        in, group_index(in.group_size, pieces * piece_numel), pieces, piece_numel, piece_numel / in.group_size, out,
        inverse_below, transformed, plain, aligned16(in.codes), aligned16(out));
  }
};

template <DType D>
struct Hadamard {
  static void run(const FloatInput& x, int64_t numel, float* out, bool inverse, cudaStream_t stream) {
    hadamard32_kernel<D><<<ew_blocks(numel), kEwThreads, 0, stream>>>(
        static_cast<const uint8_t*>(x.data), numel, out, inverse, aligned16(x.data), aligned16(out));
  }
};

int64_t groups_of(int64_t numel, int group_size) { return (numel + group_size - 1) / group_size; }

}  // namespace

void launch_quantize(FloatInput x, int64_t partition, int64_t valid, bool hadamard, const QuantTarget& t,
                     cudaStream_t stream) {
  const PlainSource src{static_cast<const uint8_t*>(x.data), x.dtype, partition, valid, aligned16(x.data), hadamard};
  launch_groups(src, t, groups_of(t.numel, t.group_size), stream);
}

void launch_diff_quantize(FloatInput next, FloatInput ref, int64_t valid, const QuantTarget& t, cudaStream_t stream) {
  const DiffSource src{static_cast<const uint8_t*>(next.data), static_cast<const uint8_t*>(ref.data), next.dtype,
                       ref.dtype, valid, aligned16(next.data) && aligned16(ref.data)};
  launch_groups(src, t, groups_of(t.numel, t.group_size), stream);
}

void launch_dequantize_reduce_quantize(CodesInput in, int64_t pieces, const QuantTarget& t, cudaStream_t stream) {
  const ReduceSource src{in, group_index(in.group_size, pieces * t.numel), pieces, t.numel,
                         t.numel / in.group_size, aligned16(in.codes)};
  launch_groups(src, t, groups_of(t.numel, t.group_size), stream);
}

void launch_dequantize(CodesInput in, Rows rows, void* out, DType out_dtype, cudaStream_t stream) {
  dispatch_dtype<Decode>(out_dtype, in, rows, out, false, stream);
}

void launch_dequantize_add(CodesInput in, Rows rows, void* ref, DType ref_dtype, cudaStream_t stream) {
  dispatch_dtype<Decode>(ref_dtype, in, rows, ref, true, stream);
}

void launch_dequantize_reduce(CodesInput in, int64_t pieces, int64_t piece_numel, void* out, DType out_dtype,
                              int64_t inverse_below, float transformed, float plain, cudaStream_t stream) {
  dispatch_dtype<DequantizeReduce>(out_dtype, in, pieces, piece_numel, out, inverse_below, transformed, plain,
                                   stream);
}

void launch_hadamard32(FloatInput x, int64_t numel, float* out, bool inverse, cudaStream_t stream) {
  dispatch_dtype<Hadamard>(x.dtype, x, numel, out, inverse, stream);
}

std::vector<int> compiled_archs() {
#ifdef __CUDA_ARCH_LIST__
  return {__CUDA_ARCH_LIST__};
#else
  return {};
#endif
}

std::string kernel_image_error() {
#ifdef __CUDACC__
  // Every kernel is compiled for the same architectures, so one kernel's attributes answer for all of them.
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, hadamard32_kernel<DType::kFloat32>);
  if (status == cudaSuccess) return "";
  (void)cudaGetLastError();  // clear it, or the next launch check would report it
  return std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
#else
  return "";
#endif
}

}  // namespace sdp4bit::gpu
