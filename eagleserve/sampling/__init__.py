"""Logits to tokens: the sampler (temperature, top-k/p, min-p, grammar masks), penalties
and their per-batch state, prompt logprobs.

Imports: constrained/, distributed/ and the floor.
"""
