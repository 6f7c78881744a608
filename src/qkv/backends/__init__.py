"""Interchangeable attention backends; :func:`qkv.attention` validates, plans and dispatches."""
