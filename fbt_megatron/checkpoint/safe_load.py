"""Loading checkpoint metadata without running pickled code.

torch_dist's ``.metadata`` file is a pickle. It is read with a restricted unpickler that admits only
torch's and megatron's checkpoint-metadata classes and a few torch/builtin names; anything else
(``os.system`` ...) raises ``UnpicklingError``. ``state.json``, RNG and manifest files are JSON, and
megatron's ``common.pt`` is read with ``torch.load(weights_only=True)`` (torch's default).
"""

from __future__ import annotations

import io
import pickle

_ALLOWED_PICKLE_PREFIXES = (
    "torch.distributed.checkpoint.",
    "torch.distributed._shard.",
    "megatron.core.dist_checkpointing.",
)
_ALLOWED_PICKLE_GLOBALS = {
    ("torch", "Size"), ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"),
    ("torch", "float64"), ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"), ("torch", "bool"),
    ("torch", "strided"), ("torch", "contiguous_format"), ("torch", "device"),
    ("torch", "dtype"), ("torch", "layout"), ("torch", "memory_format"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("builtins", "getattr"), ("torch.serialization", "_get_layout"),
    # DCP records the checkpoint path (a PosixPath) in its storage metadata; building one runs no code
    ("pathlib", "PosixPath"), ("pathlib", "Path"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED_PICKLE_GLOBALS or module.startswith(_ALLOWED_PICKLE_PREFIXES):
            if (module, name) == ("builtins", "getattr"):
                return _safe_getattr
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def _safe_getattr(obj, name):
    # torch pickles dtypes/memory formats as getattr(torch, "float32"); nothing else is admitted.
    import torch as _torch

    if obj is _torch and isinstance(getattr(_torch, name, None), (_torch.dtype, _torch.layout,
                                                                   _torch.memory_format)):
        return getattr(_torch, name)
    raise pickle.UnpicklingError(f"checkpoint metadata calls getattr({obj!r}, {name!r}); not allowed")


class SafePickleModule:
    """Stands in for the ``pickle`` module inside torch's checkpoint file-system reader."""

    def __getattr__(self, name):
        return getattr(pickle, name)

    @staticmethod
    def load(file, **kwargs):
        return _RestrictedUnpickler(file, **kwargs).load()

    @staticmethod
    def loads(data, **kwargs):
        return _RestrictedUnpickler(io.BytesIO(data), **kwargs).load()


def install_safe_metadata_reader() -> None:
    from torch.distributed.checkpoint import filesystem

    if not isinstance(filesystem.pickle, SafePickleModule):
        filesystem.pickle = SafePickleModule()
