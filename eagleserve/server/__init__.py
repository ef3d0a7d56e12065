"""The OpenAI-compatible HTTP front end: protocol models, detokenizer, engine client, app.

Imports: scheduler/ and everything below it.
"""
