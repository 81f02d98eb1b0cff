"""The GPU engine: paged KV cache, continuous batching, CUDA graphs, prefix caching, on Triton kernels."""
