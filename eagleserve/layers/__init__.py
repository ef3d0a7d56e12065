"""What a model's forward calls: ForwardBatch (the per-forward metadata) and the attention
backends (torch, Triton) that read it.

Imports: kernels/, mem_cache/ and the floor.
"""
