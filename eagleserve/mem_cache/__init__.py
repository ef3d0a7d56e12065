"""Memory: the KV pools (req -> token slots -> K/V), the radix tree and the prefix cache
over it.

Imports: the floor only.
"""
