"""Tensor-parallel process groups and collectives (all-reduce, all-gather).

Imports: the floor only.
"""
