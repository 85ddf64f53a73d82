// Host emulation of the few CUDA device features codec_cuda.cu uses, so its kernels run on a CPU in tests.
//
// Every thread of a block is an std::thread; blocks run one after another. Warp shuffles and __syncthreads are
// barriers over the warp's or block's threads, which gives the lockstep semantics the kernels rely on. The
// kernel launch `k<<<grid, block, smem, stream>>>(args)` is rewritten by the test into
// `k % emu::Launch{grid, block, smem, stream}(args)`. Arithmetic is the host's IEEE fp32 (SSE, no contraction).
#pragma once

#define __shared__ static
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <barrier>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

namespace emu {

inline thread_local uint3 thread_idx;
inline thread_local uint3 block_idx;

// Per-block state: barriers for the block and for each warp, and the exchange slots of warp shuffles.
struct Block {
  explicit Block(unsigned threads) : all(threads), slots(threads) {
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(std::make_unique<std::barrier<>>(32));
  }
  std::barrier<> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<uint32_t> slots;
};

inline thread_local Block* current = nullptr;

template <class T>
T shfl_xor(T value, int lane_mask) {
  static_assert(sizeof(T) == 4);
  const unsigned t = thread_idx.x;
  const unsigned partner = (t & ~31u) | ((t & 31u) ^ static_cast<unsigned>(lane_mask));
  std::barrier<>& warp = *current->warps[t / 32];
  std::memcpy(&current->slots[t], &value, 4);
  warp.arrive_and_wait();
  T out;
  std::memcpy(&out, &current->slots[partner], 4);
  warp.arrive_and_wait();
  return out;
}

template <class... A>
struct Pending {
  unsigned blocks;
  unsigned threads;
  std::tuple<A...> args;
};

struct Launch {
  unsigned blocks;
  int threads;
  int smem;
  cudaStream_t stream;

  template <class... A>
  Pending<std::decay_t<A>...> operator()(A&&... args) const {
    return {blocks, static_cast<unsigned>(threads), std::tuple<std::decay_t<A>...>(std::forward<A>(args)...)};
  }
};

// Run kernel k over the grid: each block's threads concurrently, blocks one after another.
template <class... P, class... A>
void operator%(void (*k)(P...), const Pending<A...>& launch) {
  for (unsigned b = 0; b < launch.blocks; ++b) {
    Block block(launch.threads);
    std::vector<std::thread> threads;
    threads.reserve(launch.threads);
    for (unsigned t = 0; t < launch.threads; ++t) {
      threads.emplace_back([&, t] {
        thread_idx = {t, 0, 0};
        block_idx = {b, 0, 0};
        current = &block;
        std::apply([&](const auto&... a) { k(a...); }, launch.args);
      });
    }
    for (std::thread& th : threads) th.join();
  }
}

}  // namespace emu

#define threadIdx (::emu::thread_idx)
#define blockIdx (::emu::block_idx)

inline void __syncthreads() { emu::current->all.arrive_and_wait(); }

template <class T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  return emu::shfl_xor(value, lane_mask);
}

inline float __uint_as_float(uint32_t x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline float __int_as_float(int32_t x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline int32_t __float_as_int(float f) {
  int32_t x;
  std::memcpy(&x, &f, 4);
  return x;
}
