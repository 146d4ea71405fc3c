"""Executors: the model executor (device, weights, KV tensors, batch inputs, sampling,
structured output, CUDA graphs, CPU placement, LoRA adapter slots), the Llama-family model and its
tensor/pipeline-parallel sharding (parallel_state.py, sharding.py), and the torch-free
simulated and fake executors. The only room of the runtime that imports torch and the kernels."""
