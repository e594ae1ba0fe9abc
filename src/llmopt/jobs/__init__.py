"""Optimization jobs: records in SQLite (store) and background execution (runner, worker)."""
