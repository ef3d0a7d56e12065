"""Compute kernels: the CPU C++ extension, Triton attention, the torch reference.

Imports: nothing of eagleserve but the floor (core, config, messages, device,
sampling_params).
"""
