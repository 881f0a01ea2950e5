"""TileLang programs of the softmax kernels (CUDA), forward and backward, and their compilation.

Every program works on (m, n) rows, m symbolic (one compiled program serves every row count; row
indices are 64-bit, so m * n may pass 2**31), n, the dtypes and the function compile-time
constants. Forward: y = softmax(x) or log_softmax(x) per row, in ``out_dtype``, each row
accumulated in float32 (x is rounded to ``out_dtype`` first where that is not wider, as torch
converts it). Backward: dx = y * (dy - sum(dy * y)) or dy - exp(y) * sum(dy), in dy's dtype.

Variants (``make_program``'s ``variant``), each built in a module of its own on the arithmetic they
share (``row_math``):

* ``register`` (``register_program``): ``tpr`` threads per row, ``rows`` rows per block; each
  thread holds its slice of the row in registers, so the row is read once: a max and a sum
  reduction (one sum backward), then the write.
* ``streamed`` (``streamed_program``): one block per row (or per chunk of a row, below); pass 1
  reads the row keeping a running max and a running sum rescaled to it (the online softmax),
  the block combines the threads' pairs, pass 2 reads the row again and writes. Pass 1 loads
  "evict last" and pass 2 "evict first" (16-byte accesses on sm_80 and later), so the second
  read comes from L2. With ``from_end`` (a configuration a tuning request times) pass 2 walks
  the row from its end, starting on what pass 1 read last.
* the split row: the same two passes in two launches over (row, chunk) blocks, so that a few
  long rows still fill every SM. ``phase="partial"`` writes each chunk's (max, sum) to a float32
  workspace of (m, chunks, 2); ``phase="finish"`` combines a row's pairs and writes its chunk.
  ``phase="whole"`` is the one-launch streamed program.

An access is ``vec`` elements: 16 bytes where the call is aligned, else 1 (any length and
alignment). A ``shifted`` program takes rows that are not whole 16-byte accesses in tensors
whose data pointers are aligned: 16-byte accesses over each row's aligned middle and the elements
around it one by one (``row_layout``, where every program's flat addressing is explained).
Kernel call convention (positional, caller-allocated outputs)::

    forward   kernel(x, y)            [split: partial(x, ws), finish(x, ws, y)]
    backward  kernel(dy, y, dx)       [split: partial(dy, y, ws), finish(dy, y, ws, dx)]

Importing this module does not import tilelang; building a program does.
"""

import torch

from ..cache_hints import has_cache_priorities
from ..compile import GUARDED_BY_THE_PROGRAM, compile_once
from .register_program import make_register
from .streamed_program import make_streamed

KINDS = ("forward", "backward")
VARIANTS = ("register", "streamed")
PHASES = ("whole", "partial", "finish")
MAX_THREADS = 1024


def make_program(
    kind: str,
    n: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    log: bool,
    *,
    variant: str,
    vec: int,
    threads: int,
    rows: int = 1,
    unroll: int = 4,
    chunks: int = 1,
    phase: str = "whole",
    cache_priorities: bool = True,
    keep: bool = True,
    shifted: bool = False,
    from_end: bool = False,
):
    """The TileLang PrimFunc of one configuration (see the module and ``policy.launch_config``).

    threads: threads per block; rows (register): rows per block, each of ``threads // rows``
    threads (a power of two); unroll (streamed): accesses in flight per thread and step;
    chunks (streamed): chunks per row of the split phases; cache_priorities: whether the streamed
    passes may load with eviction priorities (PTX of sm_80 and later); keep (register softmax
    forward): whether a thread keeps each float32 exponential for the write, or computes it
    again there (half the registers per element: room for twice the elements per thread);
    shifted: rows that are not whole accesses, covered by aligned accesses and edges (see the
    module; a row's threads, at least ``2 * vec``, read its edges); from_end (streamed, one
    launch): pass 2 walks the row backwards, from the accesses pass 1 made last, which are the
    ones L2 still holds where the rows in flight do not fit in it.
    """
    if kind not in KINDS or variant not in VARIANTS or phase not in PHASES:
        raise ValueError(f"unknown kind {kind!r}, variant {variant!r} or phase {phase!r}")
    if kind == "backward" and out_dtype != dtype:
        raise ValueError(f"the backward writes dx in dy's dtype: out_dtype {out_dtype} must be {dtype}")
    tpr = threads // rows
    if n < 1 or (n % vec and not shifted) or tpr & (tpr - 1) or tpr * rows != threads or threads > MAX_THREADS:
        raise ValueError(f"bad launch configuration vec={vec} threads={threads} rows={rows} for n={n}")
    if shifted and tpr < 2 * vec:
        raise ValueError(f"a shifted program needs 2 * vec threads per row to read the edges: vec={vec}, {tpr} threads")
    if variant == "register" and phase != "whole":
        raise ValueError("the register variant has one phase")
    if from_end and (variant != "streamed" or phase != "whole"):
        raise ValueError("from_end is a one-launch streamed program's: a split chunk's second pass reads from L2 anyway")
    if phase == "whole" and chunks != 1:
        raise ValueError(f"the one-launch program covers a whole row: chunks must be 1, got {chunks}")
    if variant == "register":
        return make_register(kind, n, dtype, out_dtype, log, vec=vec, threads=threads, rows=rows, keep=keep, shifted=shifted)
    return make_streamed(
        kind, n, dtype, out_dtype, log, vec=vec, threads=threads, unroll=unroll, chunks=chunks, phase=phase,
        cache_priorities=cache_priorities, shifted=shifted, from_end=from_end,
    )


def compile_program(kind, n, dtype, out_dtype, log, target, **config):
    """The compiled kernel of one configuration for ``target``, once per process (and on disk)."""
    identity = ("softmax", kind, n, dtype, out_dtype, bool(log), tuple(sorted(config.items())))
    priorities = has_cache_priorities(target)
    return compile_once(
        identity,
        lambda: make_program(kind, n, dtype, out_dtype, log, cache_priorities=priorities, **config),
        target,
        pass_configs=GUARDED_BY_THE_PROGRAM,
    )
