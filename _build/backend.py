"""syncdp's build backend: setuptools', plus ``syncdp-horovod.pth`` at the top of every wheel.

The .pth file must land in site-packages itself (Python runs its import line at start-up, which
installs :mod:`syncdp.horovod_names`). setuptools cannot put a file there for an editable
install (``pip install -e .``), so both kinds of wheel get it here, recorded in the wheel's
RECORD like any other file, so that ``pip uninstall`` removes it.
"""

import base64
import hashlib
import os
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - every other hook is setuptools' own

PTH = "syncdp-horovod.pth"
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    _add_pth(os.path.join(wheel_directory, name))
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    _add_pth(os.path.join(wheel_directory, name))
    return name


def _add_pth(wheel: str) -> None:
    """Rewrites the wheel with the .pth file added at its top and in its RECORD."""
    with open(os.path.join(_HERE, PTH), "rb") as f:
        data = f.read()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel) as old:
        entries = [(info, old.read(info)) for info in old.infolist()]
    rewritten = wheel + ".tmp"
    with zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as new:
        new.writestr(PTH, data)
        for info, content in entries:
            if info.filename.endswith(".dist-info/RECORD"):
                content = f"{PTH},sha256={digest},{len(data)}\n".encode() + content
            new.writestr(info, content)
    os.replace(rewritten, wheel)
