"""Local variational parameters, each row held by the worker that owns its data.

The record of which parameters are local, the param-store surgery that keeps
a worker's block of rows, what the optimizer does with their gradients, the
public read-back API, and their blocks on disk in checkpoints.
"""
