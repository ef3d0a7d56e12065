"""The engine process: Scheduler, overlap loop (FutureMap), target worker, TP ranks.

Imports: spec/ and everything below it.
"""
