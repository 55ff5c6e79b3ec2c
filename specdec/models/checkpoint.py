"""Reading a Hugging Face safetensors checkpoint straight into the engine's weights.

``load_weights`` opens one shard at a time (``safetensors.safe_open``: the file is mapped, not
read whole) and converts each tensor to the engine's dtype on its device as it is read, so the
host never holds the model twice: an 8B bfloat16 target loads onto a GPU with about one
shard of host memory, where ``from_pretrained`` in float32 and a fused copy (the path before)
needed ~50 GB. Fused weights (q/k/v, gate/up) are concatenated on the device once their last
part has been read, and the parts freed. Which tensors make which engine weight is
``specdec.serving.arch.canonical_layout``, the same layout ``canonical_weights`` uses.
"""

from __future__ import annotations

import json
import logging
import pathlib

import torch

from specdec.serving.arch import ArchConfig, assemble, canonical_layout

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(model_dir) -> list[pathlib.Path]:
    """The safetensors files of a model directory: the shards its index names, or its single
    ``model.safetensors`` (empty when it has neither, e.g. only ``pytorch_model.bin``)."""
    model_dir = pathlib.Path(model_dir)
    if (model_dir / INDEX).is_file():
        weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return [model_dir / SINGLE] if (model_dir / SINGLE).is_file() else []


def _tensor_shapes(files: list[pathlib.Path]) -> dict[str, tuple[pathlib.Path, list[int]]]:
    """Every tensor's (shard, shape), from the shards' headers alone."""
    from safetensors import safe_open

    where = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            where.update({name: (path, f.get_slice(name).get_shape()) for name in f.keys()})
    return where


def read_tensor(model_dir, names: tuple[str, ...]) -> torch.Tensor:
    """The first of ``names`` the checkpoint holds, read alone from the shard holding it (a
    draft reads its target's embedding so, from a sharded checkpoint as from a single file)."""
    from safetensors import safe_open

    where = _tensor_shapes(checkpoint_files(model_dir))
    for name in names:
        if name in where:
            with safe_open(str(where[name][0]), framework="pt") as f:
                return f.get_tensor(name)
    raise KeyError(f"{model_dir} holds none of {', '.join(names)}")


def load_weights(model_dir, arch: ArchConfig, device: torch.device | str,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The engine's weights (canonical names) from a safetensors checkpoint, each tensor
    copied from its mapped shard into ``dtype`` on ``device`` as the shard is read: a fused
    weight (q/k/v, gate/up) is allocated there once and each part copied into its rows, so
    no part is ever held twice. RMSNorm scales of the (1 + w) families are float32
    (``assemble``), from w rounded to ``dtype`` as transformers rounds it."""
    from safetensors import safe_open

    files = checkpoint_files(model_dir)
    if not files:
        raise FileNotFoundError(f"{model_dir} has no safetensors weights")
    where = _tensor_shapes(files)
    layout = canonical_layout(arch, set(where))
    missing = sorted({n for part in layout.values() for n in part.sources if n not in where})
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    users: dict[str, list[str]] = {}  # source tensor -> the engine weights made from it
    for name, part in layout.items():
        for source in part.sources:
            users.setdefault(source, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for source in (s for s in f.keys() if s in users):
                view = f.get_tensor(source)  # (may be a view of the mapped file)
                copied = None
                for name in users[source]:
                    part = layout[name]
                    if len(part.sources) == 1:  # one copy, whoever uses it (a tied head)
                        copied = view.to(device, dtype, copy=True) if copied is None else copied
                        out[name] = assemble(part, [copied], arch)
                        continue
                    rows = [where[s][1][0] for s in part.sources]
                    if name not in out:
                        out[name] = torch.empty((sum(rows), *where[source][1][1:]),
                                                device=device, dtype=dtype)
                    start = sum(rows[: part.sources.index(source)])
                    out[name][start : start + view.shape[0]].copy_(view)
                del view, copied
        log.debug("loaded %s", path.name)
    assert len(out) == len(layout), (len(out), len(layout))
    return out
