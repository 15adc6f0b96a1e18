"""Batch inference jobs: an input file run through a model's agents at batch priority."""
