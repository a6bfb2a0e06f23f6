"""Horovod's module path: ``import syncdp.tensorflow.keras as hvd`` where
``horovod.tensorflow.keras`` was.

A thin re-export of :mod:`syncdp.keras`; there is no second implementation here.
"""

from syncdp.keras import *  # noqa: F403
from syncdp.keras import __all__  # noqa: F401
from syncdp.tensorflow.keras import callbacks  # noqa: F401
