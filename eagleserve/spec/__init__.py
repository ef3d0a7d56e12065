"""EAGLE speculative decoding: draft trees, verification and the EAGLE worker."""
