"""The examples, importable as `sdp4bit_examples` (installed with the package) so that the scripts here, the
benchmarks and the tests share the trainer's pieces by name; each script still runs by its path."""
