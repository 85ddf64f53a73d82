// Host build of binding.cpp (sdp4bit_testing/cuda_emulation): emu.h runs every launch at once, on no stream.
#pragma once

#include <cuda_runtime_api.h>

namespace c10::cuda {

struct CUDAStream {
  cudaStream_t stream() const { return nullptr; }
};

inline CUDAStream getCurrentCUDAStream() { return {}; }

}  // namespace c10::cuda
