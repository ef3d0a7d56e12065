"""ModelRunner (the model, its KV pools and graphs on one device) and the CUDA graph runner.

Imports: models/, layers/, sampling/, mem_cache/ and what they import.
"""
