# shellcheck shell=bash
# The test binaries of ops with a GPU kernel, which tools/gpu_check.sh runs with the GPU
# kernels forced and tools/gpu_bundle.sh packs: matmul, attention, reductions, softmax,
# cross-entropy, norms, convolutions, casts, the CPU-against-GPU flavour checks, and the F16
# read paths (WGSL f16 bindings must read subnormals as the packed words do on this adapter).
# shellcheck disable=SC2034
gpu_tests=(matmul attention attention_options attention_memory reduce softmax_index cross_entropy
           nn conv_pool rotary flavours large_tensors dtypes f16_reads gradcheck)
