// The SDP4Bit codec on CPU tensors: C++ with OpenMP over quantization groups.
//
// deepspeed_sdp4bit/codec/reference.py is the definition. Every per-element step below is a function of
// sdp4bit_codec_math.h applied in the reference's order; the builder compiles with -ffp-contract=off (no fused
// multiply-add) and without fast-math, so the results equal the reference bit for bit. A group that needs
// conversion, masking or a Hadamard transform is staged in a fixed-size fp32 buffer on the thread's stack;
// no call allocates memory. The Python adapter (codec/compiled.py) allocates the outputs and validates the
// arguments; the checks here repeat that validation for direct callers of the bindings.

// ATen's tensor and parallel headers and torch's pybind glue only, not <torch/extension.h> (all of libtorch's C++
// API, which takes most of the compile time).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "sdp4bit_codec_math.h"

namespace {

using sdp4bit::codes_nbytes;
using sdp4bit::kHadamard;
using sdp4bit::kMaxGroup;
using sdp4bit::kMinGroup;
using sdp4bit::num_groups;
constexpr int64_t kLevelChunk = 256;  // levels computed per pass before packing (and a prefetch slice issued)
constexpr int64_t kCacheLine = 64;
constexpr int64_t kMinElementsPerThread = 1 << 15;
constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;

// ----------------------------------------------------------------------------------------------- element types

// fp32 value of an input element (exact for fp32, bf16 and fp16).
template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}

// An fp32 value rounded once to T (c10::BFloat16 and c10::Half convert with round-to-nearest-even).
template <typename T>
inline T from_f32(float v) {
  return static_cast<T>(v);
}

// Calls f(T{}) with T the C++ type of a float32 / bfloat16 / float16 tensor.
template <typename F>
void with_float_type(const at::Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
}

// Calls f(std::integral_constant<int, bits>) for bits 4 or 8.
template <typename F>
void with_bits(int bits, F&& f) {
  if (bits == 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

// -------------------------------------------------------------------------------------------------- validation

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "sdp4bit codec (cpu): ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "sdp4bit codec (cpu): ", name, " must be contiguous");
}

void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "sdp4bit codec (cpu): ", name,
              " dtype must be float32, bfloat16 or float16, got ", dt);
}

void check_float(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  check_float_dtype(t, name);
}

void check_bits_group(int64_t bits, int64_t group, const char* bits_name, const char* group_name) {
  TORCH_CHECK(bits == 4 || bits == 8, "sdp4bit codec (cpu): ", bits_name, " must be 4 or 8, got ", bits);
  TORCH_CHECK(group % kMinGroup == 0 && group >= kMinGroup && group <= kMaxGroup, "sdp4bit codec (cpu): ",
              group_name, " must be a multiple of ", kMinGroup, " in [", kMinGroup, ", ", kMaxGroup, "], got ",
              group);
}

// Codes (uint8) and scales (fp32) must be exactly the buffers `numel` elements need.
void check_codes(const at::Tensor& codes, const at::Tensor& scales, int64_t numel, int64_t bits, int64_t group,
                 const char* codes_name, const char* scales_name) {
  check_cpu(codes, codes_name);
  check_cpu(scales, scales_name);
  TORCH_CHECK(codes.scalar_type() == at::kByte, "sdp4bit codec (cpu): ", codes_name, " must be uint8, got ",
              codes.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "sdp4bit codec (cpu): ", scales_name, " must be float32, got ",
              scales.scalar_type());
  TORCH_CHECK(codes.numel() == codes_nbytes(numel, bits), "sdp4bit codec (cpu): ", codes_name, " has ",
              codes.numel(), " bytes, ", numel, " elements at ", bits, " bits need ", codes_nbytes(numel, bits));
  TORCH_CHECK(scales.numel() == num_groups(numel, group), "sdp4bit codec (cpu): ", scales_name, " has ",
              scales.numel(), " entries, ", numel, " elements in groups of ", group, " need ",
              num_groups(numel, group));
}

uint32_t check_key(int64_t key) {
  TORCH_CHECK(key >= 0 && key <= 0xFFFFFFFFLL, "sdp4bit codec (cpu): key must be in [0, 2^32), got ", key);
  return static_cast<uint32_t>(key);
}

// Elements per piece of a buffer of `pieces` equal pieces, each a whole number of groups.
int64_t piece_numel(const at::Tensor& codes, int64_t pieces, int64_t bits, int64_t group) {
  const int64_t total = codes.numel() * 8 / bits;
  TORCH_CHECK(pieces >= 1 && total % pieces == 0 && (total / pieces) % group == 0, "sdp4bit codec (cpu): ", total,
              " elements do not split into ", pieces, " pieces of whole ", group, "-groups");
  return total / pieces;
}

// OpenMP threads for `tasks` independent tasks over `elements` elements: torch's thread count, but no more threads
// than tasks, and none woken for less than kMinElementsPerThread elements each (waking costs more than it saves).
int threads_for(int64_t tasks, int64_t elements) {
  const int64_t useful = std::min(tasks, elements / kMinElementsPerThread);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), useful)));
}

// ---------------------------------------------------------------------------------------------- group kernels

// Quantization settings of one call (the group size is the length of each quantize_group call).
struct Quant {
  int bits;
  bool stochastic;
  uint32_t key;
  uint64_t offset;  // counter of element 0; element i draws counter offset + i
};

// Abs-max of n finite-or-not values as fp32 bits. For non-NaN floats the order of |x|'s bit patterns is the order
// of |x|, so an integer max is exact and vectorises; a result >= the bits of +Inf means a NaN or Inf was seen.
inline uint32_t absmax_bits(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof b);
    b &= kAbsMask;
    m = b > m ? b : m;
  }
  return m;
}

// The contract's group scale for n values: absmax/qmax, NaN when any value is NaN/Inf, 0 below FLT_MIN.
inline float scale_of(const float* x, int64_t n, int qmax) {
  const uint32_t bits = absmax_bits(x, n);
  float absmax;
  std::memcpy(&absmax, &bits, sizeof absmax);
  return sdp4bit::group_scale(absmax, bits >= kInfBits, qmax);
}

// A byte range of input that the thread will read after the current group.
struct Range {
  const char* begin = nullptr;
  int64_t bytes = 0;
};

// The input of the thread's next group (up to two tensors), prefetched one slice per level chunk while the current
// group computes: the hardware prefetcher follows reads only, so without this the memory idles during the compute.
struct Ahead {
  Range ranges[2];

  // Prefetches the fraction [done, done + part) / total of every range.
  void slice(int64_t done, int64_t part, int64_t total) const {
    for (const Range& r : ranges) {
      for (int64_t b = r.bytes * done / total; b < r.bytes * (done + part) / total; b += kCacheLine) {
        __builtin_prefetch(r.begin + b);
      }
    }
  }
};

// Elements [start + group, start + 2 * group) of x clipped to [0, end): the group after the one at `start`.
template <typename T>
Range next_group(const T* x, int64_t start, int64_t group, int64_t end) {
  const int64_t from = std::min(start + group, end);
  const int64_t to = std::min(start + 2 * group, end);
  return Range{reinterpret_cast<const char*>(x + from), (to - from) * static_cast<int64_t>(sizeof(T))};
}

// Levels of n values (n <= kLevelChunk) of a usable group as int8: nearest-even, or stochastic with the counter hash.
template <bool Stochastic>
inline void levels(const float* x, int64_t n, float inv, int qmax, uint32_t key, uint64_t counter, int8_t* q) {
  if (!Stochastic) {
    for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(sdp4bit::level_int(x[i] * inv, false, 0.0f, qmax));
    return;
  }
  const uint32_t lo = static_cast<uint32_t>(counter);
  if (static_cast<uint64_t>(lo) + static_cast<uint64_t>(n) <= (uint64_t{1} << 32)) {
    const uint32_t inner = sdp4bit::counter_key(key, static_cast<uint32_t>(counter >> 32));
    for (int64_t i = 0; i < n; ++i) {
      const float u = sdp4bit::uniform_lo(inner, lo + static_cast<uint32_t>(i));
      q[i] = static_cast<int8_t>(sdp4bit::level_int(x[i] * inv, true, u, qmax));
    }
  } else {  // the counters cross a 2^32 boundary: hash the full 64-bit counter per element
    for (int64_t i = 0; i < n; ++i) {
      const float u = sdp4bit::uniform(key, counter, static_cast<uint64_t>(i));
      q[i] = static_cast<int8_t>(sdp4bit::level_int(x[i] * inv, true, u, qmax));
    }
  }
}

// Packs n levels into codes (n even except at the very end of a tensor; a lone last nibble pairs with 0).
template <int Bits>
inline void pack(const int8_t* q, int64_t n, uint8_t* codes) {
  if (Bits == 8) {
    for (int64_t i = 0; i < n; ++i) codes[i] = sdp4bit::pack8(q[i]);
    return;
  }
  const int64_t pairs = n / 2;
  for (int64_t j = 0; j < pairs; ++j) codes[j] = sdp4bit::pack4(q[2 * j], q[2 * j + 1]);
  if (n % 2) codes[pairs] = sdp4bit::pack4(q[n - 1], 0);
}

// Quantizes n staged fp32 values (one group) into its scale and codes; counters start at `counter`.
template <int Bits, bool Stochastic>
void quantize_values(const float* x, int64_t n, uint32_t key, uint64_t counter, uint8_t* codes, float* scale,
                     const Ahead& ahead) {
  constexpr int kQmax = sdp4bit::qmax_for(Bits);
  const float s = scale_of(x, n, kQmax);
  *scale = s;
  if (!sdp4bit::usable(s)) {
    std::memset(codes, 0, static_cast<size_t>(codes_nbytes(n, Bits)));
    return;
  }
  const float inv = sdp4bit::inverse_scale(s);
  int8_t q[kLevelChunk];
  for (int64_t c = 0; c < n; c += kLevelChunk) {
    const int64_t m = std::min(kLevelChunk, n - c);
    ahead.slice(c, m, n);
    levels<Stochastic>(x + c, m, inv, kQmax, key, counter + c, q);
    pack<Bits>(q, m, codes + c * Bits / 8);
  }
}

// quantize_values with the bit width and rounding chosen at run time.
void quantize_group(const float* x, int64_t n, const Quant& p, uint64_t counter, uint8_t* codes, float* scale,
                    const Ahead& ahead = {}) {
  with_bits(p.bits, [&](auto b) {
    constexpr int kBits = decltype(b)::value;
    if (p.stochastic) {
      quantize_values<kBits, true>(x, n, p.key, counter, codes, scale, ahead);
    } else {
      quantize_values<kBits, false>(x, n, p.key, counter, codes, scale, ahead);
    }
  });
}

// Hadamard transform of each 32-block of n staged values (n a multiple of 32).
inline void hadamard_blocks(float* x, int64_t n) {
  for (int64_t b = 0; b < n; b += kHadamard) sdp4bit::hadamard32(x + b);
}

// Elements of the 32-blocks of a group (starting at a multiple of 32) that lie wholly among its `live` real ones:
// the ones the Hadamard transform applies to (a block that the valid end cuts stays as it is).
inline int64_t whole_blocks(int64_t live) { return live / kHadamard * kHadamard; }

// Elements [start, start + n) of x as fp32, those at index >= valid read as 0, then the optional Hadamard
// transform of the blocks lying wholly below valid. Returns x's own memory when nothing needs staging, else `buf`.
template <typename T>
const float* stage(const T* x, int64_t start, int64_t n, int64_t valid, bool hadamard, float* buf) {
  const int64_t live = std::clamp<int64_t>(valid - start, 0, n);
  if constexpr (std::is_same_v<T, float>) {
    if (!hadamard && live == n) return x + start;
  }
  for (int64_t i = 0; i < live; ++i) buf[i] = to_f32(x[start + i]);
  for (int64_t i = live; i < n; ++i) buf[i] = 0.0f;
  if (hadamard) hadamard_blocks(buf, whole_blocks(live));
  return buf;
}

// Calls f(i, q) for the n levels starting at an even element whose byte is codes[0].
template <int Bits, typename F>
inline void for_levels(const uint8_t* codes, int64_t n, F&& f) {
  if (Bits == 8) {
    for (int64_t i = 0; i < n; ++i) f(i, sdp4bit::unpack(codes, 8, i));
    return;
  }
  const int64_t pairs = n / 2;
  for (int64_t j = 0; j < pairs; ++j) {  // byte j holds elements 2j (index 0 of codes + j) and 2j + 1 (index 1)
    f(2 * j, sdp4bit::unpack(codes + j, 4, 0));
    f(2 * j + 1, sdp4bit::unpack(codes + j, 4, 1));
  }
  if (n % 2) f(n - 1, sdp4bit::unpack(codes + pairs, 4, 0));
}

// acc[0..n) = (Accumulate ? acc + : ) the dequantized elements [begin, begin + n) of a code buffer; segments
// follow the input groups so every element uses its own group's scale (begin is a multiple of 32).
template <int Bits, bool Accumulate>
void dequantize_range(const uint8_t* codes, const float* scales, int64_t group, int64_t begin, int64_t n,
                      float* acc) {
  for (int64_t idx = begin; idx < begin + n;) {
    const int64_t g = idx / group;
    const int64_t end = std::min((g + 1) * group, begin + n);
    const float s = scales[g];
    float* out = acc + (idx - begin);
    for_levels<Bits>(codes + idx * Bits / 8, end - idx, [&](int64_t i, int q) {
      const float v = sdp4bit::dequant(q, s);
      out[i] = Accumulate ? out[i] + v : v;
    });
    idx = end;
  }
}

// acc[0..n) = sum over pieces (piece 0 first, one fp32 add each) of elements [start, start + n) of every piece.
template <int Bits>
void sum_pieces(const uint8_t* codes, const float* scales, int64_t group, int64_t pieces, int64_t piece,
                int64_t start, int64_t n, float* acc) {
  dequantize_range<Bits, false>(codes, scales, group, start, n, acc);
  for (int64_t k = 1; k < pieces; ++k) dequantize_range<Bits, true>(codes, scales, group, k * piece + start, n, acc);
}

// ---------------------------------------------------------------------------------------------------- the ops

void quantize(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t group,
              bool stochastic, int64_t key, int64_t offset, int64_t valid, bool hadamard) {
  check_float(x, "x");
  check_bits_group(bits, group, "bits", "group_size");
  const int64_t n = x.numel();
  check_codes(codes, scales, n, bits, group, "codes", "scales");
  TORCH_CHECK(valid >= 0 && valid <= n, "sdp4bit codec (cpu): valid must be in [0, ", n, "], got ", valid);
  TORCH_CHECK(!hadamard || n % kHadamard == 0, "sdp4bit codec (cpu): hadamard needs a multiple of ", kHadamard,
              " elements, got ", n);
  const Quant p{static_cast<int>(bits), stochastic, check_key(key), static_cast<uint64_t>(offset)};
  const int64_t groups = num_groups(n, group);
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  with_float_type(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = reinterpret_cast<const T*>(x.data_ptr());
#pragma omp parallel for schedule(static) num_threads(threads_for(groups, n))
    for (int64_t g = 0; g < groups; ++g) {
      alignas(64) float buf[kMaxGroup];
      const int64_t start = g * group;
      const int64_t len = std::min(group, n - start);
      const float* v = stage(src, start, len, valid, hadamard, buf);
      quantize_group(v, len, p, p.offset + start, out + start * bits / 8, sc + g,
                     Ahead{{next_group(src, start, group, valid)}});
    }
  });
}

void diff_quantize(const at::Tensor& new_values, const at::Tensor& ref, const at::Tensor& codes,
                   const at::Tensor& scales, int64_t bits, int64_t group, bool stochastic, int64_t key,
                   int64_t offset, int64_t valid) {
  check_float(new_values, "new");
  check_float(ref, "ref");
  check_bits_group(bits, group, "bits", "group_size");
  const int64_t n = new_values.numel();
  TORCH_CHECK(ref.numel() == n, "sdp4bit codec (cpu): diff_quantize: new has ", n, " elements, ref has ",
              ref.numel());
  check_codes(codes, scales, n, bits, group, "codes", "scales");
  TORCH_CHECK(valid >= 0 && valid <= n, "sdp4bit codec (cpu): valid must be in [0, ", n, "], got ", valid);
  const Quant p{static_cast<int>(bits), stochastic, check_key(key), static_cast<uint64_t>(offset)};
  const int64_t groups = num_groups(n, group);
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  with_float_type(new_values, [&](auto new_tag) {
    with_float_type(ref, [&](auto ref_tag) {
      using TN = decltype(new_tag);
      using TR = decltype(ref_tag);
      const TN* a = reinterpret_cast<const TN*>(new_values.data_ptr());
      const TR* b = reinterpret_cast<const TR*>(ref.data_ptr());
#pragma omp parallel for schedule(static) num_threads(threads_for(groups, n))
      for (int64_t g = 0; g < groups; ++g) {
        alignas(64) float buf[kMaxGroup];
        const int64_t start = g * group;
        const int64_t len = std::min(group, n - start);
        const int64_t live = std::clamp<int64_t>(valid - start, 0, len);
        for (int64_t i = 0; i < live; ++i) buf[i] = to_f32(a[start + i]) - to_f32(b[start + i]);
        for (int64_t i = live; i < len; ++i) buf[i] = 0.0f;
        quantize_group(buf, len, p, p.offset + start, out + start * bits / 8, sc + g,
                       Ahead{{next_group(a, start, group, valid), next_group(b, start, group, valid)}});
      }
    });
  });
}

// The runs of a decoding call: `count` rows of n elements, row r's codes, scales and values starting r times
// `codes`, `scales` and `values` entries after row 0's (a call on 1-D codes is one row).
struct Rows {
  int64_t count;
  int64_t n;
  int64_t codes;
  int64_t scales;
  int64_t values;
};

// A 2-D CPU tensor whose rows are contiguous (at any stride between them).
void check_rows_layout(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "sdp4bit codec (cpu): ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1), "sdp4bit codec (cpu): ", name,
              " must be 2-D with contiguous rows, got shape ", t.sizes(), " with strides ", t.strides());
}

// The rows of a decode into `dst`: one contiguous run for codes that are not 2-D, else dst [rows, n] (rows that do
// not overlap), codes [rows, codes_nbytes(n)] and scales [rows, num_groups(n)], each with contiguous rows.
Rows decode_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& dst, int64_t bits,
                 int64_t group, const char* dst_name) {
  if (codes.dim() != 2) {
    check_float(dst, dst_name);
    check_codes(codes, scales, dst.numel(), bits, group, "codes", "scales");
    return {1, dst.numel(), 0, 0, 0};
  }
  check_rows_layout(dst, dst_name);
  check_float_dtype(dst, dst_name);
  check_rows_layout(codes, "codes");
  check_rows_layout(scales, "scales");
  const int64_t rows = codes.size(0);
  const int64_t n = dst.size(1);
  TORCH_CHECK(dst.size(0) == rows && (rows <= 1 || dst.stride(0) >= n), "sdp4bit codec (cpu): ", dst_name,
              " must be [rows, n] with rows that do not overlap for codes of ", rows, " rows, got shape ",
              dst.sizes(), " with strides ", dst.strides());
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat,
              "sdp4bit codec (cpu): codes must be uint8 and scales float32, got ", codes.scalar_type(), " and ",
              scales.scalar_type());
  TORCH_CHECK(codes.size(1) == codes_nbytes(n, bits), "sdp4bit codec (cpu): codes must be [rows, codes_nbytes(n)] = [",
              rows, ", ", codes_nbytes(n, bits), "] for rows of ", n, " elements at ", bits, " bits, got ",
              codes.sizes());
  TORCH_CHECK(scales.size(0) == rows && scales.size(1) == num_groups(n, group),
              "sdp4bit codec (cpu): scales must be [rows, num_groups(n)] = [", rows, ", ", num_groups(n, group),
              "] for rows of ", n, " elements in groups of ", group, ", got ", scales.sizes());
  return {rows, n, codes.stride(0), scales.stride(0), dst.stride(0)};
}

// dst = the dequantized codes, or (Add) dst += them with one fp32 add and one rounding to dst's dtype; each row of
// a 2-D call is its own run.
template <bool Add>
void decode_into(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& dst, int64_t bits,
                 int64_t group, const char* dst_name) {
  check_bits_group(bits, group, "bits", "group_size");
  const Rows rows = decode_rows(codes, scales, dst, bits, group, dst_name);
  const int64_t n = rows.n;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const int64_t groups = num_groups(n, group);
  const int64_t tasks = rows.count * groups;
  with_float_type(dst, [&](auto tag) {
    using T = decltype(tag);
    T* base = reinterpret_cast<T*>(dst.data_ptr());
    with_bits(static_cast<int>(bits), [&](auto b) {
      constexpr int kBits = decltype(b)::value;
#pragma omp parallel for schedule(static) num_threads(threads_for(tasks, rows.count * n))
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t r = task / groups;
        const int64_t start = (task - r * groups) * group;
        const float s = sc[r * rows.scales + start / group];
        T* o = base + r * rows.values + start;
        for_levels<kBits>(cp + r * rows.codes + start * kBits / 8, std::min(group, n - start), [&](int64_t i, int q) {
          const float v = sdp4bit::dequant(q, s);
          o[i] = from_f32<T>(Add ? v + to_f32(o[i]) : v);
        });
      }
    });
  });
}

void dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& out, int64_t bits,
                int64_t group) {
  decode_into<false>(codes, scales, out, bits, group, "out");
}

void dequantize_add(const at::Tensor& ref, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                    int64_t group) {
  decode_into<true>(codes, scales, ref, bits, group, "ref");
}

void hadamard32(const at::Tensor& x, const at::Tensor& out, bool inverse) {
  check_float(x, "x");
  check_cpu(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "sdp4bit codec (cpu): out must be float32, got ", out.scalar_type());
  const int64_t n = x.numel();
  TORCH_CHECK(n % kHadamard == 0, "sdp4bit codec (cpu): hadamard32 needs a multiple of ", kHadamard,
              " elements, got ", n);
  TORCH_CHECK(out.numel() == n, "sdp4bit codec (cpu): out has ", out.numel(), " elements, x has ", n);
  float* dst = out.data_ptr<float>();
  const int64_t chunks = num_groups(n, kMaxGroup);
  with_float_type(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = reinterpret_cast<const T*>(x.data_ptr());
#pragma omp parallel for schedule(static) num_threads(threads_for(chunks, n))
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t start = c * kMaxGroup;
      const int64_t len = std::min(kMaxGroup, n - start);
      float* o = dst + start;
      for (int64_t i = 0; i < len; ++i) o[i] = to_f32(src[start + i]);
      hadamard_blocks(o, len);
      if (inverse) {
        for (int64_t i = 0; i < len; ++i) o[i] = o[i] * (1.0f / kHadamard);
      }
    }
  });
}

void swizzle_quantize(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                      int64_t group, int64_t nodes, int64_t ranks_per_node, int64_t slices, bool stochastic,
                      int64_t key, int64_t offset, int64_t valid, bool hadamard) {
  check_float(x, "x");
  check_bits_group(bits, group, "bits", "group_size");
  const int64_t n = x.numel();
  check_codes(codes, scales, n, bits, group, "codes", "scales");
  TORCH_CHECK(nodes >= 1 && ranks_per_node >= 1 && slices >= 1, "sdp4bit codec (cpu): swizzle_quantize: nodes ",
              nodes, ", ranks_per_node ", ranks_per_node, " and slices ", slices, " must be >= 1");
  const int64_t blocks = nodes * ranks_per_node * slices;
  TORCH_CHECK(n % blocks == 0, "sdp4bit codec (cpu): swizzle_quantize: ", n, " elements do not split into ",
              nodes * ranks_per_node, " partitions x ", slices, " slices");
  const int64_t block = n / blocks;
  TORCH_CHECK(block % group == 0 && block % kHadamard == 0, "sdp4bit codec (cpu): swizzle_quantize: block of ",
              block, " elements is not a multiple of group_size ", group, " and of ", kHadamard);
  const int64_t partition = block * slices;
  TORCH_CHECK(valid >= 0 && valid <= partition, "sdp4bit codec (cpu): swizzle_quantize: valid must be in [0, ",
              partition, "] (the elements of a partition), got ", valid);
  const Quant p{static_cast<int>(bits), stochastic, check_key(key), static_cast<uint64_t>(offset)};
  const int64_t groups = n / group;
  const int64_t per_block = block / group;
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  with_float_type(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = reinterpret_cast<const T*>(x.data_ptr());
#pragma omp parallel for schedule(static) num_threads(threads_for(groups, n))
    for (int64_t g = 0; g < groups; ++g) {
      alignas(64) float buf[kMaxGroup];
      const int64_t in_block = g / per_block;
      const int64_t dest = sdp4bit::swizzled_block(in_block / slices, in_block % slices, nodes, ranks_per_node) *
                               per_block + g % per_block;
      const int64_t start = g * group;
      const float* v = stage(src, start, group, start - start % partition + valid, hadamard, buf);
      quantize_group(v, group, p, p.offset + start, out + dest * group * bits / 8, sc + dest,
                     Ahead{{next_group(src, start, group, n)}});
    }
  });
}

void dequantize_reduce_quantize(const at::Tensor& codes, const at::Tensor& scales, int64_t pieces, int64_t in_bits,
                                int64_t in_group, const at::Tensor& out_codes, const at::Tensor& out_scales,
                                int64_t out_bits, int64_t out_group, bool stochastic, int64_t key, int64_t offset) {
  check_bits_group(in_bits, in_group, "in_bits", "in_group");
  check_bits_group(out_bits, out_group, "out_bits", "out_group");
  check_cpu(codes, "codes");
  const int64_t piece = piece_numel(codes, pieces, in_bits, in_group);
  check_codes(codes, scales, piece * pieces, in_bits, in_group, "codes", "scales");
  TORCH_CHECK(piece % out_group == 0, "sdp4bit codec (cpu): piece of ", piece,
              " elements is not a multiple of out_group ", out_group);
  check_codes(out_codes, out_scales, piece, out_bits, out_group, "out_codes", "out_scales");
  const Quant p{static_cast<int>(out_bits), stochastic, check_key(key), static_cast<uint64_t>(offset)};
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  uint8_t* oc = out_codes.data_ptr<uint8_t>();
  float* os = out_scales.data_ptr<float>();
  const int64_t groups = piece / out_group;
  with_bits(static_cast<int>(in_bits), [&](auto b) {
    constexpr int kBits = decltype(b)::value;
#pragma omp parallel for schedule(static) num_threads(threads_for(groups, piece * pieces))
    for (int64_t g = 0; g < groups; ++g) {
      alignas(64) float buf[kMaxGroup];
      const int64_t start = g * out_group;
      sum_pieces<kBits>(cp, sc, in_group, pieces, piece, start, out_group, buf);
      quantize_group(buf, out_group, p, p.offset + start, oc + start * out_bits / 8, os + g);
    }
  });
}

void dequantize_reduce(const at::Tensor& codes, const at::Tensor& scales, int64_t pieces, int64_t bits,
                       int64_t group, const at::Tensor& out, bool hadamard, double mul, int64_t valid) {
  check_bits_group(bits, group, "bits", "group_size");
  check_cpu(codes, "codes");
  check_float(out, "out");
  const int64_t piece = piece_numel(codes, pieces, bits, group);
  check_codes(codes, scales, piece * pieces, bits, group, "codes", "scales");
  TORCH_CHECK(out.numel() == piece, "sdp4bit codec (cpu): out has ", out.numel(), " elements, a piece has ", piece);
  TORCH_CHECK(valid >= 0 && valid <= piece, "sdp4bit codec (cpu): dequantize_reduce: valid must be in [0, ", piece,
              "] (the elements of a piece), got ", valid);
  // As the reference: fp32(mul), times 1/32 for the blocks whose Hadamard transform is undone.
  const float plain = static_cast<float>(mul);
  const float transformed = plain * (1.0f / kHadamard);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const int64_t groups = piece / group;
  with_float_type(out, [&](auto tag) {
    using T = decltype(tag);
    T* dst = reinterpret_cast<T*>(out.data_ptr());
    with_bits(static_cast<int>(bits), [&](auto b) {
      constexpr int kBits = decltype(b)::value;
#pragma omp parallel for schedule(static) num_threads(threads_for(groups, piece * pieces))
      for (int64_t g = 0; g < groups; ++g) {
        alignas(64) float buf[kMaxGroup];
        const int64_t start = g * group;
        sum_pieces<kBits>(cp, sc, group, pieces, piece, start, group, buf);
        const int64_t whole = hadamard ? whole_blocks(std::clamp<int64_t>(valid - start, 0, group)) : 0;
        hadamard_blocks(buf, whole);
        T* o = dst + start;
        for (int64_t i = 0; i < whole; ++i) o[i] = from_f32<T>(buf[i] * transformed);
        for (int64_t i = whole; i < group; ++i) o[i] = from_f32<T>(buf[i] * plain);
      }
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "SDP4Bit quantization codec on CPU tensors (bit-identical to deepspeed_sdp4bit.codec.reference)";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("quantize", &quantize, "x -> codes, scales (groupwise abs-max; optional mask and Hadamard)", nogil);
  m.def("diff_quantize", &diff_quantize, "quantize new - ref in one pass", nogil);
  m.def("dequantize", &dequantize, "codes, scales -> out (out's dtype)", nogil);
  m.def("dequantize_add", &dequantize_add, "ref <- ref + dequantized codes, one rounding", nogil);
  m.def("hadamard32", &hadamard32, "Walsh-Hadamard transform of each 32-block into fp32 out", nogil);
  m.def("swizzle_quantize", &swizzle_quantize, "quantize into the two-level all-to-all layout", nogil);
  m.def("dequantize_reduce_quantize", &dequantize_reduce_quantize, "sum pieces in fp32 and requantize", nogil);
  m.def("dequantize_reduce", &dequantize_reduce, "sum pieces in fp32, optional inverse Hadamard, scale, cast",
        nogil);
}
