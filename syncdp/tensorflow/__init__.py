"""Horovod's module path: ``import syncdp.tensorflow as hvd`` where ``horovod.tensorflow`` was.

A thin re-export of :mod:`syncdp`; there is no second implementation here.
"""

from syncdp import *  # noqa: F403
from syncdp import __all__  # noqa: F401
