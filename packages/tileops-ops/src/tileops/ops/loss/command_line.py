"""The loss family's sugar for the ``tileops`` command: shorthand flags, and the peer libraries
``tileops bench`` times beside each op.

``--ignore-index``, ``--label-smoothing``, ``--reduction``, ``--lse-square-scale`` and
``--softcap`` set the params of the same names; ``--no-bias`` leaves the linear cross-entropy's
bias out.
"""

#: Flag -> the param it sets; its value is read as the manifest declares the param.
PARAM_FLAGS = {
    "--ignore-index": "ignore_index",
    "--label-smoothing": "label_smoothing",
    "--reduction": "reduction",
    "--lse-square-scale": "lse_square_scale",
    "--softcap": "softcap",
}

#: Flag -> the optional input it leaves out.
OMIT_FLAGS = {"--no-bias": "bias"}


# -- peers: what ``tileops bench`` times beside each op (the ``bench`` extra installs them) ------
#
# Op -> {column: (the peer's callable as "module:attribute", adapter)}, as in the norm family's
# table. Liger-Kernel's losses are modules built with the same options (ignore_index,
# label_smoothing, reduction, lse_square_scale, softcap); they return the loss alone, not lse.
# Their forward writes the gradient of the logits into the logits' memory (Liger's in-place
# design), which changes the values the peer reads on the next repetition but not the bytes it
# moves.
#
# quack's ``cross_entropy`` (``quack-kernels``) takes (rows, classes) logits, ignore_index and the
# reduction, and returns the loss alone; it has no label smoothing, z-loss or soft-capping.

LIGER_CROSS_ENTROPY = "liger_kernel.transformers:LigerCrossEntropyLoss"
LIGER_LINEAR_CROSS_ENTROPY = "liger_kernel.transformers:LigerFusedLinearCrossEntropyLoss"
QUACK_CROSS_ENTROPY = "quack:cross_entropy"


def _options(params, reduction):
    return {
        "ignore_index": params.get("ignore_index", -100),
        "label_smoothing": params.get("label_smoothing", 0.0),
        "lse_square_scale": params.get("lse_square_scale", 0.0),
        "softcap": params.get("softcap"),
        "reduction": reduction,
    }


def _liger_cross_entropy(module, inputs, params):
    loss = module(**_options(params, params.get("reduction", "mean")))
    logits, target_ids = inputs["logits"], inputs["target_ids"].long()
    return lambda: loss(logits, target_ids)


def _liger_per_row_cross_entropy(module, inputs, params):
    loss = module(**_options(params, "none"))
    logits, target_ids = inputs["logits"], inputs["target_ids"].long()
    return lambda: loss(logits, target_ids)


def _liger_linear_cross_entropy(module, inputs, params):
    loss = module(**_options(params, params.get("reduction", "mean")))
    hidden_states, weight, bias, target_ids = inputs["hidden_states"], inputs["weight"], inputs.get("bias"), inputs["target_ids"].long()
    return lambda: loss(weight, hidden_states, target_ids, bias)


def _quack_options_refusal(params) -> str | None:
    taken = {"label_smoothing": 0.0, "lse_square_scale": 0.0, "softcap": None}
    given = [name for name, default in taken.items() if params.get(name, default) != default]
    return f"has no {', '.join(given)}" if given else None


def _quack_cross_entropy(function, inputs, params, reduction):
    logits, target_ids = inputs["logits"], inputs["target_ids"].long()
    ignore_index = params.get("ignore_index", -100)
    return _quack_options_refusal(params) or (
        lambda: function(logits, target_ids, ignore_index=ignore_index, reduction=reduction)
    )


def _quack_reduced_cross_entropy(function, inputs, params):
    return _quack_cross_entropy(function, inputs, params, params.get("reduction", "mean"))


def _quack_per_row_cross_entropy(function, inputs, params):
    return _quack_cross_entropy(function, inputs, params, "none")


PEERS = {
    "CrossEntropyFwdOp": {
        "Liger": (LIGER_CROSS_ENTROPY, _liger_cross_entropy),
        "quack": (QUACK_CROSS_ENTROPY, _quack_reduced_cross_entropy),
    },
    "CrossEntropyPerRowFwdOp": {
        "Liger": (LIGER_CROSS_ENTROPY, _liger_per_row_cross_entropy),
        "quack": (QUACK_CROSS_ENTROPY, _quack_per_row_cross_entropy),
    },
    "LinearCrossEntropyFwdOp": {"Liger": (LIGER_LINEAR_CROSS_ENTROPY, _liger_linear_cross_entropy)},
}


# -- the shape sweep: the calls ``tileops bench --sweep`` draws (``tileops.cli.sweep`` says how) --
#
# The vocabularies of published models (Llama 2 and 3, Mistral, Phi-3, GPT-2's odd 50257 and its
# padded 50304, Qwen, DeepSeek, Gemma's 256000) at 256 to 16384 tokens, a tenth of the calls
# on 1 to 64 (evaluation, reinforcement-learning rollouts), each call's logits at most 1 GiB;
# the options models train with (label smoothing, z-loss, Gemma 2's soft-capping) on a quarter
# of the calls each, mean and sum reductions.

VOCABULARY_SIZES = (32000, 32064, 32768, 49152, 50257, 50304, 65536, 100352, 102400, 128256, 151936, 152064, 256000)

_OPTIONS = {"label_smoothing": {0.0: 3, 0.1: 1}, "lse_square_scale": {0.0: 3, 1e-4: 1}, "softcap": {None: 3, 30.0: 1}}

SWEEP = {
    "widths": {size: 1 for size in VOCABULARY_SIZES},
    "rows": {"low": 256, "high": 16384, "decode": 64, "decode_share": 0.1},
    "ranks": {2: 1},
    "dtypes": {"bfloat16": 3, "float16": 1, "float32": 1},
    "max_bytes": 1 << 30,
    "ops": {
        "CrossEntropyFwdOp": {"params": {**_OPTIONS, "reduction": {"mean": 3, "sum": 1}}},
        "CrossEntropyPerRowFwdOp": {"params": _OPTIONS},
    },
}
