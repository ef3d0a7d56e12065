"""Structured output: grammars (JSON schema, regex, EBNF) and their per-token bitmasks.

Imports: the floor only.
"""
