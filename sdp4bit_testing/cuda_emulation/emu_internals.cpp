// Internals of codec_cuda.cu for the tests, appended to its host build (the same translation unit, so the kernels'
// anonymous namespace is visible) and called through ctypes.

extern "C" {

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

// The group of element e (a multiple of 8) as the element-wise kernels compute it for a buffer of `numel` elements
// in groups of `size`: a shift, a 32-bit precomputed division, or (past 2^35 elements) a 64-bit division.
int64_t emu_group_index(int size, int64_t numel, int64_t e) { return sdp4bit::gpu::group_index(size, numel)(e); }

// Which of the three paths group_index(size, numel) takes: 0 shift, 1 32-bit division, 2 64-bit division.
int emu_group_index_path(int size, int64_t numel) {
  const auto gi = sdp4bit::gpu::group_index(size, numel);
  return gi.shift >= 0 ? 0 : (gi.small ? 1 : 2);
}

}  // extern "C"
