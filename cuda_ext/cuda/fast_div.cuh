// Division of 32-bit unsigned integers by a divisor fixed before a launch, without a division instruction sequence
// per use (a 64-bit division is a long software routine on the GPU; index arithmetic must not cost more than the
// quantization itself). Granlund & Montgomery's round-up method (1994, fig. 4.1): with l = ceil(log2 d) and
// m = floor(2^32 * (2^l - d) / d) + 1, n / d == (umulhi(n, m) + n) >> l for every 0 <= n < 2^32 and 1 <= d < 2^32;
// the sum is taken in 64 bits so it cannot overflow.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SDP4BIT_FASTDIV_HD __host__ __device__ __forceinline__
#else
#define SDP4BIT_FASTDIV_HD inline
#endif

namespace sdp4bit::gpu {

struct FastDiv {
  uint32_t divisor;
  uint32_t magic;
  uint32_t shift;

  // Precompute for divisor d (1 <= d < 2^32), on the host.
  static FastDiv make(uint32_t d) {
    uint32_t l = 0;
    while ((uint64_t{1} << l) < d) ++l;
    const uint64_t m = ((uint64_t{1} << 32) * ((uint64_t{1} << l) - d)) / d + 1;
    return {d, static_cast<uint32_t>(m), l};
  }

  SDP4BIT_FASTDIV_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, magic);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * magic) >> 32);
#endif
    return static_cast<uint32_t>((static_cast<uint64_t>(hi) + n) >> shift);
  }

  SDP4BIT_FASTDIV_HD uint32_t mod(uint32_t n) const { return n - div(n) * divisor; }
};

}  // namespace sdp4bit::gpu
