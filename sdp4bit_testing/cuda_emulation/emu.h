// Host emulation of the few CUDA device features codec_cuda.cu uses, so its kernels run on a CPU in tests.
//
// Every thread of a block is a fiber (a ucontext with its own stack) on the calling OS thread, and blocks run one
// after another. A scheduler resumes the block's fibers round-robin; a fiber runs until it finishes or waits at a
// barrier. Warp shuffles and __syncthreads are such barriers over the warp's or the block's threads, which gives the
// lockstep semantics the kernels rely on, at the cost of a user-space context switch instead of an OS thread's
// wake-up (on a 2-core machine, hundreds of OS threads meeting at barriers spend most of their time in the kernel's
// scheduler). A round in which no fiber finishes and no barrier opens is a deadlock (a thread that returned before
// a barrier the others wait at): it aborts with a message instead of hanging. The kernel launch
// `k<<<grid, block, smem, stream>>>(args)` is rewritten by the test into `k % emu::Launch{grid, block, smem,
// stream}(args)`. Arithmetic is the host's IEEE fp32 (SSE, no contraction).
#pragma once

#define __shared__ static
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <vector>

namespace emu {

inline uint3 thread_idx;
inline uint3 block_idx;

// The fibers of the block being run, and how far the scheduler has come.
struct Scheduler {
  static constexpr size_t kStackBytes = 256 * 1024;
  ucontext_t main;
  std::vector<ucontext_t> contexts;
  std::vector<std::unique_ptr<char[]>> stacks;  // reused across blocks and launches
  std::vector<bool> finished;
  std::function<void()> body;                   // the kernel with its arguments, run by every fiber
  unsigned running = 0;
  uint64_t progress = 0;                        // barriers opened and fibers finished so far
};

inline Scheduler scheduler;

inline void yield() { swapcontext(&scheduler.contexts[scheduler.running], &scheduler.main); }

// A barrier of `expected` fibers: the last to arrive opens it and goes on; the others yield until it is open.
struct Barrier {
  explicit Barrier(unsigned n) : expected(n) {}
  unsigned expected;
  unsigned arrived = 0;
  uint64_t phase = 0;

  void arrive_and_wait() {
    const uint64_t mine = phase;
    if (++arrived == expected) {
      arrived = 0;
      ++phase;
      ++scheduler.progress;
      return;
    }
    while (phase == mine) yield();
  }
};

// Per-block state: barriers for the block and for each warp, and the exchange slots of warp shuffles.
struct Block {
  explicit Block(unsigned threads) : all(threads), warps((threads + 31) / 32, Barrier(32)), slots(threads) {}
  Barrier all;
  std::vector<Barrier> warps;
  std::vector<uint32_t> slots;
};

inline Block* current = nullptr;

template <class T>
T shfl_xor(T value, int lane_mask) {
  static_assert(sizeof(T) == 4);
  const unsigned t = thread_idx.x;
  const unsigned partner = (t & ~31u) | ((t & 31u) ^ static_cast<unsigned>(lane_mask));
  Barrier& warp = current->warps[t / 32];
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

inline void fiber_entry() {
  scheduler.body();
  scheduler.finished[scheduler.running] = true;
  ++scheduler.progress;
}  // returns to scheduler.main through uc_link

// Run one block: start a fiber per thread, then resume the unfinished ones in turn until all have finished.
inline void run_block(unsigned threads) {
  Scheduler& s = scheduler;
  s.contexts.resize(threads);
  while (s.stacks.size() < threads) s.stacks.emplace_back(new char[Scheduler::kStackBytes]);
  s.finished.assign(threads, false);
  for (unsigned t = 0; t < threads; ++t) {
    getcontext(&s.contexts[t]);
    s.contexts[t].uc_stack = {s.stacks[t].get(), 0, Scheduler::kStackBytes};
    s.contexts[t].uc_link = &s.main;
    makecontext(&s.contexts[t], fiber_entry, 0);
  }
  for (unsigned left = threads; left > 0;) {
    const uint64_t before = s.progress;
    left = 0;
    for (unsigned t = 0; t < threads; ++t) {
      if (s.finished[t]) continue;
      s.running = t;
      thread_idx = {t, 0, 0};
      swapcontext(&s.main, &s.contexts[t]);
      left += !s.finished[t];
    }
    if (left > 0 && s.progress == before) {
      std::fprintf(stderr, "emu: deadlock in block %u: %u threads wait at barriers no other thread reaches\n",
                   block_idx.x, left);
      std::abort();
    }
  }
}

// Run kernel k over the grid: each block's threads as fibers, blocks one after another.
template <class... P, class... A>
void operator%(void (*k)(P...), const Pending<A...>& launch) {
  scheduler.body = [&] { std::apply([&](const auto&... a) { k(a...); }, launch.args); };
  for (unsigned b = 0; b < launch.blocks; ++b) {
    Block block(launch.threads);
    current = &block;
    block_idx = {b, 0, 0};
    run_block(launch.threads);
  }
  current = nullptr;
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
