"""``Op``: the base class of every op, and its call path.

A call is checked against the signature generated from the op's manifest entry; a call that
writes only empty tensors returns at once; otherwise the instance binds its target once and
then either runs the target's kernel (cached by device and each input's presence, dtype and
shape) or its own ``forward``, which asks ``kernel_for`` for an implementation of one of its
kernel interfaces. A repeated call spec is one dictionary lookup; nothing reads the device
or the registry on that path.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from . import autograd, registry
from .call_path import CallDeclined, call_path_factory
from .device_facts import DeviceFacts
from .discovery import load_backends
from .errors import BackendError, OpArgumentError, OpNotAvailableError, TileOpsError
from .introspection import CallSignature, ManifestDoc
from .kernel import CallSpec, Kernel, KernelInterface
from .manifest import CONSUME_INPUTS, SKIP_OUTPUTS, BoundCall, OpEntry, Signature, load_manifest
from .registry import BUILTIN, describe_callable
from .selection import InterfaceImplementations, Verdict, check_implementations, registered_kernel_type_problems
from .targets import TensorSpec, bind_target, check_target_name
from .tensor_description import TensorDescription
from .tracing import define_custom_op, instance_key, is_compiling, traced_call

class _MissingKernel(Kernel):
    """Stands in for an in-tree implementation whose module cannot be imported."""

    missing_because: ClassVar[str] = ""

    @classmethod
    def entry_for(cls, call):  # never selected: selection finds it unavailable first
        raise BackendError(cls.missing_because)

    def forward(self, *args, **kwargs):
        raise BackendError(self.missing_because)


#: What an op class computes once from its manifest (its signature, wiring, in-tree kernel
#: classes), by (class, name). A plain dict rather than the class's own ``__dict__``: Dynamo
#: refuses to read a class's ``__dict__`` (a mapping proxy) once the function it traces has
#: mutated any dict, so a compiled model that updates a cache dict before calling an op would
#: break its graph there; and unlike an attribute, a subclass does not see its parent's entry.
_class_values: dict[tuple[type, str], Any] = {}


def _class_value(cls: type, name: str, compute: Callable[[], Any]) -> Any:
    """``cls``'s value ``name``, computed by ``compute()`` on the first call."""
    key = (cls, name)
    if key not in _class_values:
        _class_values[key] = compute()
    return _class_values[key]


def _constructor_parameters(cls: type) -> tuple[inspect.Signature, str]:
    """The signature of ``cls``'s constructor (self bound) and how it reads, without annotations:
    ``(a, b=1, *, target=None)``."""
    signature = inspect.signature(cls.__init__)
    parameters = list(signature.parameters.values())[1:]
    shown = inspect.Signature([p.replace(annotation=inspect.Parameter.empty) for p in parameters])
    return signature, str(shown)


def _missing_distribution(reference: str, interface: type[KernelInterface], error: ModuleNotFoundError) -> type[Kernel]:
    """The stand-in for a kernel table whose module is not installed: one key (the module's
    name), unavailable everywhere, saying what to install."""
    module_name = reference.partition(":")[0]
    reason = f"{module_name} is not installed ({error}); install the distribution that provides it"
    if module_name.startswith("tileops.kernels."):
        reason = f"{module_name} is not installed; pip install tileops-kernels-{module_name.split('.')[2]}"
    return type(
        f"Missing_{module_name.replace('.', '_')}",
        (_MissingKernel, interface),
        {"missing_because": reason, "devices": frozenset(), "__module__": __name__},
    )


def _import_table(op_name: str, reference: str) -> Mapping[Any, Mapping[str, type[Kernel]]] | ModuleNotFoundError:
    """The kernel table ``reference`` ("module:NAME") names, interface -> key -> class, or the
    error saying its module's distribution is not installed.

    Only a distribution that is not installed makes its keys unavailable; any other import
    failure is a bug in that module and surfaces as it is.
    """
    module_name, _, name = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not module_name.startswith(error.name):
            raise
        return error
    table = getattr(module, name, None)
    if not isinstance(table, Mapping):
        raise BackendError(
            f"{op_name}.kernel_tables names {reference}, which is {type(table).__name__}, not a mapping "
            "interface -> key -> kernel class"
        )
    return table


class Op:
    """Base class of every op.

    A subclass sets ``manifest_file`` (the family's YAML, as an ``importlib.resources``
    traversable), ``kernel_interfaces``, ``in_tree_kernels`` (interface -> key -> class) and
    ``kernel_tables`` (tables of the same form in distributions that may not be installed,
    named "module:NAME" and imported on first construction), defines a constructor taking the manifest's params plus ``target=None``
    and passing them to ``Op.__init__`` by keyword, and a ``forward`` that runs the in-tree
    path through ``kernel_for``.
    """

    manifest_file: ClassVar[Any]
    kernel_interfaces: ClassVar[tuple[type[KernelInterface], ...]] = ()
    in_tree_kernels: ClassVar[Mapping[type[KernelInterface], Mapping[str, type[Kernel]]]] = {}
    #: "module:NAME" of the kernel tables (interface -> key -> class) the op takes its other
    #: in-tree implementations from: a distribution the op's own may not depend on (the CUDA
    #: kernels) names its keys once, there.
    kernel_tables: ClassVar[tuple[str, ...]] = ()
    #: ``inspect.signature(op)``: the call's inputs, output buffers and execution arguments,
    #: from the manifest (``introspection``); ``help(OpClass)`` shows the manifest's account.
    __signature__ = CallSignature(lambda cls: cls.manifest_entry())

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__doc__ = ManifestDoc(cls.__dict__.get("__doc__"), lambda owner: owner.manifest_entry())
        _op_classes.setdefault(cls.__name__, []).append(cls)

    # -- class level: built once per op class ----------------------------------------------
    @classmethod
    def manifest_entry(cls) -> OpEntry:
        entries = load_manifest(cls.manifest_file)
        if cls.__name__ not in entries:
            raise BackendError(f"{cls.__name__} has no entry in {cls.manifest_file}")
        return entries[cls.__name__]

    @classmethod
    def wiring(cls) -> autograd.Differentiation | None:
        """The autograd wiring of a differentiable op (its entry names a backward op), or None."""
        def compute() -> autograd.Differentiation | None:
            entry = cls.manifest_entry()
            if entry.backward is None:
                return None
            in_place = cls.backward_class(in_place=True)
            return autograd.Differentiation(
                entry, cls.backward_class().manifest_entry(), None if in_place is None else in_place.manifest_entry()
            )

        return _class_value(cls, "wiring", compute)

    @classmethod
    def backward_class(cls, *, in_place: bool = False) -> type[Op] | None:
        """The op class of the backward op the manifest names (defined beside the forward); with
        ``in_place``, of its ``in_place`` backward op, or None where it declares none."""
        decl = cls.manifest_entry().backward
        name = decl.in_place if in_place else decl.op
        if name is None:
            return None
        backward = next((c for c in _op_classes.get(name, ()) if c.manifest_file == cls.manifest_file), None)
        if backward is None:
            raise BackendError(
                f"{cls.__name__}: its manifest entry names the backward op {name}, but no op class of that name "
                f"reads {cls.manifest_file}; define it in the family's ops module"
            )
        return backward

    @classmethod
    def signature(cls) -> Signature:
        return _class_value(cls, "signature", lambda: Signature(cls.manifest_entry()))

    @classmethod
    def in_tree_classes(cls) -> dict[type[KernelInterface], dict[str, type[Kernel]]]:
        """Interface -> key -> class of the op's own implementations: ``in_tree_kernels`` and
        the ``kernel_tables``, imported on the first call (a table whose distribution is not
        installed stands as one unavailable key named after its module)."""
        return _class_value(cls, "in_tree_classes", cls._import_in_tree_classes)

    @classmethod
    def _import_in_tree_classes(cls) -> dict[type[KernelInterface], dict[str, type[Kernel]]]:
        by_interface = {interface: dict(cls.in_tree_kernels.get(interface, {})) for interface in cls.kernel_interfaces}
        for reference in cls.kernel_tables:
            table = _import_table(cls.__name__, reference)
            for interface, classes in by_interface.items():
                if isinstance(table, ModuleNotFoundError):
                    classes[reference.partition(":")[0]] = _missing_distribution(reference, interface, table)
                    continue
                for key, kernel_class in table.get(interface, {}).items():
                    if key in classes:
                        raise BackendError(
                            f"{cls.__name__}: key {key!r} of {interface.__name__} is in {reference} and "
                            "already among the op's in-tree kernels; a key names one implementation"
                        )
                    classes[key] = kernel_class
        return by_interface

    @classmethod
    def in_tree_keys(cls) -> dict[str, type[Kernel]]:
        """Every in-tree key of the op -> its class (importing the kernel tables, not tilelang)."""
        return {key: impl for impls in cls.in_tree_classes().values() for key, impl in impls.items()}

    @classmethod
    def registered_kernel_type_problems(cls) -> dict[str, str]:
        """Key -> the contract error of each kernel type registered for this op that would make
        its construction raise (empty when none would); ``tileops check`` and ``tileops
        backends`` report them, naming the registering module and backend."""
        load_backends()
        registrations = registry.kernel_types(cls.__name__)
        return registered_kernel_type_problems(
            cls.__name__,
            cls.kernel_interfaces,
            cls.in_tree_keys(),
            {key: reg.value for key, reg in registrations.items()},
            {key: reg.registrant() for key, reg in registrations.items()},
        )

    # -- instance ------------------------------------------------------------------------------
    def __new__(cls, *args: Any, **kwargs: Any) -> Op:
        # Arguments the constructor cannot take are refused naming the op and what it takes, as
        # a call's are: Python's own TypeError names ``__init__`` (or a private base's).
        signature, shown = _class_value(cls, "constructor", lambda: _constructor_parameters(cls))
        try:
            signature.bind(None, *args, **kwargs)
        except TypeError as error:
            raise OpArgumentError(f"{cls.__name__}: {error}; it takes {shown}") from None
        return super().__new__(cls)

    def __init__(self, *, target: str | None = None, **params: Any) -> None:
        cls = type(self)
        name = cls.__name__
        if is_compiling():
            raise OpArgumentError(
                f"{name}: an op cannot be constructed inside a function torch.compile traces (its call path "
                "is generated code); construct it outside, e.g. in the module's __init__, and call it inside"
            )
        self._signature = cls.signature()
        self.params: dict[str, Any] = self._signature.bind_params(params)
        define_custom_op(cls)
        load_backends()
        self._requested_target = None if target is None else check_target_name(target, f"{name}(target=...)")
        registrations = registry.kernel_types(name)
        registered = {key: reg.value for key, reg in registrations.items()}
        self._implementations: dict[type[KernelInterface], InterfaceImplementations] = check_implementations(
            name, cls.kernel_interfaces, cls.in_tree_keys(), registered, {k: r.registrant() for k, r in registrations.items()}
        )
        self._kernel_caches: dict[type[KernelInterface], dict[CallSpec, Kernel]] = {
            interface: {} for interface in cls.kernel_interfaces
        }
        self._built: dict[tuple[str, Any], Kernel] = {}
        self._target: str | None = None
        self.target_reason = "not bound yet: the target is chosen on the first call that runs an implementation"
        self._target_kernels: dict[tuple, Callable[..., Any]] = {}
        # Held on cache misses only, so that concurrent first calls bind and build once.
        self._miss_lock = threading.RLock()
        self._call_path_factory = call_path_factory(self._signature, self.params)
        # The in-tree implementations' results fit the signature by construction (and their
        # tests say so); checking them would cost a tenth of a decode call. A backend's
        # implementation of a kernel interface is third-party code: its results are checked.
        self._check_results = bool(registered)
        self._make_call_path(runs_forward=False)
        self.trace_key = instance_key(self)  # compiled calls run this instance, as eager ones do
        self.differentiation = cls.wiring()
        #: The backward op that differentiates this instance's calls, with its params and the
        #: target it asked for (so a target that serves this op serves its backward too, or
        #: the backward call says that it does not).
        self.backward_op: Op | None = None
        #: Where the instance was built with ``consume_inputs=True``: the backward op that writes
        #: the gradients over the forward's inputs (the autograd node runs it where that is safe).
        self.in_place_backward_op: Op | None = None
        #: Skipped outputs -> the backward op built with ``skip_outputs`` naming them, for a
        #: backward pass where the inputs they are the gradients of want none (frozen
        #: parameters). Built here, once: a compiled backward picks one while it is traced.
        self._skipping_backward_ops: dict[tuple[str, ...], Op] = {}
        if self.differentiation is not None:
            params = {name: value for name, value in self.params.items() if name != CONSUME_INPUTS}
            backward_class = cls.backward_class()
            self.backward_op = backward_class(**params, target=target)
            for skipped in self.differentiation.skippable_sets:
                self._skipping_backward_ops[skipped] = backward_class(**params, skip_outputs=skipped, target=target)
            if self.params.get(CONSUME_INPUTS):
                self.in_place_backward_op = cls.backward_class(in_place=True)(**params, target=target)

    def backward_op_for(self, needed: Sequence[bool], present: Sequence[bool]) -> Op:
        """The backward op of a backward pass that needs the gradients of the forward inputs
        ``needed`` flags (``present``: those the call had): ``backward_op``, or the one that
        skips the gradients that no input needs and that may be skipped (frozen parameters')."""
        skipped = self.differentiation.skipped_gradients(needed, present)
        return self._skipping_backward_ops[skipped] if skipped else self.backward_op

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({params})"

    def __reduce__(self):
        # A copy (copy.deepcopy of a model) or a pickle is a new instance with the same params
        # and requested target: the bound target and the built kernels belong to this process
        # and its devices, and are chosen again on the new instance's first call.
        return _reconstruct, (type(self), dict(self.params), self._requested_target)

    @property
    def requested_target(self) -> str | None:
        """The target given at construction (``target=``), or None."""
        return self._requested_target

    @property
    def target(self) -> str | None:
        """The bound target (``BUILTIN`` for the in-tree implementations), or None if unbound."""
        return self._target

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            return traced_call(self, args, kwargs)
        if self._call_path is None:
            return self._call_reference(args, kwargs)
        try:
            return self._call_path(*args, **kwargs)
        except CallDeclined as declined:
            if declined.__traceback__.tb_next.tb_next is not None:
                raise  # declined by a call path that this one ran, not by this one
            return self._call_reference(args, kwargs)
        except TypeError as error:
            if error.__traceback__.tb_next is not None:
                raise  # raised while the call ran, not by Python binding its arguments
            return self._call_reference(args, kwargs)

    def _make_call_path(self, *, runs_forward: bool) -> None:
        """(Re)make the generated call path: once the in-tree implementations are bound it
        runs ``forward`` itself; until then, or for another target, it hands the checked call
        to ``_run_bound``; a call that records autograd history goes to ``_differentiate``."""
        make = self._call_path_factory
        self._call_path = None if make is None else make(
            forward=self.forward, run_bound=self._run_bound, runs_forward=runs_forward,
            check_results=self._check_results, differentiate=self._differentiate,
        )

    def _differentiate(self, call: BoundCall) -> Any:
        """A checked call that records autograd history: the op's autograd node runs it."""
        return autograd.run_eager(self, call)

    def _call_reference(self, args: tuple, kwargs: dict) -> Any:
        """The reference binder: precise errors, copies of non-contiguous inputs, empty writes,
        and calls that record autograd history."""
        signature = self._signature
        call = signature.bind(self.params, args, kwargs)
        if self.differentiation is not None and self.differentiation.needs_grad(call.inputs):
            return autograd.run_eager(self, call)
        if signature.writes_nothing(call):
            return signature.empty_result(call)
        return self._run_bound(call)

    def _run_bound(self, call: BoundCall) -> Any:
        target = self._target
        if target is None:
            return self._bind_and_run(call, wanted=None)
        return self._run(target, call, wanted=None)

    def run_saving(self, call: BoundCall, wanted: int) -> tuple[Any, tuple]:
        """Run a checked call of a differentiable op as a differentiated call does: ``(result,
        statistics)``, the statistics its backward reads as the implementation computed them
        (None for each it did not: a target's kernel computes only the result). ``wanted``:
        the forward inputs whose gradients are computed, a bit per input position."""
        target = self._target
        if target is None:
            return self._bind_and_run(call, wanted=wanted)
        return self._run(target, call, wanted=wanted)

    def backward_inputs(self, /, *args: Any, grads: Sequence[Any], **kwargs: Any) -> tuple[Any, list]:
        """``(result, arguments)``: the call ``op(*args, **kwargs)`` run as a call that records
        autograd history runs it (every gradient wanted; nothing recorded), and the backward op's
        arguments, in its signature's order, for the outputs' incoming gradients ``grads`` (None
        for an output the caller does not use), as the call's autograd node would hand them: the
        forward's own inputs, outputs and statistics. For a tool that runs the backward op alone
        on what a training step gives it (``tileops bench --backward``)."""
        wiring = self.differentiation
        if wiring is None:
            raise TypeError(f"{type(self).__name__} declares no backward op")
        call = self._signature.bind(self.params, args, kwargs)
        wanted = sum(1 << i for i in wiring.differentiable if call.inputs[i] is not None)
        with torch.no_grad():
            result, saved = self.run_saving(call, wanted)
            outputs = result if isinstance(result, tuple) else (result,)
            saved = wiring.complete_saved(self, call.inputs, outputs, saved, wanted)
        kept = wiring.kept(call.inputs, outputs, saved)
        return result, wiring.backward_arguments(grads, kept, autograd.described(outputs))

    def _run(self, target: str, call: BoundCall, *, wanted: int | None) -> Any:
        """``call`` run by ``target``; ``wanted`` None: a call that saves nothing, else a
        differentiated call's wanted gradients (``run_saving``)."""
        check = self._signature.check_result
        if target == BUILTIN:
            # Results are checked where a backend's implementation may have computed them, as the
            # generated path checks them (the in-tree implementations' fit by construction).
            if wanted is not None:
                wiring = self.differentiation
                told = {"wanted": wiring.wanted_names(wanted)} if wiring.saves_for_inputs else {}
                result, saved = self.forward_saving(*call.inputs, **call.outs, **told)
                return (check(result, call, "forward") if self._check_results else result), saved
            result = self._without_skipped(self.forward(*call.inputs, **call.outs))
            return check(result, call, "forward") if self._check_results else result
        inputs = call.inputs
        if self._signature.uncopied_inputs:
            # A target is promised contiguous inputs that are not written; one whose shape alone
            # is read (an autograd node's stand-in), or a row view, reaches the in-tree path as it came.
            inputs = tuple(t.contiguous() if i in self._signature.uncopied_inputs and t is not None else t
                           for i, t in enumerate(inputs))
        key = (call.device, *[None if t is None else (t.dtype, t.shape) for t in inputs])
        kernel = self._target_kernels.get(key)
        if kernel is None:
            kernel = self._build_target_kernel(target, call, key)
        result = check(self._without_skipped(kernel(*inputs, **call.outs)), call, f"target {target!r}")
        return result if wanted is None else (result, (None,) * len(self.differentiation.saves))

    def _without_skipped(self, result: Any) -> Any:
        """``result`` with None for each output the instance skips (``skip_outputs``), whatever
        the implementation returned there: it may compute them anyway (a target's kernel, built
        without the param, does). The generated path does the same on its fast path."""
        skipped = self.params.get(SKIP_OUTPUTS)
        if skipped and type(result) is tuple and len(result) == len(self._signature.entry.outputs):
            return tuple(None if decl.name in skipped else r for decl, r in zip(self._signature.entry.outputs, result))
        return result

    def _bind_and_run(self, call: BoundCall, *, wanted: int | None) -> Any:
        # The choice is published (``self._target``) only once the binding call succeeded. Until
        # then every other thread reads None and waits on the miss lock for the outcome, so no
        # thread runs, builds or caches a kernel of a binding that is then undone: the binding,
        # its undo and the kernel caches change together, under this lock.
        with self._miss_lock:
            if self._target is not None:  # another thread bound it meanwhile
                return self._run(self._target, call, wanted=wanted)
            target, reason = bind_target(
                type(self).__name__, self._requested_target, call.device, has_own_kernels=self.has_own_kernels
            )
            try:
                result = self._run(target, call, wanted=wanted)
            except BaseException:
                # The binding call failed: forget everything built under the choice.
                self.target_reason = "not bound yet: the call that would have bound it failed"
                self._target_kernels.clear()
                self._built.clear()
                for cache in self._kernel_caches.values():
                    cache.clear()
                raise
            self._target, self.target_reason = target, reason
            if target == BUILTIN:
                self._make_call_path(runs_forward=True)
            return result

    def _build_target_kernel(self, target: str, call: BoundCall, key: tuple) -> Callable[..., Any]:
        with self._miss_lock:
            kernel = self._target_kernels.get(key)
            if kernel is None:
                kernel = self._call_builder(target, call)
                self._target_kernels[key] = kernel
            return kernel

    def _call_builder(self, target: str, call: BoundCall) -> Callable[..., Any]:
        name = type(self).__name__
        registration = registry.builder(name, target)
        if registration is None:  # bound while it was registered, then its registration was undone
            raise OpNotAvailableError(
                f"{name}: target {target!r} is bound, but its kernel builder for {name} is no longer "
                "registered (the registration was undone); construct a new op instance"
            )
        build = registration.value
        builder = f"the kernel builder of target {target!r} ({describe_callable(build)}, registered by {registration.registrant()})"
        specs = [None if t is None else TensorSpec.of(t) for t in call.inputs]
        # skip_outputs is the in-tree kernels' to read: a target computes what it computes, and
        # the instance returns None for the skipped outputs (``_run``).
        built_with = {name: value for name, value in self.params.items() if name != SKIP_OUTPUTS}
        try:
            inspect.signature(build).bind(*specs, **built_with)
        except TypeError as error:
            inputs = ", ".join(self._signature.input_names)
            params = ", ".join(built_with)
            raise BackendError(
                f"{name}: {builder} cannot be called as build_kernel({inputs}, *, {params}): {error}. "
                "build_kernel takes one TensorSpec (or None) per input, positionally, and the op's params "
                "as keywords"
            ) from None
        except ValueError:
            pass  # no signature to read (a builtin): the call itself says what is wrong
        kernel = build(*specs, **built_with)
        if not callable(kernel):
            raise BackendError(
                f"{name}: {builder} returned {type(kernel).__name__}, which is not callable; "
                "build_kernel must return the kernel to call"
            )
        return kernel

    # -- the in-tree path ---------------------------------------------------------------------
    def forward(self, *inputs: Any, **outs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no in-tree forward")

    def forward_saving(self, *inputs: Any, **outs: Any) -> tuple[Any, tuple]:
        """A differentiable op's in-tree forward for a call that records autograd history:
        ``(result, statistics)``, the statistics (those its manifest entry's ``backward.saves``
        names, in that order) computed by the same pass, or None for each the implementation
        did not compute. An op whose entry declares ``saved_for`` is also passed ``wanted``, the
        names of the inputs whose gradients the call computes: a statistic saved for another
        input is not computed (None)."""
        raise NotImplementedError(f"{type(self).__name__} declares a backward op but defines no forward_saving")

    def kernel_for(self, interface: type[KernelInterface], *call: Any) -> Kernel:
        """The implementation of ``interface`` that serves a call: selected, built once per
        build identity, and cached.

        ``call`` is a call spec (``interface.call_spec``), or fields that ``call_spec`` turns
        into one (by default the spec's fields in order): then the spec itself is built only
        when the cache misses, which keeps the hit path to one dictionary lookup.
        """
        kernel = self._kernel_caches[interface].get(call)
        if kernel is None:
            kernel = self._select_and_build(interface, call)
        return kernel

    def _select_and_build(self, interface: type[KernelInterface], fields: tuple) -> Kernel:
        with self._miss_lock:
            kernel = self._kernel_caches[interface].get(fields)
            if kernel is None:
                kernel = self._build_entry(interface, fields)
                self._kernel_caches[interface][fields] = kernel
            return kernel

    def call_spec(self, interface: type[KernelInterface], *fields: Any) -> CallSpec:
        """The call spec that ``kernel_for(interface, *fields)`` stands for, built on a miss.

        By default ``fields`` are the spec's fields in order. An op whose specs hold facts fixed
        at construction (a row length, a constant) may override it and pass ``kernel_for`` only the
        facts that vary between calls: a shorter key is a cheaper lookup.
        """
        return interface.call_spec(*fields)

    def _build_entry(self, interface: type[KernelInterface], fields: tuple) -> Kernel:
        if len(fields) == 1 and isinstance(fields[0], CallSpec):
            call = fields[0]
        else:
            try:
                call = self.call_spec(interface, *fields)
            except TypeError as error:
                raise BackendError(
                    f"{type(self).__name__}: kernel_for({interface.__name__}, ...) got fields that do not "
                    f"build a {interface.call_spec.__name__}: {error}"
                ) from None
        call.validate()
        implementations = self._implementations[interface]
        key = implementations.select(call)
        cls = implementations.classes[key]
        where = f"{type(self).__name__}: implementation {key!r} ({cls.__module__}.{cls.__qualname__})"
        try:
            entry = cls.entry_for(call)
        except TileOpsError:
            raise  # TileOPs' own errors already say who has to act
        except Exception as error:
            raise BackendError(
                f"{where}: entry_for raised {type(error).__name__}: {error} for {call}. "
                "This is a fault of that implementation; report it to its authors, or uninstall it"
            ) from error
        if not (isinstance(entry, tuple) and len(entry) == 2 and callable(entry[1])):
            raise BackendError(f"{where}: entry_for returned {type(entry).__name__}, not (identity, factory)")
        identity, factory = entry
        try:
            hash(identity)
        except TypeError as error:
            raise BackendError(
                f"{where}: entry_for returned an identity that cannot key the cache of built kernels "
                f"({error}); return a hashable identity (a tuple, a str, a number)"
            ) from None
        kernel = self._built.get((key, identity))
        if kernel is None:
            kernel = factory()
            if not isinstance(kernel, cls):
                raise BackendError(
                    f"{type(self).__name__}: {cls.__qualname__}.entry_for returned a factory that built "
                    f"{type(kernel).__name__}, not a {cls.__qualname__}"
                )
            self._built[(key, identity)] = kernel
        return kernel

    def verdicts(
        self, interface: type[KernelInterface], call: CallSpec, facts: DeviceFacts | None = None
    ) -> list[Verdict]:
        """Every key's verdict for ``call``; with ``facts``, as if the device had those facts."""
        implementations = self._implementations[interface]
        if facts is None:
            return implementations.verdicts(call)
        return implementations.verdicts(call, lambda _call: facts)

    def implementations(self) -> dict[type[KernelInterface], InterfaceImplementations]:
        return dict(self._implementations)

    @property
    def has_own_kernels(self) -> bool:
        """Whether any kernel interface of the op has an implementation (in-tree or registered):
        without one, only a target's kernel builder can serve it (see ``bind_target``)."""
        return any(impls.classes for impls in self._implementations.values())

    def call_specs(
        self, device: torch.device, inputs: Mapping[str, TensorDescription]
    ) -> dict[type[KernelInterface], CallSpec]:
        """The call spec of each kernel interface a call with ``inputs`` on ``device`` uses,
        described without tensors (``tileops explain`` asks this; the inputs left out are the
        optional ones the call omits).

        An op that ``explain`` can describe overrides it, building each spec through the same
        function its ``forward`` builds them with (``call_spec``), so that both say the same.
        """
        raise BackendError(
            f"{type(self).__name__} does not describe calls without tensors: it defines no call_specs(device, inputs)"
        )

    def served_beyond_general(
        self, device: torch.device, inputs: Mapping[str, TensorDescription], facts: DeviceFacts | None = None
    ) -> bool:
        """Whether a call with ``inputs`` (descriptions, as ``call_specs`` takes them) on
        ``device`` would run an implementation narrower than the ``general`` (catch-all) ones on
        every kernel interface it uses: one written for such calls, where a family's catch-all
        may be its plain-torch reference or a slow kernel. A target's own kernels count as
        narrower; a call nothing serves (or whose device's facts cannot be read) does not.
        Reads the device's facts unless ``facts`` are given: call it outside a traced region."""
        if (self._target or self._requested_target or BUILTIN) != BUILTIN:
            return True
        for interface, spec in self.call_specs(device, inputs).items():
            implementations = self._implementations[interface]
            try:
                key = implementations.select(spec) if facts is None else implementations.select(spec, lambda _call: facts)
            except TileOpsError:
                return False
            if implementations.classes[key].general:
                return False
        return True

    def built_kernels(self) -> list[tuple[str, Any]]:
        """(key, kernel) of every in-tree kernel this instance has built, in build order; for a
        bound target, (target, kernel) of each of its kernels."""
        return [(key, kernel) for (key, _), kernel in self._built.items()] + [
            (self._target or "", kernel) for kernel in self._target_kernels.values()
        ]

    def request_tune(self) -> None:
        """Ask every kernel this instance has built to tune itself on its next call."""
        for kernel in [*self._built.values(), *self._target_kernels.values()]:
            request = getattr(kernel, "request_tune", None)
            if callable(request):
                request()


#: Op classes by name: a forward finds the backward op its manifest entry names here.
_op_classes: dict[str, list[type[Op]]] = {}


def _reconstruct(cls: type[Op], params: dict[str, Any], target: str | None) -> Op:
    """An instance of ``cls`` as ``Op.__reduce__`` describes it."""
    return cls(**params) if target is None else cls(**params, target=target)


def constructor_mismatch(cls: type[Op]) -> list[str]:
    """How ``cls.__init__`` disagrees with its manifest params (names, order, defaults)."""
    entry = cls.manifest_entry()
    params = [p for p in inspect.signature(cls.__init__).parameters.values()][1:]
    problems = []
    got = [p for p in params if p.name != "target"]
    expected = list(entry.params)
    if [p.name for p in got] != [p.name for p in expected]:
        problems.append(
            f"{cls.__name__}.__init__ takes ({', '.join(p.name for p in got)}), the manifest declares "
            f"({', '.join(p.name for p in expected)})"
        )
        return problems
    for param, decl in zip(got, expected):
        has_default = param.default is not inspect.Parameter.empty
        if has_default == decl.required or (has_default and param.default != decl.default):
            problems.append(
                f"{cls.__name__}.__init__: {param.name} defaults to "
                f"{param.default if has_default else 'nothing'}, the manifest says "
                f"{'nothing' if decl.required else repr(decl.default)}"
            )
        if (param.kind is inspect.Parameter.KEYWORD_ONLY) != decl.keyword_only:
            problems.append(
                f"{cls.__name__}.__init__: {param.name} is {'' if param.kind is inspect.Parameter.KEYWORD_ONLY else 'not '}"
                f"keyword-only, the manifest says keyword_only: {str(decl.keyword_only).lower()}"
            )
    target = next((p for p in params if p.name == "target"), None)
    if target is None or target.kind is not inspect.Parameter.KEYWORD_ONLY or target.default is not None:
        problems.append(f"{cls.__name__}.__init__ must take target=None as a keyword-only argument")
    return problems
