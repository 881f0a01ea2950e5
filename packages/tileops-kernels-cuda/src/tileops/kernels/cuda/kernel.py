"""``TileLangKernel``: the base class of the in-tree TileLang kernels, with one forward for
every kernel kind.

A kernel kind declares what its compiled programs take and give, and the base class does the
rest. Declarations (class attributes):

``family``, ``kind``
    Name the kernel's entries in the tuning store (``tuning.entry_key``).
``outputs``
    The tensors the forward allocates and passes the program after its arguments, each an
    ``Output``: like one argument (its shape, dtype and device), or from shape and dtype
    functions of the arguments and the kernel's ``params`` (any shape, 0-dim included). One
    output is returned alone, several as a tuple.
``order``
    The positions of the interface's arguments the program takes, in its order (default: all
    of them, in the interface's order); an argument that is None is left out of the launch.
``size_of``
    The argument whose rank picks the compiled rank and whose size the build (default: 0).
``ranks_built_eagerly``
    Ranks of the main build compiled with the kernel rather than on the first call of that rank.

Per instance, from its build identity (hooks a kind defines): ``identity()``,
``default_config()``, ``tuning_candidates()``, ``build_plan(config)`` (a ``BuildPlan``: the
builds, the (size bound -> build) list that chooses one per call, what ``config`` shows),
``compile(config, rank)`` and ``tuning_subject(tensor)``.

Each kernel's forward is the C++ ``fast_launch.Launcher`` where that could be built and every
output is like an argument, and the Python ``forward`` below otherwise; both choose the build
by the same ``BuildPlan.choices``, and the C++ one hands the Python one every call it does not
handle. A kernel launches in its tensors' device context whatever the current device is, and
tunes on request (``request_tune``) on the next call.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from tileops.core import Kernel, KernelInterface

from . import fast_launch, tuning
from .compile import CompiledByRank, entry_function
from .device import compile_target, current_device_index, gpu_model

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Output:
    """One tensor a kernel allocates for its program: like an argument, or computed."""

    like: int | None = None
    shape: Callable[[tuple, Any], Shape] | None = None
    dtype: Callable[[tuple, Any], torch.dtype] | None = None

    @classmethod
    def like_argument(cls, position: int) -> Output:
        """Shaped, typed and placed as the call's argument at ``position`` (``empty_like``)."""
        return cls(like=position)

    @classmethod
    def computed(cls, shape: Callable[[tuple, Any], Shape], dtype: Callable[[tuple, Any], torch.dtype]) -> Output:
        """``shape(arguments, params)`` and ``dtype(arguments, params)``, on the call's device
        (the sizing argument's); ``()`` is a scalar result."""
        return cls(shape=shape, dtype=dtype)

    def __post_init__(self) -> None:
        if (self.like is None) == (self.shape is None) or (self.shape is None) != (self.dtype is None):
            raise ValueError("an Output is like an argument (like=i) or computed (shape= and dtype=), not both or neither")


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """The builds of a kernel with one configuration, and which call takes which.

    builds: name -> configuration, the main build first (tuning times the main one); choices:
    (bound, build name) with increasing bounds: a call whose sizing argument (``size_of``) has
    at most ``bound`` elements takes that build, the first that holds; the others ``default``
    (None: the main build). untuned: build name -> why a tuning request on a call it serves
    tunes nothing. tunable: build name -> the configurations a tuning request on a call that
    build serves times instead of the main build's (its own first); the fastest replaces it, under
    a store key of its own (the kernel's and the build's name). shown: what the kernel's
    ``config`` shows.
    """

    builds: Mapping[str, dict[str, Any]]
    choices: tuple[tuple[int, str], ...] = ()
    default: str | None = None
    untuned: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tunable: Mapping[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    shown: dict[str, Any] = dataclasses.field(default_factory=dict)


def _interface_of(cls: type) -> type[KernelInterface] | None:
    """The kernel interface ``cls`` implements, or None for a base class that names none yet."""
    for base in cls.__mro__:
        if issubclass(base, KernelInterface) and base is not KernelInterface and not issubclass(base, TileLangKernel):
            return base
    return None


class TileLangKernel(Kernel):
    """One compiled TileLang kernel of one build identity on one device (see the module)."""

    family: ClassVar[str]
    kind: ClassVar[str]
    outputs: ClassVar[tuple[Output, ...]]
    order: ClassVar[tuple[int, ...] | None] = None
    size_of: ClassVar[int] = 0
    ranks_built_eagerly: ClassVar[tuple[int, ...]] = ()
    #: The interface's argument names, in order (from its ``forward``).
    argument_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        interface = _interface_of(cls)
        if interface is not None:
            parameters = list(inspect.signature(interface.forward).parameters)[1:]
            cls.argument_names = tuple(parameters)

    def __init__(self, device: torch.device, params: Any) -> None:
        super().__init__()
        self._fast_forward = None
        self.device = device
        self.params = params
        self._device_index = device.index
        #: The TileLang target its programs compile for: CUDA for the device's architecture.
        self.tilelang_target = compile_target(device)
        self._gpu_model = gpu_model(device)
        self._tuning_key = tuning.entry_key(self.family, self.kind, self.identity())
        self._order = tuple(range(len(self.argument_names))) if self.order is None else self.order
        likes = tuple(output.like for output in self.outputs)
        # Every output like an argument: empty_like, and the C++ launcher may serve the calls. A
        # kind without outputs (it writes into a tensor the caller passes) keeps its own forward.
        self._like = likes if likes and None not in likes else None
        self._tune_pending = False
        self._default_config = self.default_config()
        tuned = tuning.chosen(self._gpu_model, self._tuning_key, self._default_config)
        self._use(self._default_config if tuned is None else tuned)

    # -- what a kind defines ----------------------------------------------------------------
    def identity(self) -> tuple:
        """Everything the kernel's programs depend on besides their configuration and target."""
        raise NotImplementedError

    def default_config(self) -> dict[str, Any]:
        """The main build's launch configuration before any tuning."""
        raise NotImplementedError

    def tuning_candidates(self) -> list[dict[str, Any]]:
        """Main-build configurations worth timing, the default first."""
        raise NotImplementedError

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        """The builds the kernel has with main configuration ``config``."""
        raise NotImplementedError

    def compile(self, config: dict[str, Any], rank: int) -> Any:
        """The compiled TileLang kernel of ``config`` for tensors of ``rank``."""
        raise NotImplementedError

    def tuning_subject(self, sized: torch.Tensor) -> str:
        """What the tuning progress bar names for a call whose sizing argument is ``sized``."""
        return type(self).__name__

    # -- builds -------------------------------------------------------------------------------
    def _use(self, config: dict[str, Any]) -> None:
        plan = self.build_plan(config)
        names = list(plan.builds)
        bounds = [bound for bound, _ in plan.choices]
        if any(later <= earlier for earlier, later in zip(bounds, bounds[1:])):
            raise ValueError(f"{type(self).__name__}: the bounds of its build choices must increase, got {bounds}")
        self._main_config = config
        self._choices = tuple((bound, names.index(name)) for bound, name in plan.choices)
        self._default_build = names.index(names[0] if plan.default is None else plan.default)
        self._untuned = {names.index(name): why for name, why in plan.untuned.items()}
        self._tunable = {names.index(name): (name, candidates) for name, candidates in plan.tunable.items()}
        # A tunable build that tuning has served runs what it chose.
        builds = dict(plan.builds)
        tuned = {}
        for name in plan.tunable:
            chosen = tuning.chosen(self._gpu_model, self._build_key(name), builds[name])
            if chosen is not None and chosen != builds[name]:
                builds[name] = tuned[name] = chosen
        #: name -> that build's launch functions by rank (compiled on first use).
        self.compiled = {
            name: CompiledByRank(lambda rank, build=build: self._launch_function(build, rank))
            for name, build in builds.items()
        }
        self._builds = tuple(self.compiled.values())
        for rank in self.ranks_built_eagerly:
            self._builds[0][rank]
        self.config = {**plan.shown, "tuned_builds": tuned} if tuned else plan.shown
        if self._like is not None:
            self._fast_forward = fast_launch.launcher(
                type(self).forward.__get__(self), self._entry, self._launch_device,
                arity=len(self.argument_names), order=self._order, outputs=self._like, size_of=self.size_of,
                choices=self._choices, default_build=self._default_build,
            )
        if self._fast_forward is not None:
            # An instance attribute: the op's kernel.forward(...) calls the C++ launcher directly.
            self.forward = self._fast_forward

    def _launch_function(self, config: dict[str, Any], rank: int) -> Callable[..., None]:
        return entry_function(self.compile(config, rank))

    def _build_key(self, name: str) -> str:
        """The tuning store's key of the tunable build ``name``: the kernel's, then the name."""
        return f"{self._tuning_key}/{name}"

    def _build_for(self, elements: int) -> int:
        """Which build (its index in ``compiled``) serves a call whose sizing argument has
        ``elements``: the C++ launcher chooses by the same list."""
        for bound, build in self._choices:
            if elements <= bound:
                return build
        return self._default_build

    def _entry(self, rank: int, build: int):
        """The launch function of ``build`` (see ``_build_for``) for tensors of ``rank``."""
        return self._builds[build][rank]

    # -- the call -----------------------------------------------------------------------------
    # Where the C++ launcher could be built, it serves the plain calls and hands this forward the
    # rest: keywords, tensors elsewhere, a pending tuning request.
    def forward(self, *args: Any, **named: Any) -> Any:
        if named or len(args) != len(self.argument_names):
            args = self._bind(args, named)
        if self._like is not None:
            outputs = [torch.empty_like(args[position]) for position in self._like]
        else:
            outputs = [self._allocate(output, args) for output in self.outputs]
        tensors = [args[position] for position in self._order if args[position] is not None]
        tensors += outputs
        sized = args[self.size_of]
        build = self._build_for(sized.numel())
        if current_device_index() == self._launch_device:
            self._builds[build][sized.dim()](*tensors)
        else:
            self._launch_elsewhere(tensors, build, sized)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _bind(self, args: tuple, named: dict[str, Any]) -> tuple:
        """The call's arguments by position, or TypeError naming the interface's arguments."""
        names = self.argument_names
        unknown = sorted(set(named) - set(names))
        given_twice = sorted(set(named) & set(names[: len(args)]))
        missing = [name for name in names[len(args):] if name not in named]
        if len(args) > len(names) or unknown or given_twice or missing:
            raise TypeError(
                f"{type(self).__name__}.forward takes ({', '.join(names)}), got {len(args)} positional argument(s)"
                f" and keywords {sorted(named)}"
            )
        return (*args, *(named[name] for name in names[len(args):]))

    def _allocate(self, output: Output, args: tuple) -> torch.Tensor:
        device = args[self.size_of].device
        return torch.empty(output.shape(args, self.params), dtype=output.dtype(args, self.params), device=device)

    def _launch_elsewhere(self, tensors: list[torch.Tensor], build: int, sized: torch.Tensor) -> None:
        """The launch when the fast check in ``forward`` fails: a tuning request is pending, or
        the call's GPU is not the current one (TileLang launches in the current device's
        context, so it is made current for the launch, and restored)."""
        with torch.cuda.device(self._device_index):
            if self._tune_pending:
                build = self._tune(tensors, build, sized)
            self._builds[build][sized.dim()](*tensors)

    # -- tuning -------------------------------------------------------------------------------
    def request_tune(self) -> None:
        """Time the neighbouring launch configurations of the build that serves the next call
        (the main one, or a build the plan declares tunable), keep the fastest.

        Tuning happens once per build identity (and tunable build) and GPU model on a machine
        (see ``tuning``): a kernel built later for the same identity, in this process or another,
        starts with the chosen configurations, and a request where every one is tuned changes
        nothing.
        """
        untuned = [(self._tuning_key, self._default_config)] + [
            (self._build_key(name), candidates[0]) for name, candidates in self._tunable.values()
        ]
        self._tune_pending = any(tuning.chosen(self._gpu_model, key, like) is None for key, like in untuned)

    @property
    def _tune_pending(self) -> bool:
        return self._launch_device != self._device_index

    @_tune_pending.setter
    def _tune_pending(self, pending: bool) -> None:
        # ``forward`` compares the current device with ``_launch_device`` and nothing else, so
        # a pending request is kept as a device index no GPU has.
        self._launch_device = -1 if pending else self._device_index
        if self._fast_forward is not None:
            self._fast_forward.device = self._launch_device

    def _tune(self, tensors: list[torch.Tensor], build: int, sized: torch.Tensor) -> int:
        """Tune the build that serves this call (the main one, unless the plan declares that
        build tunable or untuned) on its tensors; the build that serves the call after."""
        if torch.cuda.is_current_stream_capturing():
            return build  # a graph being captured must not see the trial launches; tune after
        what = self.tuning_subject(sized)
        untuned = self._untuned.get(build)
        if untuned is not None:
            print(f"tuning {what}: not tuned, {untuned}", file=sys.stderr)
            self._tune_pending = False
            return build
        rank = sized.dim()
        if build in self._tunable:
            name, candidates = self._tunable[build]
            key, what = self._build_key(name), f"{what} ({name} build)"
        else:
            key, candidates = self._tuning_key, self.tuning_candidates()
        config = tuning.tune(
            self._gpu_model, key, candidates, lambda candidate: self._launch_function(candidate, rank),
            tuple(tensors), what,
        )
        self._use(self._main_config if build in self._tunable else config)
        self._tune_pending = False
        return self._build_for(sized.numel())
