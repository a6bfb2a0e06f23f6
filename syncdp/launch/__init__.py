"""The ``syncdp-run`` launcher (see :mod:`syncdp.launch.run`)."""
