// Host build of binding.cpp (sdp4bit_testing/cuda_emulation): the tensors live on the CPU, there is no device to switch to.
#pragma once

#include <c10/core/Device.h>

namespace c10::cuda {

struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};

}  // namespace c10::cuda
