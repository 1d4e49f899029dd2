"""Checkpoint loading: safetensors shards (with or without their index) and dummy weights.

Each parameter's `weight_loader` takes the checkpoint tensor and copies its own slice (tensor
parallelism, merged q/k/v and gate/up), so this file knows nothing about layouts. The tensors come
as `LazyTensor`s: `narrow` and basic slicing stay lazy, and only the slice a rank keeps is read from
the file (safetensors' `get_slice`); anything else (a torch op, a Tensor method) reads the whole
tensor, so a loader written for full tensors still works.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from collections.abc import Iterable, Iterator
from pathlib import PurePosixPath

import torch
from safetensors import safe_open
from torch import nn

from deepserve.errors import ConfigRefused, FilesMissing
from deepserve.loader.encryption import SAFETENSORS_DTYPES as _DTYPES
from deepserve.loader.encryption import SUFFIX, DecryptionError, EncryptedSafetensors
from deepserve.loader.hf_config import read_checkpoint_json

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"


def checkpoint_files(model_path: str) -> list[str]:
    """The checkpoint's shards: *.safetensors, or *.safetensors.enc when it was encrypted at rest
    (loader/encryption.py). With an index, the shards it lists (subfolders allowed, never outside the
    folder: index_shards); without one, the folder's top-level shards. A sealed checkpoint is loaded only
    whole: a plaintext shard beside sealed ones would be weights nobody authenticated (a substituted file),
    so that mix is refused."""
    shards = index_shards(model_path)
    if shards is not None:
        plain = [n for n in shards if os.path.isfile(os.path.join(model_path, n))]
        sealed = [n + SUFFIX for n in shards if _is_sealed(model_path, n)]
        missing = [n for n in shards if n not in plain and n + SUFFIX not in sealed]
        if missing:
            raise FilesMissing(f"{os.path.join(model_path, INDEX)} lists shards that are not in {model_path}, "
                               f"plain or sealed: {missing}")
        names = [n + SUFFIX if n + SUFFIX in sealed else n for n in shards]
    else:
        listed = os.listdir(model_path)
        plain = sorted(n for n in listed if n.endswith(".safetensors"))
        sealed = sorted(n for n in listed if n.endswith(".safetensors" + SUFFIX))
        names = sealed or plain
    if sealed and plain:
        raise DecryptionError(
            f"{model_path} is encrypted (*.safetensors{SUFFIX}) but also holds plaintext shards {plain}: an "
            "encrypted checkpoint loads only whole; remove them (or re-run `deepserve encrypt-model` over the "
            "plaintext checkpoint)")
    if not names:
        raise FilesMissing(
            f"no *.safetensors weights in {model_path}; convert the checkpoint to safetensors, "
            "or pass load_format='dummy' (--load-format dummy) for random weights"
        )
    return [os.path.join(model_path, n) for n in names]


def index_shards(model_path: str) -> list[str] | None:
    """The shards model_path's index lists (its weight_map's values: paths relative to model_path, normalized,
    each once, sorted), or None without an index. encrypt-model seals the same list. The index is input like
    the weights, so it is checked before any shard is opened, and refused naming it: it must be a JSON object
    whose weight_map maps tensor names to file paths. An entry that would leave the folder (absolute, or with
    a `..` part) is refused: a crafted index must not make us read (or seal) files outside the checkpoint."""
    index = os.path.join(model_path, INDEX)
    if not os.path.exists(index):
        return None
    # Each file once (a 671B index maps ~100k tensors to a few hundred files); after the type check, so a
    # list among the values is refused by name rather than a TypeError here.
    entries = set(_weight_map_files(index))
    outside = sorted({n for n in entries if os.path.isabs(n) or ".." in PurePosixPath(n).parts})
    if outside:
        raise ConfigRefused(f"{index} lists shards outside {model_path}: {outside}; its weight_map must name "
                            "files inside the checkpoint folder, by paths relative to it without '..'")
    # "", "." and "sub/" name the folder or a subfolder: opened as a shard, each would fail with a traceback.
    folders = sorted({n for n in entries if n.rsplit("/", 1)[-1] in ("", ".")})
    if folders:
        raise ConfigRefused(f"{index} lists entries that name no file: {folders}; each weight_map value must be "
                            "a shard's path, e.g. model-00001-of-00002.safetensors")
    # "./a.safetensors", "a.safetensors" and "sub//b.safetensors" are the files they normalize to: one shard
    # each, so it is read (and sealed) once.
    return sorted({posixpath.normpath(n) for n in entries})


def _weight_map_files(index: str) -> list[str]:
    """The values of the index's weight_map, checked to be strings."""
    data = read_checkpoint_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise ConfigRefused(f"{index} has no weight_map object (tensor name -> shard file); write the index again, "
                            "or remove it to load the *.safetensors at the folder's top level")
    bad = {name: file for name, file in weight_map.items() if not isinstance(file, str)}
    if bad:
        shown = dict(list(bad.items())[:3])
        raise ConfigRefused(f"{index}: weight_map values must be shard file paths (strings); got {shown}"
                            + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))
    return list(weight_map.values())


def _is_sealed(model_path: str, name: str) -> bool:
    return os.path.exists(os.path.join(model_path, name + SUFFIX))


class LazyTensor:
    """A checkpoint tensor not read yet: shape and dtype are known, `narrow(dim, start, length)` and
    `t[a:b]` / `t[:, a:b]` return a smaller LazyTensor, and the bytes are read only when a torch
    function or a Tensor method needs them (`param.data.copy_(t)`), and then only the window."""

    def __init__(self, source: object, shape: tuple[int, ...], dtype: torch.dtype,
                 window: tuple[tuple[int, int], ...] | None = None) -> None:
        self._source = source  # safetensors' slice object: `source[a:b, c:d]` reads that window
        self._full_shape = tuple(shape)
        self._window = window if window is not None else tuple((0, n) for n in shape)
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for a, b in self._window)

    @property
    def ndim(self) -> int:
        return len(self._window)

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def __len__(self) -> int:
        return self.shape[0]

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        dim = dim % self.ndim
        a, b = self._window[dim]
        if start < 0 or length < 0 or a + start + length > b:
            raise IndexError(f"narrow({dim}, {start}, {length}) is out of range for shape {tuple(self.shape)}")
        window = list(self._window)
        window[dim] = (a + start, a + start + length)
        return LazyTensor(self._source, self._full_shape, self.dtype, tuple(window))

    def __getitem__(self, key: object) -> LazyTensor | torch.Tensor:
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) <= self.ndim and all(isinstance(k, slice) and k.step in (None, 1) for k in keys):
            out = self
            for dim, k in enumerate(keys):
                start, stop, _ = k.indices(out.shape[dim])
                out = out.narrow(dim, start, max(0, stop - start))
            return out
        return self.materialize()[key]

    def materialize(self) -> torch.Tensor:
        return self._source[tuple(slice(a, b) for a, b in self._window)]

    def __getattr__(self, name: str) -> object:
        # Any other Tensor attribute (.float(), .view(...), .t()): read the window and ask it.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return func(*_materialize_all(args), **_materialize_all(kwargs or {}))

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype}, window={self._window})"


def _materialize_all(x: object) -> object:
    if isinstance(x, LazyTensor):
        return x.materialize()
    if isinstance(x, (list, tuple)):
        return type(x)(_materialize_all(v) for v in x)
    if isinstance(x, dict):
        return {k: _materialize_all(v) for k, v in x.items()}
    return x


def materialize(x: torch.Tensor | LazyTensor) -> torch.Tensor:
    """The tensor itself, or the window a LazyTensor stands for, read now."""
    return x.materialize() if isinstance(x, LazyTensor) else x


def iterate_safetensors(model_path: str, decryption_key: bytes | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, LazyTensor) for every tensor of every shard; a tensor is read when a loader uses it.
    Encrypted shards (*.safetensors.enc) need `decryption_key` and are decrypted in memory, slice by slice."""
    files = checkpoint_files(model_path)
    if decryption_key is not None and not files[0].endswith(SUFFIX):  # whole: all sealed or none
        raise DecryptionError(f"--decryption-key-file was given but {model_path} is not encrypted (no "
                              f"*.safetensors{SUFFIX}): refusing to load weights the key cannot authenticate; "
                              "drop the flag to serve a plaintext checkpoint")
    for path in files:
        if path.endswith(SUFFIX):
            if decryption_key is None:
                raise DecryptionError(f"{path} is encrypted: pass its key with --decryption-key-file "
                                      "(LLM(decryption_key_file=...))")
            f = EncryptedSafetensors(path, decryption_key)
        else:
            f = safe_open(path, framework="pt")  # kept open by the slices that refer to it
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            s = f.get_slice(name)
            shape, dtype = tuple(s.get_shape()), _DTYPES.get(s.get_dtype())
            if dtype is None or not shape:  # an exotic dtype or a scalar: read it as it is
                yield name, s[()] if isinstance(f, EncryptedSafetensors) else f.get_tensor(name)
            else:
                yield name, LazyTensor(s, shape, dtype)  # type: ignore[misc]


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def stage_weights(weights: Iterable[tuple[str, torch.Tensor]], start: int, end: int,
                  owned_prefixes: dict[str, bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors a pipeline stage owns: decoder layers [start, end), and names under each
    prefix of `owned_prefixes` mapped to True (embedding, final norm, LM head). The others are skipped
    unread (a LazyTensor reads nothing until used)."""
    owned_prefixes = owned_prefixes or {}
    for name, tensor in weights:
        m = _LAYER.search(name)
        if m is not None and not start <= int(m.group(1)) < end:
            continue
        if any(name.startswith(p) and not owned for p, owned in owned_prefixes.items()):
            continue
        yield name, tensor


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: dict[str, tuple[str, object]],
    skip_suffixes: tuple[str, ...] = (),
) -> set[str]:
    """Copy checkpoint tensors into `model`; returns the parameter names loaded.

    `stacked_params` maps a checkpoint name fragment (q_proj) to our merged parameter's fragment
    and its shard id (qkv_proj, "q"). Unknown checkpoint tensors are an error, not a silent skip."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(skip_suffixes):
            continue
        target, shard_id = stacked_name(name, stacked_params)
        param = param_for(model, params, target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        load_tensor(param, tensor, shard_id, name)
        loaded.add(target)
    return loaded


def load_tensor(param: nn.Parameter, tensor: torch.Tensor, shard_id: object, name: str) -> None:
    """param.weight_loader on one checkpoint tensor; a tensor it cannot take (a shape the config does not
    give, a scale of the wrong block count) is refused naming the tensor."""
    loader = param.weight_loader
    try:
        with torch.no_grad():
            loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
    except (ValueError, IndexError) as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from e


def param_for(model: nn.Module, params: dict[str, nn.Parameter], target: str) -> nn.Parameter | None:
    """params[target]; or, for a plain parameter (`<module>.weight`, experts' `w13` / `w2`) of a module built
    int4 that the checkpoint ships unquantized (modules_to_not_convert), that module's new plain parameter
    (its `unquantize`)."""
    param = params.get(target)
    if param is not None or "." not in target:
        return param
    module_name, attr = target.rsplit(".", 1)
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    if getattr(module, "int4", None) is None or not hasattr(module, "unquantize"):
        return None
    module.unquantize()
    params.update({f"{module_name}.{n}": p for n, p in module.named_parameters()})
    return params.get(target)


def stacked_name(name: str, stacked_params: dict[str, tuple[str, object]]) -> tuple[str, object]:
    """Checkpoint name -> (our parameter name, shard id or None) under load_named_weights' mapping."""
    for fragment, (merged, sid) in stacked_params.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{merged}."), sid
    return name, None


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


FP8_MAX = 448.0
FP8_SCALE_SUFFIXES = ("_scale_inv",)
# The widest float32 temporary a dummy fill of a narrow dtype makes (256 MiB): V3's FP8 w13 of one layer's
# experts (7.5 G values) drawn in one piece took a 28 GiB temporary, which an H100 holding the slice's
# earlier layers did not have.
DUMMY_CHUNK_ELEMENTS = 1 << 26


def init_dummy_weights(model: nn.Module, seed: int, scale: float = 1e-2) -> None:
    """Random weights from the config alone (benchmarks): small uniform values, norms at 1.

    Drawn on the parameters' own device, so a 7B model fills in a second on a GPU."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(1.0)
                continue
            gen = generators.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
            if hasattr(param, "quant_bits"):  # int4 storage (layers/int4.py)
                _dummy_int4(name, param, scale, gen)
            elif name.endswith(FP8_SCALE_SUFFIXES):  # FP8 block scales: fp8 values in ±448 times this
                param.fill_(scale / FP8_MAX)  # = uniform(-scale, scale) weights like the unquantized ones
            elif param.dtype == torch.float8_e4m3fn:
                _fill_uniform_through_float32(param, FP8_MAX, gen)
            elif param.dtype.is_floating_point and param.element_size() >= 2:
                param.uniform_(-scale, scale, generator=gen)
            else:  # other fp8 and integer storage: fill through a wider type
                _fill_uniform_through_float32(param, scale, gen)


def _fill_uniform_through_float32(param: torch.Tensor, bound: float, gen: torch.Generator) -> None:
    """uniform(-bound, bound) into a dtype torch cannot draw in, through float32 pieces of whole rows (dim 0) of
    at most DUMMY_CHUNK_ELEMENTS values (one row where a row is larger); any layout, contiguous or not."""
    if param.dim() == 0 or param.numel() <= DUMMY_CHUNK_ELEMENTS:
        param.copy_(torch.empty(param.shape, device=param.device).uniform_(-bound, bound, generator=gen))
        return
    rows = max(1, DUMMY_CHUNK_ELEMENTS // (param.numel() // param.shape[0]))
    for start in range(0, param.shape[0], rows):
        piece = param[start:start + rows]
        piece.copy_(torch.empty(piece.shape, device=param.device).uniform_(-bound, bound, generator=gen))


def _dummy_int4(name: str, param: torch.Tensor, scale: float, gen: torch.Generator) -> None:
    """Random codes, zero points at mid-range and scales that put the weights in [-scale, scale], like the
    unquantized dummies; every input in group 0 (g_idx)."""
    mid = 2 ** (param.quant_bits - 1)
    if name.endswith("qweight"):
        param.copy_(torch.randint(-(2**31), 2**31, param.shape, generator=gen, device=param.device,
                                  dtype=torch.int64).to(torch.int32))
    elif name.endswith("scales"):
        param.fill_(scale / mid)
    elif name.endswith("qzeros"):
        param.fill_(mid)
    else:
        param.zero_()
