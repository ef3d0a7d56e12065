"""EAGLE speculative decoding: draft trees, verification and the EAGLE worker.

Imports: model_executor/ and everything below it.
"""
