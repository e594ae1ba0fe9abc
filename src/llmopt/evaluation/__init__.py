"""Evaluation: workloads, load generation, metrics, prices, quality and reports."""
