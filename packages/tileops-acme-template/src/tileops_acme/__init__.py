"""The acme backend: TileOPs' reference out-of-tree backend, the package backend authors fork.

Importing it registers everything and compiles nothing:

* the target ``acme`` (``detect.py``): a detector that claims devices of type ``acme``, and
  how to read their facts (``register_device_facts``);
* a kernel builder per op of the norm family for that target (``builders.py``), whose kernels
  are plain torch so that the template runs anywhere with ``target="acme"``;
* an added implementation of ``RMSNormFwdInterface`` for short rows
  (``short_rows.py``), the first way of joining.

TileOPs imports this module through the entry point declared in pyproject.toml::

    [project.entry-points."tileops.backends"]
    acme = "tileops_acme"
"""

from . import builders, detect, short_rows  # noqa: F401  (importing registers)

TARGET = detect.TARGET
