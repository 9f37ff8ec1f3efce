"""Parameter-pytree checks and dtype casts for the functional LLaMA.

Layout (fixed; see `LlamaConfig.param_shapes`), with V vocab, D hidden, F FFN, Hq / Hkv heads, hd head_dim:

    params = {
        "embed": [V, D],
        "layers": [{"attn_norm": [D], "wq": [D, Hq*hd], "wk": [D, Hkv*hd], "wv": [D, Hkv*hd],
                    "wo": [Hq*hd, D], "mlp_norm": [D], "w_gate": [D, F], "w_up": [D, F],
                    "w_down": [F, D]}, ...],          # one dict per layer
        "final_norm": [D],
        "lm_head": [D, V],                           # only when not tie_word_embeddings
    }

Linear weights are stored [in, out] so that `x @ w` applies them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig

Params = dict[str, Any]

LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
# Fused projections (`models.llama.fuse_projections`): a layer may hold these concatenations instead of their parts.
FUSED_LAYER_KEYS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
STACKED_LAYERS = "layers_stacked"  # params key of the stacked layer weights (`models.llama.with_stacked_layers`)


def dotted_name(key_path: tuple[Any, ...]) -> str:
    """``layers.3.wq`` for a parameter's tree path (the names `validate_params` uses)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)


def param_path_names(config: LlamaConfig) -> list[str]:
    """Dotted names of every tensor the config expects, e.g. ``layers.3.wq``."""
    names = ["embed"]
    names += [f"layers.{i}.{k}" for i in range(config.num_layers) for k in LAYER_KEYS]
    names.append("final_norm")
    if not config.tie_word_embeddings:
        names.append("lm_head")
    return names


def get_by_path(params: Params, name: str) -> Any:
    """The leaf at dotted path ``name`` (e.g. ``layers.3.wq``); KeyError if absent."""
    node: Any = params
    for part in name.split("."):
        if isinstance(node, (list, tuple)):
            idx = int(part)
            if idx >= len(node):
                raise KeyError(name)
            node = node[idx]
        elif isinstance(node, dict):
            node = node[part]
        else:
            raise KeyError(name)
    return node


def validate_params(params: Params, config: LlamaConfig, finite: bool = False) -> None:
    """Check that `params` has exactly the tensors, shapes and (floating) dtypes `config` implies; with `finite`
    (the loaders: host arrays just read from a file), also that every value is finite.

    Raises ValueError naming the first offending tensor with its expected and actual shape, a
    missing or unexpected tensor, a non-floating dtype, or a NaN / Inf value.
    """
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict, got {type(params).__name__}")
    expected = config.param_shapes()
    extra = sorted(set(params) - set(expected))
    if extra:
        hint = " (config says tie_word_embeddings=True)" if "lm_head" in extra else ""
        raise ValueError(f"unexpected parameter(s) {extra}{hint}")
    layers = params.get("layers")
    if not isinstance(layers, (list, tuple)):
        raise ValueError(f"params['layers'] must be a list of per-layer dicts, got {type(layers).__name__}")
    if len(layers) != config.num_layers:
        raise ValueError(f"params has {len(layers)} layers, config expects num_layers={config.num_layers}")
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise ValueError(f"params['layers'][{i}] must be a dict, got {type(layer).__name__}")
        extra = sorted(set(layer) - set(LAYER_KEYS))
        if extra:
            raise ValueError(f"unexpected parameter(s) in layer {i}: {extra}")
    for name in param_path_names(config):
        try:
            leaf = get_by_path(params, name)
        except KeyError:
            raise ValueError(f"missing parameter {name!r}") from None
        want = tuple(get_by_path(expected, name))
        shape = tuple(getattr(leaf, "shape", ()))
        if shape != want:
            raise ValueError(f"parameter {name!r} has shape {shape}, expected {want} from the config")
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"parameter {name!r} has dtype {dtype}, expected a floating dtype")
        if finite and not np.isfinite(np.asarray(leaf)).all():
            raise ValueError(f"parameter {name!r} holds NaN or Inf values (a corrupt or mis-converted checkpoint)")


def check_one_dtype_per_layer_weight(layers: Any) -> None:
    """ValueError naming the first layer weight whose dtype differs from layer 0's: a loop over layers (the tiered
    caches' decode steps) reads every layer's weight as one stacked array or one switch, which needs one dtype (an
    audit met "switch branches must have equal output types" from deep inside the certified step). The dense
    path's unrolled layers take mixed dtypes, so only the loops call this."""
    first: dict[str, Any] = {}
    for i, layer in enumerate(layers):
        for key, w in layer.items():
            dtype = getattr(w, "dtype", None)
            want = first.setdefault(key, dtype)
            if dtype != want:
                raise ValueError(f"parameter 'layers.{i}.{key}' has dtype {dtype} but 'layers.0.{key}' has {want}: "
                                 "a loop over layers (the certified and naive caches' decode steps) needs every "
                                 "layer's weight in one dtype (cast the odd one)")


def unfused_shapes(params: Params, config: LlamaConfig) -> Params:
    """The params' tree with every fused projection replaced by its parts' shapes (`jax.ShapeDtypeStruct`), so that
    `validate_params` checks a fused model too. A fused tensor whose width is not its parts' widths together
    raises ValueError naming it."""
    if not isinstance(params, dict) or not isinstance(params.get("layers"), (list, tuple)):
        return params  # validate_params names what is wrong
    # the stacked copy of the layer weights that `models.llama.params_for_decoding` adds for some schedules
    params = {k: v for k, v in params.items() if k != STACKED_LAYERS}
    expected = config.param_shapes()["layers"][0]
    layers = []
    for i, layer in enumerate(params["layers"]):
        if not isinstance(layer, dict) or not any(k in layer for k in FUSED_LAYER_KEYS):
            layers.append(layer)
            continue
        layer = dict(layer)
        for fused, parts in FUSED_LAYER_KEYS.items():
            if fused not in layer:
                continue
            leaf = layer.pop(fused)
            shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
            want = (expected[parts[0]][0], sum(expected[p][1] for p in parts))
            if shape != want:
                raise ValueError(f"parameter 'layers.{i}.{fused}' has shape {shape}, expected {want} from the config "
                                 f"({' | '.join(parts)} concatenated)")
            for p in parts:
                layer[p] = jax.ShapeDtypeStruct(expected[p], dtype)
        layers.append(layer)
    return {**params, "layers": layers}


def stale_stacked_layers(params: Params) -> str | None:
    """What is wrong with the stacked copy of the layer weights that params may carry (`STACKED_LAYERS`, built by
    `models.llama.with_stacked_layers`), or None when there is none or it holds exactly `params["layers"]`. A decode
    loop's first passes read the copy and everything else the layers, so a copy left from weights since replaced
    decoded with the old ones under rung-0 certificates (audit of 2026-12-07). Compared weight by weight and layer
    by layer where they live (one reduction each, dispatched without waiting, the flags back in one transfer): one
    more read of the layer weights and of their copy, done by `generate` before its clock. Call it after
    `validate_params`."""
    stacked = params.get(STACKED_LAYERS) if isinstance(params, dict) else None
    if stacked is None:
        return None
    layers = params.get("layers")
    if not isinstance(stacked, dict) or not isinstance(layers, (list, tuple)) or not layers:
        return "is not a dict of stacked layer weights beside a list of layers"
    names = sorted(layers[0])
    if sorted(stacked) != names:
        return f"holds {sorted(stacked)} but the layers hold {names}"
    checks, flags = [], []
    for name in names:
        w, ref = stacked[name], layers[0][name]
        want = (len(layers), *np.shape(ref))
        if tuple(np.shape(w)) != want or getattr(w, "dtype", None) != getattr(ref, "dtype", None):
            return (f"'{name}' is {tuple(np.shape(w))} {getattr(w, 'dtype', None)}, expected {want} "
                    f"{getattr(ref, 'dtype', None)} from the layers")
        for i, layer in enumerate(layers):
            checks.append((name, i))
            flags.append(jnp.array_equal(w[i], layer[name], equal_nan=True))
    for (name, i), same in zip(checks, np.asarray(jnp.stack(flags)), strict=True):
        if not same:
            return f"'{name}' of layer {i} differs from params['layers'][{i}]['{name}'] (a stale copy)"
    return None


def nonfinite_parameter(params: Params) -> str | None:
    """The dotted name of the first tensor holding NaN or Inf, or None. Each array is reduced where it lives
    (one small reduction per tensor, dispatched without waiting) and the flags come back in one transfer."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
        return None
    flags = np.asarray(jnp.stack([jnp.all(jnp.isfinite(leaf)) for _, leaf in leaves]))
    for (path, _), ok in zip(leaves, flags, strict=True):
        if not ok:
            return dotted_name(path)
    return None


def cast_params(params: Params, dtype: Any) -> Params:
    """Every leaf as a `jax.Array` of `dtype` (None: keep each leaf's dtype) on the default device."""
    if dtype is None:
        return jax.tree.map(jnp.asarray, params)
    dt = jnp.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"params dtype must be floating, got {dt}")
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=dt), params)


def params_to_numpy(params: Params) -> Params:
    """Every leaf as a host `np.ndarray` (dtype kept; bfloat16 via ml_dtypes)."""
    return jax.tree.map(np.asarray, params)
