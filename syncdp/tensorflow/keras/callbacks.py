"""Horovod's module path for the Keras callbacks: a re-export of :mod:`syncdp.keras.callbacks`."""

from syncdp.keras.callbacks import *  # noqa: F403
from syncdp.keras.callbacks import __all__  # noqa: F401
