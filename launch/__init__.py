"""The ``syncdp-run`` launcher (see :mod:`launch.run`)."""
