"""What the tests and benchmarks share: the real multi-process harness (gloo ranks with deepspeed.comm), tiny
models and engines, the bit-exact recordings and emulations the integration tests compare against, and the
toolkit checks that decide whether a compiler-dependent test can run."""
