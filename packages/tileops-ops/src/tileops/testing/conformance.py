"""The conformance kit: checks a target, or an added kernel type, against the manifest.

Each kit lists named checks (``checks()``); a backend's test module parametrizes one test
over them, so every check is its own test with its own name::

    kit = TargetConformance("acme", device="cpu", backend_module="tileops_acme")

    @pytest.mark.parametrize("check", kit.checks(), ids=str)
    def test_acme(check):
        check()
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tileops.backend import BUILTIN, OpNotAvailableError, registered_targets
from tileops.core import Op
from tileops.core.manifest import DTYPES, Workload
from tileops.ops import FAMILIES

from . import check_empty_write, check_workload, resize_batch, smallest_workload, workload_elements


@dataclasses.dataclass(frozen=True)
class Check:
    """One named conformance check; call it to run it (it raises AssertionError on failure)."""

    name: str
    run: Callable[[], None]

    def __call__(self) -> None:
        self.run()

    def __str__(self) -> str:
        return self.name


def _all_ops() -> list[type[Op]]:
    return [op for ops in FAMILIES.values() for op in ops]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _builds(op: Op, target: str) -> int:
    """How many kernels ``op`` has had ``target``'s builder build: ``Op`` keeps each one, by
    the input layout it was built for, in ``built_kernels``."""
    return sum(1 for key, _ in op.built_kernels() if key == target)


class TargetConformance:
    """Checks that ``target`` serves, on ``device``, every op it registers a builder for.

    ``target`` may be ``BUILTIN`` to check the in-tree implementations on ``device``.
    Workloads above ``max_elements`` (all inputs together) are left out, and said so in the
    check list. ``backend_module`` names the module whose import registers the target; it is
    imported in a fresh interpreter to check that importing builds no kernel. ``ops`` limits the
    checks to those op classes (one family's ``OPS``, say); by default every op is checked.
    """

    def __init__(
        self,
        target: str,
        *,
        device: str | torch.device,
        max_elements: int | None = 1 << 24,
        backend_module: str | None = None,
        ops: Sequence[type[Op]] | None = None,
    ) -> None:
        self.target = target
        self.device = torch.device(device)
        self.max_elements = max_elements
        self.backend_module = backend_module
        self.ops = _all_ops() if ops is None else list(ops)

    def served_ops(self) -> list[type[Op]]:
        if self.target == BUILTIN:
            return list(self.ops)
        return [op for op in self.ops if self.target in registered_targets(op.__name__)]

    def checks(self) -> list[Check]:
        checks: list[Check] = []
        if self.backend_module is not None:
            checks.append(Check(f"{self.target}: importing {self.backend_module} builds no kernel", self._check_import))
        served = self.served_ops()
        if self.target != BUILTIN:
            assert served, f"target {self.target!r} registers no kernel builder: nothing to check"
        for op_class in served:
            entry = op_class.manifest_entry()
            for workload in entry.workloads:
                if self.max_elements is not None and workload_elements(workload) > self.max_elements:
                    continue
                for dtype in workload.dtypes:
                    name = f"{self.target}: {op_class.__name__} {workload.name} {_dtype_name(dtype)}"
                    checks.append(Check(name, self._workload_check(op_class, workload, dtype)))
            # The checks of one workload test what the op does with any call: the smallest will do.
            smallest = smallest_workload(op_class)
            checks.append(Check(f"{self.target}: {op_class.__name__} empty-write call", self._empty_check(op_class, smallest)))
            if self.target != BUILTIN:
                name = f"{self.target}: {op_class.__name__} builds once per input layout"
                checks.append(Check(name, self._build_count_check(op_class, smallest)))
        if self.target != BUILTIN:
            for op_class in self.ops:
                if op_class in served:
                    continue
                if op_class.kernel_interfaces:
                    checks.append(Check(f"{self.target}: {op_class.__name__} is not served and says so", self._not_served_check(op_class)))
                else:  # no kernels of its own to fall back to: its torch code runs on the target's device
                    name = f"{self.target}: {op_class.__name__} holds no kernels and runs its own torch code"
                    checks.append(Check(name, self._own_code_check(op_class)))
        return checks

    def _op(self, op_class: type[Op], workload: Workload) -> Op:
        return op_class(**workload.params, target=self.target)

    def _workload_check(self, op_class, workload, dtype) -> Callable[[], None]:
        def run() -> None:
            op = self._op(op_class, workload)
            check_workload(op, workload, dtype, self.device)
            check_workload(op, workload, dtype, self.device, seed=1, out_buffers=True)
            assert op.target == self.target, f"{op_class.__name__}: bound {op.target!r}, not {self.target!r}"
        return run

    def _empty_check(self, op_class, workload) -> Callable[[], None]:
        def run() -> None:
            check_empty_write(self._op(op_class, workload), workload, workload.dtypes[0], self.device)
        return run

    def _build_count_check(self, op_class, workload) -> Callable[[], None]:
        def run() -> None:
            dtype = workload.dtypes[0]
            op = self._op(op_class, workload)
            check_workload(op, workload, dtype, self.device)
            check_workload(op, workload, dtype, self.device, seed=2)
            builds = _builds(op, self.target)
            assert builds == 1, f"{op_class.__name__}: build_kernel ran {builds} times for one input layout"
            entry = op_class.manifest_entry()
            first = workload.shapes[entry.inputs[0].name]
            check_workload(op, resize_batch(entry, workload, first[0] + 1), dtype, self.device)
            builds = _builds(op, self.target)
            assert builds == 2, f"{op_class.__name__}: a new input shape should build once more, builds: {builds}"
        return run

    def _own_code_check(self, op_class) -> Callable[[], None]:
        def run() -> None:
            workload = smallest_workload(op_class)
            check_workload(self._op(op_class, workload), workload, workload.dtypes[0], self.device)
        return run

    def _not_served_check(self, op_class) -> Callable[[], None]:
        def run() -> None:
            workload = smallest_workload(op_class)
            op = self._op(op_class, workload)
            from . import workload_inputs

            inputs = workload_inputs(op_class.manifest_entry(), workload, workload.dtypes[0], self.device)
            try:
                op(**inputs)
            except OpNotAvailableError as error:
                assert op_class.__name__ in str(error) and repr(self.target) in str(error), str(error)
            else:
                raise AssertionError(f"{op_class.__name__} with target={self.target!r} ran instead of raising OpNotAvailableError")
        return run

    def _check_import(self) -> None:
        """Import the backend in a fresh interpreter with every builder it registers wrapped in
        a counter: importing must call none of them, and must not import tilelang."""
        code = f"""
import json, sys
import tileops.backend as backend
calls = []
original = backend.register_kernel_builder
def counting_register(op, target, build_kernel):
    def counted(*a, **k):
        calls.append(op)
        return build_kernel(*a, **k)
    original(op=op, target=target, build_kernel=counted)
backend.register_kernel_builder = counting_register
import {self.backend_module}
print(json.dumps({{"builds": calls, "tilelang": "tilelang" in sys.modules}}))
"""
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, f"importing {self.backend_module} failed:\n{result.stderr}"
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["builds"] == [], f"importing {self.backend_module} built kernels for {report['builds']}"
        assert not report["tilelang"], f"importing {self.backend_module} imported tilelang"


class KernelTypeConformance:
    """Checks an implementation added with ``register_kernel_type``.

    ``inside`` are calls it must serve (it must be the selected key, with correct results);
    ``outside`` are calls it must leave to the others (still correct). Each call is a dict
    with ``shapes`` (input name -> shape), ``params`` and ``dtype`` (a name, e.g. "float32").
    """

    def __init__(
        self,
        op: type[Op],
        key: str,
        *,
        device: str | torch.device,
        inside: Sequence[dict[str, Any]],
        outside: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.op, self.key, self.device = op, key, torch.device(device)
        self.inside, self.outside = list(inside), list(outside)

    def checks(self) -> list[Check]:
        checks = [Check(f"{self.key}: registered for {self.op.__name__}", self._check_registered)]
        for i, call in enumerate(self.inside):
            checks.append(Check(f"{self.key}: serves {call['shapes']} {call['dtype']}", self._call_check(call, True, i)))
        for i, call in enumerate(self.outside):
            checks.append(Check(f"{self.key}: leaves {call['shapes']} {call['dtype']} to others", self._call_check(call, False, i)))
        return checks

    def _check_registered(self) -> None:
        op = self.op(**(self.inside or self.outside)[0]["params"])  # construction checks the contract
        held = {key for implementations in op.implementations().values() for key in implementations.classes}
        assert self.key in held and self.key not in self.op.in_tree_keys(), (
            f"{self.key!r} is not registered for {self.op.__name__}; is the backend installed?"
        )

    def _call_check(self, call: dict[str, Any], inside: bool, index: int) -> Callable[[], None]:
        def run() -> None:
            dtype = DTYPES[call["dtype"]]
            workload = Workload(f"call{index}", {k: tuple(v) for k, v in call["shapes"].items()}, (dtype,), call["params"])
            op = self.op(**call["params"], target=BUILTIN)
            check_workload(op, workload, dtype, self.device)
            served = {key for key, _ in op.built_kernels()}
            if inside:
                assert served == {self.key}, f"{self.op.__name__} {call['shapes']}: served by {served}, expected {self.key!r}"
            else:
                assert self.key not in served, f"{self.op.__name__} {call['shapes']}: {self.key!r} served a call outside its region"
        return run
