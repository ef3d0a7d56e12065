"""The Llama model and its weights: HF/GGUF loading, quantized packing, CPU fused layers,
tensor-parallel shards.

Imports: layers/, distributed/, kernels/ and what they import.
"""
