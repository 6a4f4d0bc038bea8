"""EARL."""
