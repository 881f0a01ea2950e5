"""TileOPs' CUDA kernels, written in TileLang, one module per op family.

Ops name these classes by import path; nothing here is imported until an op is built, and
tilelang itself only when a kernel is compiled.
"""
