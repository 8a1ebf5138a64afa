"""Host reads: the ops that make the host wait for the device, counted over a stretch of code (a step).

    with HostReads() as reads:
        ...                       # a training step
    reads.device                  # device-to-host reads: each a wait for the accelerator's queue
    reads.host                    # reads of host-side tensors by design (a CPU/gloo collective's flag)

What counts as a read: the ops whose result the host needs before it can go on (`READ_OPS`:
`aten::_local_scalar_dense`, where `.item()`, `bool(t)`, `float(t)`, `int(t)` and `if t:` end;
`nonzero`, `masked_select`, `unique` and `repeat_interleave`, whose output size is the data's; `equal`),
indexing with a boolean mask (`aten::index` / `index_put` with a bool index: a `nonzero` inside), and,
seen one level up (`__torch_function__`, since on the CPU they never reach the dispatcher), `.tolist()`,
`.numpy()` and `.cpu()`. A `.to("cpu")` is not seen: on a CPU run it is the same call as `.to(device)`.

Which reads are the device's: on a CPU run every tensor is a host tensor, so where a tensor would live on a
GPU is tracked instead. A tensor is a *host tensor* when it was marked so (`host_tensor(t)`: a tensor made
on purpose on the CPU, such as the preemption agreement's flags for its gloo group) or when every tensor
an op read to make it was a host tensor (its views, its all-reduce, `flags[0]`). Every other tensor would
live on the accelerator: the parameters, gradients, optimizer state, the batch, the loss and whatever
DeepSpeed makes beside them. A read is a host read when every tensor it reads is a host tensor, else a
device read; a host tensor that an op writes device values into stops being one. Marking cannot hide a
device read: a read of a tensor made from device values is a device read wherever it happens.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

# Ops whose result (a value or a size) the host must have before it goes on.
READ_OPS = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
    aten._unique.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor, aten.equal.default,
}
INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# Methods that copy to the host without reaching the dispatcher on a CPU run.
READ_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu"}

_ACTIVE: list[HostReads] = []  # the counters open now (innermost last)
_HERE = str(Path(__file__).resolve())


def host_tensor(t: torch.Tensor) -> torch.Tensor:
    """Mark `t` as made on the host on purpose (a flag for a CPU process group): reads of it, and of what
    is computed from it alone, are host reads. Returns `t`; a no-op (a list test) without a counter open."""
    for counter in _ACTIVE:
        counter.mark_host(t)
    return t


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]


def _bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _where() -> str:
    """The innermost caller outside torch and this file: 'file:line function', what a report names."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename.replace("\\", "/")
        if name == _HERE or "/torch/" in name:
            continue
        short = name.split("site-packages/")[-1] if "site-packages/" in name else "/".join(name.split("/")[-3:])
        return f"{short}:{frame.lineno} {frame.name}"
    return "?"


class _Methods(TorchFunctionMode):
    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = READ_METHODS.get(func)
        if what is not None and args and isinstance(args[0], torch.Tensor) and not self.owner.paused:
            self.owner.read(what, [args[0]])
        return func(*args, **kwargs)


class HostReads(TorchDispatchMode):
    """Counts the host reads made while open, device and host-by-design apart (the module says how);
    `sites` says where each device read was made ('file:line function' -> count)."""

    def __init__(self) -> None:
        super().__init__()
        self._host = WeakIdKeyDictionary()
        self.device = 0
        self.host = 0
        self.ops: Counter[str] = Counter()  # op name -> device reads
        self.sites: Counter[str] = Counter()  # where -> device reads
        self._methods = _Methods(self)
        self.paused = False  # `outside()`: neither counted nor tracked

    @contextmanager
    def outside(self) -> Iterator[None]:
        """Within: nothing counted or tracked, for host work that a real run does in other processes (the
        loader's workers); what it returns is unmarked, so a device tensor from then on, as the batch the
        trainer copies to the device is."""
        self.paused, before = True, self.paused
        try:
            yield
        finally:
            self.paused = before

    def mark_host(self, t: torch.Tensor) -> None:
        self._host[t] = True

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self._host

    def read(self, what: str, tensors: list[torch.Tensor]) -> None:
        if tensors and all(self.is_host(t) for t in tensors):
            self.host += 1
            return
        self.device += 1
        self.ops[what] += 1
        self.sites[_where()] += 1

    def counts(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        inputs = _tensors(args, kwargs)
        if func in READ_OPS or (func in INDEX_OPS and _bool_index(args)):
            self.read(func.__name__ if func in READ_OPS else f"{func.__name__} (bool mask)", inputs)
        out = func(*args, **kwargs)
        # Host in, host out; anything that read a device tensor (an in-place write included) is the device's.
        host = bool(inputs) and all(self.is_host(t) for t in inputs)
        for t in _tensors(out, {}):
            if host:
                self._host[t] = True
            elif t in self._host:
                del self._host[t]
        return out

    def __enter__(self) -> HostReads:
        _ACTIVE.append(self)
        self._methods.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._methods.__exit__(*exc)
        _ACTIVE.remove(self)
