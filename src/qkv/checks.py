"""Deprecated: qkv's argument checks are private now (:mod:`qkv._checks`); kept for one release.

``qkv.checks`` was the module of argument validation; its name now belongs to what users call
a check of their model, :mod:`qkv.doctor`. Importing it still works and warns.
"""

import qkv._checks as _checks
from qkv._checks import *  # noqa: F403 (the same names, for one release)
from qkv._deprecation import warn_deprecated

warn_deprecated("qkv.checks", "qkv._checks", hint="argument checks are internal to qkv")

__all__ = _checks.__all__
