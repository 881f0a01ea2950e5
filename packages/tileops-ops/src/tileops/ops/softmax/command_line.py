"""The softmax family's sugar for the ``tileops`` command: shorthand flags, and the peer
libraries ``tileops bench`` times beside each op.

``--dim`` sets the dimension normalised over (the param ``row_dim``, torch's dim), ``--out-dtype``
y's dtype (``out_dtype``, torch's dtype). torch eager and ``torch.compile`` of the manifest's ``torch_api`` are timed for
every op without an entry here.
"""

#: Flag -> the param it sets; its value is read as the manifest declares the param.
PARAM_FLAGS = {"--dim": "row_dim", "--out-dtype": "out_dtype"}

#: Flag -> the optional input it leaves out (the softmax ops have none).
OMIT_FLAGS: dict[str, str] = {}


# -- peers: what ``tileops bench`` times beside each op (the ``bench`` extra installs them) ------
#
# Op -> {column: (the peer's callable as "module:attribute", adapter)}, as in the norm family's
# table. Liger-Kernel's softmax works over the last dimension, in the input's dtype; releases
# before its multi-block kernels refuse rows over 65536 elements (Triton's largest block), and
# the table then shows the cell refused with Liger's own message. It has no log-softmax.

# quack's ``softmax`` (``quack-kernels``) is differentiable, over the last dimension of a 2-D
# input in its dtype; it has no log-softmax.

LIGER_SOFTMAX = "liger_kernel.ops.softmax:LigerSoftmaxFunction"
QUACK_SOFTMAX = "quack:softmax"


def _last_dimension_refusal(x, params) -> str | None:
    if params.get("row_dim", -1) not in (-1, x.dim() - 1):
        return "normalises over the last dimension only"
    if params.get("out_dtype") not in (None, x.dtype):
        return "returns the input's dtype only"
    return None


def _liger_softmax(function, inputs, params):
    x = inputs["x"]
    return _last_dimension_refusal(x, params) or (lambda: function.apply(x))


def _quack_softmax(function, inputs, params):
    x = inputs["x"]
    rows = x.reshape(-1, x.shape[-1])  # quack takes (rows, n); a view of the contiguous input
    return _last_dimension_refusal(x, params) or (lambda: function(rows).view(x.shape))


PEERS = {
    "SoftmaxFwdOp": {"Liger": (LIGER_SOFTMAX, _liger_softmax), "quack": (QUACK_SOFTMAX, _quack_softmax)},
    "LogSoftmaxFwdOp": {"Liger": (None, "has no log-softmax"), "quack": (None, "has no log-softmax")},
}


# -- the shape sweep: the calls ``tileops bench --sweep`` draws (``tileops.cli.sweep`` says how) --
#
# The rows users take a softmax of: class scores (1000), attention rows (1k-16k keys, 4-D
# (batch, heads, queries, keys) inputs among them) and vocabularies (32000 to 262144, GPT-2's odd
# 50257 included, which no 16-byte access divides); decode calls (1-64 rows) for about a
# third, 16 to 16384 rows otherwise; each call's x at most 512 MiB.

ROW_LENGTHS = (1000, 1024, 2048, 4096, 8192, 16384, 32000, 32064, 32768, 50257, 65536, 128256, 131072, 151936, 262144)

SWEEP = {
    "widths": {length: 1 for length in ROW_LENGTHS},
    "rows": {"low": 16, "high": 16384, "decode": 64, "decode_share": 0.3},
    "ranks": {2: 3, 3: 1, 4: 1},
    "dtypes": {"bfloat16": 2, "float16": 1, "float32": 1},
    "max_bytes": 512 << 20,
    "ops": {"SoftmaxFwdOp": {}, "LogSoftmaxFwdOp": {}},
}
