"""Choosing: deployment configurations with measured benchmark rows, and recommendations by goal and
service-level targets, measured on the machine at hand (candidates, ranking, search, configs)."""
