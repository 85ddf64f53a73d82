"""The benchmarks, importable as `sdp4bit_benchmarks` (installed with the package) so that scripts and tests share
their pieces by name; each module here is also a script run by its path."""
