"""Interchangeable attention backends; :mod:`qkv.attention` validates and dispatches."""
