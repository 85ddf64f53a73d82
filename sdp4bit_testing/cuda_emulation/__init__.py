"""The CUDA codec's kernels compiled for the host, so their arithmetic is checked bit for bit without a GPU."""
