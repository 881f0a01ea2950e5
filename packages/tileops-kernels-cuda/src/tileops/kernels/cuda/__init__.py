"""TileOPs' CUDA kernels, written in TileLang: one folder per op family, on a shared
runtime that knows no family (``kernel``: the kernels' base class and its one forward;
``compile``, ``tuning``, ``progress``, ``device``, ``fast_launch``: the C++ launcher).

Ops name a family's key table by import path; nothing here is imported until an op is built,
and tilelang itself only when a kernel is compiled.
"""
