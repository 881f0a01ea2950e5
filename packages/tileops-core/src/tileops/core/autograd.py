"""Autograd for every differentiable op, wired once from the manifest's ``backward:`` declarations.

A forward op whose entry names a backward op is differentiable. ``Differentiation`` reads both
entries once per op class and knows, for each input of the backward op, what it receives: the
incoming gradient of a forward output (``d<output>``), a forward input or output, or a statistic
the forward saved. An eager call whose differentiable inputs require grad runs through one
``torch.autograd.Function`` node (``run_eager``): its forward runs the op's saving forward (the
implementation computes the statistics in its own pass), its backward calls the op instance's
backward op, through that op's own checks, selection and target like any call. Under
``torch.compile`` the op's saving custom op carries the same formula (``register_formula``), calling
the backward op's custom op. Calls without grad (``torch.no_grad``, inference mode, inputs that do
not require grad) never come here: they save nothing and cost nothing more.

A statistic that an implementation did not save (a target's forward computes only the outputs) is
computed by the backward input's ``derive`` expression, the same one workloads use, so that the
backward always receives it. A statistic declared ``saved_for`` an input (that input's gradient,
computed by the forward pass) is the exception: where that input does not require grad (frozen,
or left out) the call neither computes nor derives it, and the backward op receives None. Which
inputs want gradients travels as a bit per input position (``wanted``). The backward pass, in
turn, skips a gradient that no input wants where the backward op lets it (``skip_outputs``: a
frozen parameter's sum over the rows): it runs the instance's backward op built to skip it.

A statistic the backward op writes (``access: readwrite``, e.g. a saved gradient it scales in
place, so that no second tensor of its size exists) is *consumed*: an eager node keeps it out of
``save_for_backward`` (whose version check would refuse it once written) and hands it to its first
backward only; a second backward through the node (``retain_graph=True``) has the forward's
saving computation compute it again, from the call's inputs (those kept as stand-ins, below,
only where the caller still holds them: the node holds them weakly).

A forward input or output the backward op reads only the description of (``access: shape``:
its shape, dtype and device) is kept as a one-element stand-in of that description, so that the
node does not hold the tensor alive until the backward, where a training step's memory peaks.

A forward op built with ``consume_inputs=True`` whose entry declares an ``in_place`` backward
op lets its backward write the gradients over the forward inputs that op writes (a model's
intermediate tensors that nothing reads after this op's backward): no tensors of their size are
allocated. An eager node does so only where every such input is a contiguous temporary of the
graph (it has a ``grad_fn``: not a leaf, not data the caller passed in, not a view) and none
shares memory with another; it bumps their version counters after writing (so a node that
also saved one refuses to use it, as torch's in-place operations make it), and refuses a
second backward through itself, whose inputs are gone. Elsewhere, and under
``torch.compile`` (whose compiler plans the memory), the backward op allocates them as usual.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .errors import OpArgumentError, OpNotAvailableError
from .manifest import CONSUME_INPUTS, SKIP_OUTPUTS, BoundCall, OpEntry, evaluate

if TYPE_CHECKING:
    from .op import Op

# Where each input of a backward op comes from.
_GRAD, _INPUT, _OUTPUT, _SAVED = "grad", "input", "output", "saved"


class Differentiation:
    """What the autograd wiring of one forward op class needs, derived from its manifest entry
    and its backward op's."""

    def __init__(self, forward: OpEntry, backward: OpEntry, in_place: OpEntry | None = None) -> None:
        decl = forward.backward
        assert decl is not None and decl.op == backward.name
        self.forward, self.backward = forward, backward
        self.saves = decl.saves
        inputs = [t.name for t in forward.inputs]
        outputs = [t.name for t in forward.outputs]
        #: Forward input positions that get a gradient.
        self.differentiable = tuple(i for i, name in enumerate(inputs) if name in decl.grads)
        #: (kind, index) per backward input, in the backward op's order.
        self.sources: list[tuple[str, int]] = []
        for t in backward.inputs:
            if t.name in self.saves:
                self.sources.append((_SAVED, self.saves.index(t.name)))
            elif t.name in inputs:
                self.sources.append((_INPUT, inputs.index(t.name)))
            elif t.name in outputs:
                self.sources.append((_OUTPUT, outputs.index(t.name)))
            else:  # the loader has checked that it is d<output>
                self.sources.append((_GRAD, outputs.index(t.name[1:])))
        backward_outputs = [t.name for t in backward.outputs]
        #: Per backward input: whether the backward op takes None for it (an optional input), so
        #: that the gradient of an output the graph never used costs no zeros there.
        self._grad_optional = tuple(t.optional for t in backward.inputs)
        #: Per forward input: the position of its gradient among the backward op's outputs, or None.
        self.gradient_of = tuple(
            backward_outputs.index(decl.grads[name]) if name in decl.grads else None for name in inputs
        )
        # A backward op that takes skip_outputs may leave out a gradient no input wants (a
        # frozen parameter's, whose sum over the rows may cost as much as the rest).
        skippable = (
            [t.name for t in backward.outputs if t.absent_without]
            if any(p.name == SKIP_OUTPUTS for p in backward.params) else []
        )
        #: Per forward input: the name of its gradient where a backward pass may skip it, or None.
        self._skippable_gradient = tuple(decl.grads.get(name) if decl.grads.get(name) in skippable else None for name in inputs)
        #: Every set of gradients a backward pass may skip (sorted names), an instance's
        #: backward op built for each.
        self.skippable_sets = tuple(
            subset for size in range(1, len(skippable) + 1) for subset in itertools.combinations(sorted(skippable), size)
        )
        self._kept_inputs = sorted({index for kind, index in self.sources if kind == _INPUT})
        self._kept_outputs = sorted({index for kind, index in self.sources if kind == _OUTPUT})
        # Forward tensors the backward op reads only the description of (access: shape): a node
        # keeps a one-element stand-in of their shape instead, so they are freed with the rest of
        # the forward's temporaries (a training step's memory peaks where its backward starts).
        read = {source for t, source in zip(backward.inputs, self.sources) if not t.described_only}
        described = {source for t, source in zip(backward.inputs, self.sources) if t.described_only} - read
        self._stood_in = tuple(
            [(_INPUT, i) in described for i in self._kept_inputs] + [(_OUTPUT, j) in described for j in self._kept_outputs]
        )
        #: Forward input positions kept as stand-ins.
        self._described_inputs = frozenset(i for kind, i in described if kind == _INPUT)
        written = {t.name for t in backward.inputs if t.written}
        #: Positions among the saved statistics of those the backward op writes (consumes).
        self._consumed = tuple(i for i, name in enumerate(self.saves) if name in written)
        self.consumes = bool(self._consumed)
        #: Per statistic: the position of the input it is saved for, or None (saved for all).
        self._saved_for = tuple(inputs.index(decl.saved_for[name]) if name in decl.saved_for else None for name in self.saves)
        #: Whether the forward's implementation is told the wanted gradients (``forward_saving(..., wanted=)``).
        self.saves_for_inputs = bool(decl.saved_for)
        self._input_names = inputs
        #: The forward input positions the ``in_place`` backward op writes over.
        self.overwritten = () if in_place is None else tuple(inputs.index(t.aliases) for t in in_place.outputs)
        #: Their positions among the backward op's inputs.
        self.overwritten_arguments = tuple(self.sources.index((_INPUT, i)) for i in self.overwritten)
        #: The autograd Function of eager calls, named after the op (``y.grad_fn`` shows
        #: ``<OpName>Backward``).
        self.node = type(forward.name, (_Node,), {"__module__": __name__})

    def needs_grad(self, inputs: Sequence[Any]) -> bool:
        """Whether a call with ``inputs`` must record an autograd node."""
        if not torch.is_grad_enabled():
            return False
        return any(isinstance(inputs[i], torch.Tensor) and inputs[i].requires_grad for i in self.differentiable)

    def skipped_gradients(self, needed: Sequence[bool], present: Sequence[bool]) -> tuple[str, ...]:
        """The gradients a backward pass skips: those, among the skippable, of the inputs the
        call had (``present``) that need none (``needed``: autograd's ``needs_input_grad``)."""
        return tuple(sorted(
            name for name, need, given in zip(self._skippable_gradient, needed, present) if name and given and not need
        ))

    def wanted(self, inputs: Sequence[Any]) -> int:
        """The differentiable inputs of a call that require grad, a bit per input position."""
        return sum(1 << i for i in self.differentiable if isinstance(inputs[i], torch.Tensor) and inputs[i].requires_grad)

    def wanted_names(self, wanted: int) -> frozenset[str]:
        """``wanted`` as the inputs' names."""
        return frozenset(name for i, name in enumerate(self._input_names) if wanted >> i & 1)

    def may_overwrite(self, inputs: Sequence[Any]) -> bool:
        """Whether the ``in_place`` backward op may write over ``inputs``' overwritten ones: each
        a contiguous tensor the graph computed (a ``grad_fn``, no view's base), no two sharing
        memory."""
        tensors = [inputs[i] for i in self.overwritten]
        if not all(
            isinstance(t, torch.Tensor) and t.grad_fn is not None and t._base is None and t.is_contiguous()
            for t in tensors
        ):
            return False
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        return len(storages) == len(tensors)

    def unwanted(self, wanted: int) -> tuple[bool, ...]:
        """Per statistic: whether it is saved for an input that wants no gradient."""
        return tuple(i is not None and not wanted >> i & 1 for i in self._saved_for)

    def complete_saved(
        self, op: Op, inputs: Sequence[Any], outputs: Sequence[torch.Tensor], saved: Sequence[Any], wanted: int
    ) -> tuple:
        """``saved`` with every statistic an implementation left as None computed by the
        backward input's ``derive`` expression (from the forward's inputs, outputs and params),
        and None for each saved for an input that wants no gradient."""
        if self.saves_for_inputs:
            skipped = self.unwanted(wanted)
            saved = tuple(None if skip else value for value, skip in zip(saved, skipped))
            missing = [value is None and not skip for value, skip in zip(saved, skipped)]
        else:
            missing = [value is None for value in saved]
        if not any(missing):
            return tuple(saved)
        tensors: dict[str, Any] = {t.name: value for t, value in zip(self.forward.inputs, inputs)}
        for t, value in zip(self.forward.outputs, outputs):
            tensors[t.name] = tensors[f"d{t.name}"] = value  # an output's gradient has its dtype and shape
        return tuple(
            derive_input(op.backward_op, name, tensors) if derive else value
            for name, value, derive in zip(self.saves, saved, missing)
        )

    def kept(self, inputs: Sequence[Any], outputs: Sequence[Any], saved: Sequence[Any]) -> list:
        """What a node keeps for its backward: the forward inputs and outputs the backward op
        reads, then the statistics. Nothing else is kept alive (the addends of a fused sum are
        not, where the backward reads the sum; a tensor whose description alone is read is kept as
        a stand-in)."""
        tensors = [*(inputs[i] for i in self._kept_inputs), *(outputs[j] for j in self._kept_outputs)]
        return [stand_in(t) if swap else t for t, swap in zip(tensors, self._stood_in)] + list(saved)

    def split_consumed(self, kept: Sequence[Any]) -> tuple[list, tuple]:
        """``kept`` as (what ``save_for_backward`` keeps, the consumed statistics)."""
        if not self._consumed:  # most ops: every call of a training step comes here
            return list(kept), ()
        first = len(self._kept_inputs) + len(self._kept_outputs)
        consumed = {first + i for i in self._consumed}
        return [t for i, t in enumerate(kept) if i not in consumed], tuple(kept[i] for i in sorted(consumed))

    def join_consumed(self, kept: Sequence[Any], consumed: Sequence[Any]) -> list:
        """``split_consumed`` undone."""
        first = len(self._kept_inputs) + len(self._kept_outputs)
        joined = list(kept)
        for i, value in zip(self._consumed, consumed):
            joined.insert(first + i, value)  # ascending positions: each lands where split took it
        return joined

    def hold(self, call: BoundCall) -> BoundCall:
        """What a node keeps of ``call`` for a second backward: the call with the inputs kept as
        stand-ins held weakly (the node must not keep them alive)."""
        inputs = tuple(
            weakref.ref(t) if i in self._described_inputs and t is not None else t for i, t in enumerate(call.inputs)
        )
        return BoundCall(inputs, call.outs, call.device, call.dims, call.output_shapes, call.output_dtypes)

    def recompute_consumed(self, op: Op, held: BoundCall, wanted: int) -> tuple:
        """The consumed statistics of the ``held`` call computed again by the op's saving
        forward (the same computation as the first time, so the same values)."""
        inputs = tuple(t() if isinstance(t, weakref.ref) else t for t in held.inputs)
        freed = [self._input_names[i] for i, (t, kept) in enumerate(zip(inputs, held.inputs)) if t is None and kept is not None]
        if freed:
            raise OpNotAvailableError(
                f"{self.forward.name}: a second backward through one call (retain_graph=True) computes the gradients "
                f"its first backward consumed again from the call's inputs, and {', '.join(freed)} "
                f"{'was' if len(freed) == 1 else 'were'} freed after the forward (the call's autograd node keeps only "
                "the shape of an input its backward op does not read, so as not to keep it alive); keep a reference "
                "to it to run the backward more than once"
            )
        call = BoundCall(inputs, held.outs, held.device, held.dims, held.output_shapes, held.output_dtypes)
        result, saved = op.run_saving(call, wanted)
        outputs = result if isinstance(result, tuple) else (result,)
        saved = self.complete_saved(op, call.inputs, outputs, saved, wanted)
        return tuple(saved[i] for i in self._consumed)

    def backward_arguments(self, grads: Sequence[Any], kept: Sequence[Any], outputs: Sequence[Any]) -> list:
        """The backward op's inputs, in its order, from the incoming gradients and ``kept``.

        A gradient may be None where the graph never used its output (an eager node leaves
        such gradients unmaterialised): the backward op receives None where it takes the
        input as optional (an auxiliary output a training step ignores: no zeros made, and
        none summed), and zeros of the output's description (``outputs``, from ``described``)
        where it needs a tensor."""
        n_inputs, n_outputs = len(self._kept_inputs), len(self._kept_outputs)
        if any(g is None for g in grads):
            grads = list(grads)
            for (kind, index), optional in zip(self.sources, self._grad_optional):
                if kind == _GRAD and grads[index] is None and not optional:
                    shape, dtype, device = outputs[index]
                    grads[index] = torch.zeros(shape, dtype=dtype, device=device)
        pools = {
            _GRAD: grads,
            _INPUT: dict(zip(self._kept_inputs, kept[:n_inputs])),
            _OUTPUT: dict(zip(self._kept_outputs, kept[n_inputs : n_inputs + n_outputs])),
            _SAVED: kept[n_inputs + n_outputs :],
        }
        return [pools[kind][index] for kind, index in self.sources]

    def input_gradients(self, results: Any, present: Sequence[bool], needed: Sequence[bool]) -> list:
        """Per forward input: its gradient among the backward op's ``results``, or None (not
        differentiable, absent from the call, or not needed)."""
        results = results if isinstance(results, tuple) else (results,)
        return [
            results[index] if index is not None and given and need else None
            for index, given, need in zip(self.gradient_of, present, needed)
        ]


def described(outputs: Sequence[Any]) -> list:
    """(shape, dtype, device) of each output (None for one that is not a tensor): what a
    backward needs to make zeros for the gradient of an output the graph never used."""
    return [(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None for t in outputs]


def stand_in(tensor: Any) -> Any:
    """A tensor with ``tensor``'s shape, dtype and device over one element of memory (a
    broadcast view), for a backward op that reads only those; None stays None."""
    return tensor if tensor is None else tensor.new_empty(()).expand(tensor.shape)


def derive_input(op: Op, name: str, tensors: dict[str, Any]) -> torch.Tensor:
    """``op``'s input ``name`` computed by its manifest ``derive`` expression from ``tensors``
    (by name) and the op's params: a statistic a forward did not save, computed again."""
    entry = type(op).manifest_entry()
    code = entry.input(name).derive_code
    if code is None:
        raise OpNotAvailableError(
            f"{entry.name}: input {name!r} was not given and the manifest gives no derive expression to compute it"
        )
    namespace: dict[str, Any] = {t.name: None for t in entry.inputs}
    # Detached, the tensors record no history; grad stays enabled for an expression that
    # differentiates a fresh graph of its own (a forward's saved gradients).
    namespace.update({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()})
    namespace.update(op.params, torch=torch, F=F)
    with torch.enable_grad():
        return evaluate(code, namespace)


def refuse_buffers(op: Op, outs: dict) -> None:
    """Output buffers and autograd do not mix (as torch's ``out=`` functions): say so, by name."""
    buffers = [name for name in outs if name in op.signature().out_keywords]
    if buffers:
        raise OpArgumentError(
            f"{type(op).__name__}: output buffer(s) {', '.join(buffers)} cannot be filled by a call that records "
            "autograd history (an input requires grad); call it under torch.no_grad(), or without the buffer"
        )


def refuse_double_backward(op_name: str, backward_name: str) -> None:
    """The gradients of a backward op's gradients are not computed: refuse a backward pass
    that would record them (``create_graph=True``), naming both ops."""
    if torch.is_grad_enabled():
        raise OpNotAvailableError(
            f"{op_name}: double backward is not supported: {backward_name} records no autograd history, so the "
            "gradient of its gradients (create_graph=True, e.g. a gradient penalty) cannot be computed"
        )


class _Node(torch.autograd.Function):
    """The one autograd node of an eager differentiable call."""

    @staticmethod
    def forward(ctx, op: Op, call: BoundCall, *inputs: Any):
        wiring = op.differentiation
        ctx.wanted = wiring.wanted(inputs)
        result, saved = op.run_saving(call, ctx.wanted)
        outputs = result if isinstance(result, tuple) else (result,)
        saved = wiring.complete_saved(op, inputs, outputs, saved, ctx.wanted)
        ctx.op = op
        ctx.present = [t is not None for t in inputs]
        kept, ctx.consumed = wiring.split_consumed(wiring.kept(inputs, outputs, saved))
        ctx.save_for_backward(*kept)
        ctx.call = wiring.hold(call) if wiring.consumes else None  # for a second backward, which computes them again
        # Decided on the call's inputs: a non-contiguous one is already the call path's own copy.
        ctx.overwrite = op.in_place_backward_op is not None and wiring.may_overwrite(inputs)
        ctx.overwritten = False
        # An output the graph never uses reaches the backward as None, not as zeros torch made.
        ctx.set_materialize_grads(False)
        ctx.outputs = described(outputs)
        return result

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        op = ctx.op
        wiring = op.differentiation
        refuse_double_backward(type(op).__name__, wiring.backward.name)
        consumed, ctx.consumed = ctx.consumed, None  # the node lets go of what the backward op writes
        if consumed is None and wiring.consumes:  # retain_graph: a backward before this one had them
            consumed = wiring.recompute_consumed(op, ctx.call, ctx.wanted)
        if ctx.overwritten:
            names = ", ".join(wiring.forward.inputs[i].name for i in wiring.overwritten)
            raise OpNotAvailableError(
                f"{type(op).__name__}({CONSUME_INPUTS}=True): a second backward through one call (retain_graph=True) "
                f"cannot run: the first wrote its gradients over {names}; build the op with {CONSUME_INPUTS}=False to "
                "run the backward more than once"
            )
        arguments = wiring.backward_arguments(grads, wiring.join_consumed(ctx.saved_tensors, consumed or ()), ctx.outputs)
        if ctx.overwrite:
            results = op.in_place_backward_op(*arguments)
            ctx.overwritten = True
            for position in wiring.overwritten_arguments:  # a kernel's writes: torch's counters did not see them
                torch.autograd.graph.increment_version(arguments[position])
        else:
            results = op.backward_op_for(ctx.needs_input_grad[2:], ctx.present)(*arguments)
        return (None, None, *wiring.input_gradients(results, ctx.present, ctx.needs_input_grad[2:]))


def run_eager(op: Op, call: BoundCall) -> Any:
    """An eager call that records autograd history: one node, its backward the backward op."""
    refuse_buffers(op, call.outs)
    return op.differentiation.node.apply(op, call, *call.inputs)


def register_formula(saving_op: Any, n_inputs: int, n_outputs: int, instance_of) -> None:
    """Register, on the custom op ``saving_op`` (inputs..., execution arguments..., wanted,
    instance -> outputs..., statistics...), the formula ``torch.compile`` differentiates: its backward calls
    the backward op instance's custom op. ``instance_of(key)`` is the op instance a key names."""

    def setup_context(ctx, inputs, output):
        output = output if isinstance(output, tuple) else (output,)  # one output, nothing saved
        ctx.key, wanted = inputs[-1], inputs[-2]
        ctx.present = [t is not None for t in inputs[:n_inputs]]
        wiring = instance_of(ctx.key).differentiation
        # A statistic saved for an input that wants no gradient came back as an empty placeholder.
        saved = [None if skip else value for value, skip in zip(output[n_outputs:], wiring.unwanted(wanted))]
        ctx.save_for_backward(*wiring.kept(inputs[:n_inputs], output[:n_outputs], saved))
        ctx.outputs = described(output[:n_outputs])

    def backward(ctx, *grads):
        op = instance_of(ctx.key)
        wiring = op.differentiation
        refuse_double_backward(type(op).__name__, wiring.backward.name)
        arguments = wiring.backward_arguments(grads[:n_outputs], ctx.saved_tensors, ctx.outputs)
        backward_op = op.backward_op_for(ctx.needs_input_grad[:n_inputs], ctx.present)
        custom = type(backward_op)._custom_op  # set on the class itself when it was constructed
        n_exec = len(wiring.backward.exec_args)
        results = custom(*arguments, *[None] * n_exec, backward_op.trace_key)
        listed = list(results) if isinstance(results, tuple) else [results]
        results = tuple(backward_op.signature().with_written_inputs(listed, arguments, backward_op.params))
        gradients = wiring.input_gradients(results, ctx.present, ctx.needs_input_grad[:n_inputs])
        return (*gradients, *[None] * (len(ctx.needs_input_grad) - n_inputs))

    torch.library.register_autograd(saving_op, backward, setup_context=setup_context)
