"""gem_train: the reference trainer of gemkit.

A GEM-like ranking model (``gem_train.model``) trained on synthetic or Parquet data
(``gem_train.data``) with every package of the workspace applied from outside
(``gem_train.optimizations``); ``gem_train.train.train(config)`` runs it and ``gem-train`` is the
command line. See the README for the flags and named configs.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gem-train")
except PackageNotFoundError:  # the source tree on PYTHONPATH (the GPU image), not installed
    __version__ = "0.1.0"
