"""Keras progress output on rank 0 only, unless ``SYNCDP_LOG_ALL_RANKS`` asks for every rank.

N ranks printing the same progress bars interleave into noise. On every rank but 0, syncdp
turns Keras' interactive logging off (``keras.utils.disable_interactive_logging()``, in Keras 3
and in Keras 2 alike, for the Keras of the optimizer or model at hand): progress
bars, epoch lines and ``model.summary()`` then go to absl's logger at INFO level, which is not
shown by default. ``print`` is not affected. ``syncdp-run --log-all-ranks`` (or
``SYNCDP_LOG_ALL_RANKS=1``) keeps Keras' output on every rank.

This happens when a :class:`~syncdp.keras.DistributedOptimizer` is created and when a syncdp
callback is attached to a model, both after ``syncdp.init()``.
"""

from __future__ import annotations

from types import ModuleType

from syncdp.job import runtime

__all__ = ["quiet_other_ranks"]


def quiet_other_ranks(keras: ModuleType) -> None:
    """Sends ``keras``' progress output to absl logging on ranks other than 0 (see module doc).

    Does nothing before ``syncdp.init()``, on rank 0, or with ``SYNCDP_LOG_ALL_RANKS`` set.

    Args:
        keras: The Keras package (Keras 3's ``keras`` or tf-keras's ``tf_keras``).
    """
    if not runtime.is_initialized() or runtime.rank() == 0:
        return
    if runtime.get_config().log_all_ranks:
        return
    keras.utils.disable_interactive_logging()
