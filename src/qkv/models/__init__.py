"""Whole models built from :mod:`qkv.modules`: each file holds one model and its config."""
