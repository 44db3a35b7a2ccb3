"""Hugging Face transformers integration: `AffineqConfig` and its quantizer, registered with transformers
(quant_method "affineq") when this module is imported.

    import affineq.hf
    from affineq import Int4WeightOnlyConfig
    from affineq.hf import AffineqConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=AffineqConfig(
        Int4WeightOnlyConfig(group_size=64)))        # quantized on load, layer by layer
    model.save_pretrained(out)                        # safetensors + quantization_config in config.json
    model = AutoModelForCausalLM.from_pretrained(out) # the same quantized weights, nothing re-quantized

Quantize on load: transformers reads one checkpoint tensor at a time (synchronously when a quantizer
quantizes on the fly); each selected weight is set on its module and `affineq.quantize_` quantizes that
module alone, so no second full-precision copy of the model is ever held. Selection is `quantize_`'s
(every nn.Linear, `FqnToConfig` names and regexes), minus transformers' default skips (tied weights, the
output embeddings, the last module: lm_head stays float) unless `modules_to_not_convert` replaces them; a
module named exactly in an `FqnToConfig` is quantized even if a default skip would keep it float (except a
tied copy such as the lm_head of tied embeddings, which transformers never reads from the file: an error says
to quantize it after loading). Configs that need calibration data (static activations, GPTQ, AWQ) cannot run
on load: quantize the float model with `affineq.quantize_`, then `set_quantization_config` and save.

Saving: every quantized weight is stored as its inner tensors (``name:qdata``, ...) with its `QuantSpec` in
the safetensors header (`affineq.safetensors`), so reloading rebuilds exactly those tensors, and config.json's
`quantization_config` lists the quantized weights (`quantized_weights`): a reload fails naming any the files
lack. A transformers model quantized by `affineq.quantize_` outside `from_pretrained` (calibrated static
activations, GPTQ, ...) records its config as `set_quantization_config(model, config)` does, so
`save_pretrained` just works.

Loading checks every file transformers resolved lies inside the checkpoint directory after resolving
symlinks, and each quantized weight's inner tensors against their checksums (every one must have one).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
from torch import nn

try:
    import transformers  # noqa: F401
    from transformers.core_model_loading import ConversionOps, PrefixChange, WeightConverter, WeightRenaming
    from transformers.modeling_utils import PreTrainedModel
    from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module
    from transformers.utils.quantization_config import QuantizationConfigMixin
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(f"affineq.hf needs transformers >= 5 ({_e}): pip install 'transformers>=5' "
                      "(or pip install affineq[models])") from None

from affineq import safetensors as _st
from affineq._untrusted import inside
from affineq.configs import QuantConfig, config_from_dict
from affineq.expert_weights import is_expert_module
from affineq.experts import use_affineq_experts
from affineq.plan import planned_weights
from affineq.process_memory import release_float_copy as _release_float_copy
from affineq.process_memory import trim_heap as _trim_heap
from affineq.quantize import AFTER_QUANTIZE, FqnToConfig, ModelConfig, QuantizationError, quantize_
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = ["AffineqConfig", "AffineqHfQuantizer", "QUANT_METHOD", "set_quantization_config"]

QUANT_METHOD = "affineq"


class AffineqConfig(QuantizationConfigMixin):
    """transformers quantization config for affineq.

    quant_config: any affineq config (Int4WeightOnlyConfig(...), FqnToConfig({...}), ...) or its `to_dict()`;
    stored in config.json with the configs' own `to_dict()` / `config_from_dict`.
    modules_to_not_convert: module names (prefixes, regexes or suffixes, as transformers matches them) kept
    float on load; None = transformers' defaults (tied weights, output embeddings, the last module).
    quantized_weights: the manifest save_pretrained writes (names of the quantized weights); loading a
    pre-quantized checkpoint fails naming any its files lack. None: not recorded (older saves).
    """

    def __init__(self, quant_config: QuantConfig | dict, modules_to_not_convert: list[str] | None = None,
                 quantized_weights: list[str] | None = None, **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD
        if isinstance(quant_config, dict):
            try:
                quant_config = config_from_dict(quant_config)
            except ValueError as e:
                raise ValueError(f"AffineqConfig.quant_config: {e} (upgrade affineq if a newer one wrote it)") from None
        if not isinstance(quant_config, QuantConfig):
            raise ValueError(f"AffineqConfig(quant_config=...) must be an affineq config such as "
                             f"Int4WeightOnlyConfig(group_size=64), got {quant_config!r}")
        if modules_to_not_convert is not None and (
                not isinstance(modules_to_not_convert, (list, tuple))
                or not all(isinstance(m, str) for m in modules_to_not_convert)):
            raise ValueError(f"modules_to_not_convert must be a list of module names, got {modules_to_not_convert!r}")
        if quantized_weights is not None and (not isinstance(quantized_weights, (list, tuple))
                                              or not all(isinstance(m, str) for m in quantized_weights)):
            raise ValueError(f"quantized_weights must be a list of weight names, got {quantized_weights!r}")
        self.quant_config = quant_config
        self.modules_to_not_convert = None if modules_to_not_convert is None else list(modules_to_not_convert)
        self.quantized_weights = None if quantized_weights is None else sorted(quantized_weights)

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "quant_config": self.quant_config.to_dict(),
                "modules_to_not_convert": self.modules_to_not_convert, "quantized_weights": self.quantized_weights}

    def __iter__(self):
        yield from self.to_dict().items()

    @classmethod
    def from_dict(cls, config_dict: dict, return_unused_kwargs: bool = False, **kwargs):
        if not isinstance(config_dict, dict):
            raise ValueError(f"AffineqConfig.from_dict expects the dict AffineqConfig.to_dict writes, got "
                             f"{type(config_dict).__name__}")
        d = dict(config_dict)
        unknown = set(d) - {"quant_method", "quant_config", "modules_to_not_convert", "quantized_weights"}
        if unknown:
            raise ValueError(f"AffineqConfig.from_dict: unknown keys {sorted(map(repr, unknown))}; the "
                             "quantization_config of an affineq checkpoint holds quant_method, quant_config, "
                             "modules_to_not_convert and quantized_weights")
        if d.pop("quant_method", QUANT_METHOD) != QUANT_METHOD:
            raise ValueError(f"AffineqConfig.from_dict got quant_method={config_dict.get('quant_method')!r}")
        if "quant_config" not in d:
            raise ValueError("AffineqConfig.from_dict: the dict has no 'quant_config' (AffineqConfig.to_dict writes "
                             "one)")
        config = cls(d.pop("quant_config"), d.pop("modules_to_not_convert", None), d.pop("quantized_weights", None))
        unused = {k: v for k, v in kwargs.items() if not hasattr(config, k)}
        for k in set(kwargs) - set(unused):
            setattr(config, k, kwargs[k])
        return (config, unused) if return_unused_kwargs else config


def _candidates(name: str, prefix: str) -> list[str]:
    """`name` as saved by a model with or without the base-model prefix (BertModel vs BertForX)."""
    out = [name]
    if prefix:
        out += [name.removeprefix(prefix + ".")] if name.startswith(prefix + ".") else [f"{prefix}.{name}"]
    return out


class AffineqQuantize(ConversionOps):
    """Load op: set the float weight on its module, then `quantize_` that module alone."""

    def __init__(self, hf_quantizer: AffineqHfQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict, model=None, full_layer_name: str | None = None, missing_keys=None,
                **kwargs) -> dict[str, torch.Tensor]:
        value = next(iter(input_dict.values()))
        value = value[0] if isinstance(value, list) else value
        module, pname = get_module_from_name(model, full_layer_name)
        cfg, _ = self.hf_quantizer.config_for(model, full_layer_name)
        module._parameters[pname] = nn.Parameter(value, requires_grad=False)
        if is_expert_module(module):  # this expert weight only: the module's others may not be loaded yet
            cfg = _with_param(cfg, pname)
        quantize_(module, cfg, filter_fn=lambda m, fqn: fqn == "")
        param = module._parameters[pname]
        _release_float_copy(value)
        del value
        if missing_keys is not None:
            missing_keys.discard(full_layer_name)
        module._is_hf_initialized = True
        return {full_layer_name: param}


class AffineqDeserialize(ConversionOps):
    """Load op of a pre-quantized checkpoint: {"weight:qdata": [t], ...} -> the AffineQuantizedTensor."""

    def __init__(self, hf_quantizer: AffineqHfQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict, model=None, full_layer_name: str | None = None, missing_keys=None,
                **kwargs) -> dict[str, torch.Tensor]:
        name, entry = self.hf_quantizer.entry_for(model, full_layer_name)
        inner = {k.rpartition(_st.SEP)[2]: (v[0] if isinstance(v, list) else v) for k, v in input_dict.items()}
        w = _st.build_entry(name, entry, inner, "checkpoint")
        dtype = self.hf_quantizer.load_dtype
        if dtype is not None and dtype.is_floating_point and dtype != w.dtype:  # as the model's float parameters
            w = w.to(dtype)  # the logical dtype only: codes and qparams stay as stored
        module, _ = get_module_from_name(model, full_layer_name)
        module._is_hf_initialized = True
        return {full_layer_name: nn.Parameter(w, requires_grad=False)}


class AffineqHfQuantizer(HfQuantizer):
    """The transformers quantizer of `AffineqConfig` (see the module docstring)."""

    requires_calibration = False
    quantization_config: AffineqConfig

    def __init__(self, quantization_config: AffineqConfig, **kwargs) -> None:
        super().__init__(quantization_config, **kwargs)
        self.metadata: dict | None = None  # the checkpoint's "affineq" metadata (pre-quantized)
        self.modules_to_not_convert: list[str] = []
        self._default_skips: list[str] = []
        self._config: QuantConfig = quantization_config.quant_config
        self._plan_of: nn.Module | None = None  # the model self._plan was planned on
        self._plan: dict[str, QuantConfig] = {}
        self._plan_problems: list[tuple[str, str]] = []
        self.load_dtype: torch.dtype | None = None  # from_pretrained's resolved dtype (update_dtype)

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # A pre-quantized weight takes the model's dtype as its logical dtype, as every float parameter does
        # (quantize-on-load gets it from the float weight it quantizes).
        self.load_dtype = dtype
        return dtype

    def validate_environment(self, *args, device_map=None, **kwargs) -> None:
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("affineq models cannot be offloaded to disk; use a device_map without 'disk'")
        cfg = self.quantization_config.quant_config
        if self.pre_quantized:
            return
        configs = cfg.fqn_to_config.values() if isinstance(cfg, FqnToConfig) else [cfg]
        for c in configs:
            if c is not None and (getattr(c, "needs_calibration", False) or hasattr(c, "base_config")):
                raise ValueError(f"{type(c).__name__} needs calibration data or a whole-model pass, which quantize-on-"
                                 "load cannot give: load the float model, run affineq.quantize_(model, config, "
                                 "calibration_data=...), then affineq.hf.set_quantization_config(model, config) and "
                                 "save_pretrained")

    # -- which parameters -------------------------------------------------------------------------------

    def config_for(self, model: nn.Module, param_name: str) -> tuple[QuantConfig | None, bool]:
        """(config of parameter `param_name`, whether an FqnToConfig names it exactly): the planner's answer
        (`affineq.plan.planned_weights`, as quantize_ plans), None for a weight it leaves float."""
        planned = self._planned(model)
        cfg = self._config
        if isinstance(cfg, FqnToConfig):
            explicit = param_name in cfg.fqn_to_config or cfg.config_for(param_name.rpartition(".")[0])[1]
        else:
            explicit = False
        return planned.get(param_name), explicit

    def _planned(self, model: nn.Module) -> dict[str, QuantConfig]:
        """{parameter name: config} of every weight quantized on load, planned once per model."""
        if getattr(self, "_plan_of", None) is not model:
            self._plan, self._plan_problems = planned_weights(model, self._config, self._selects)
            self._plan = {n: c for n, c in self._plan.items()
                          if should_convert_module(n.rpartition(".")[0], self.modules_to_not_convert)}
            self._plan_of = model
        return self._plan

    def _selects(self, module: nn.Module, fqn: str) -> bool:
        """The planner's filter on load: transformers' modules_to_not_convert always, its default skips
        (output embeddings, ...) unless an FqnToConfig names the module exactly, else every nn.Linear and MoE
        experts module."""
        if not should_convert_module(fqn, self.modules_to_not_convert):
            return False
        cfg = self._config
        if isinstance(cfg, FqnToConfig) and cfg.config_for(fqn)[1]:
            return True
        return should_convert_module(fqn, self._default_skips) and (isinstance(module, nn.Linear)
                                                                     or is_expert_module(module))

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return not self.pre_quantized and param_name in self._planned(model)

    def entry_for(self, model, param_name: str) -> tuple[str, dict]:
        entries = (self.metadata or {}).get("quantized", {})
        for name in _candidates(param_name, getattr(model, "base_model_prefix", "")):
            if name in entries:
                return name, entries[name]
        raise ValueError(f"checkpoint: {param_name!r} has quantized tensors but no entry in the affineq metadata; "
                         "the checkpoint was edited")

    # -- loading ----------------------------------------------------------------------------------------

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        _check_paths(model, checkpoint_files)
        if self.pre_quantized:
            self.metadata = _read_checkpoint(checkpoint_files)
            _st.check_manifest(self.quantization_config.quantized_weights, self.metadata["quantized"],
                               os.path.dirname(checkpoint_files[0]))
            _trim_heap()  # the validation read's copies are freed: give their pages back before loading
            return model
        cfg = self.quantization_config.quant_config
        if isinstance(cfg, ModelConfig):
            cfg = cfg.to_fqn_config(model)
        self._config = cfg
        user = self.quantization_config.modules_to_not_convert
        self._default_skips = get_keys_to_not_convert(model) if user is None else []
        self.modules_to_not_convert = list(user or []) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
        self._plan_of = None
        self._planned(model)
        problems = [f"{name}: {why}" for name, why in self._plan_problems
                    if should_convert_module(name, self.modules_to_not_convert)]
        if isinstance(cfg, FqnToConfig):  # a tied copy (lm_head of tied embeddings) is never read from the file
            for target, source in dict(getattr(model, "all_tied_weights_keys", None) or {}).items():
                c, explicit = self.config_for(model, target)
                if explicit and c is not None:
                    problems.append(f"{target}: it is tied to {source}, which transformers loads as float; quantize "
                                    "it after loading (affineq.quantize_, then affineq.hf.set_quantization_config) or "
                                    "untie it (tie_word_embeddings=False)")
        if problems:
            raise QuantizationError(f"{type(cfg).__name__} cannot quantize these weights on load: {problems}; pass "
                                    "AffineqConfig(..., modules_to_not_convert=[...]) or a config that fits them")
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.pre_quantized and self.metadata is not None:
            params = dict(model.named_parameters(remove_duplicate=False))
            prefix = getattr(model, "base_model_prefix", "")
            lost = [n for n in self.metadata["quantized"]
                    if not any(isinstance(params.get(c), AffineQuantizedTensor) for c in _candidates(n, prefix))]
            if lost:
                raise ValueError(f"the checkpoint's quantized weights {lost[:5]} were not loaded into the model (the "
                                 "checkpoint does not match this model class, or its files were edited)")
        use_affineq_experts(model)  # quantized MoE expert weights run through grouped_linear
        _keep_expert_weight_names(model)
        return model

    def get_quantize_ops(self):
        return AffineqQuantize(self)

    def get_load_operations(self) -> dict:
        return {"deserialize": AffineqDeserialize}

    @property
    def serialized_names(self) -> dict[str, list[str]]:
        """{parameter name: its keys in the checkpoint} ("weight": ["weight:qdata", ...]) of a pre-quantized
        checkpoint, from its metadata."""
        if not self.pre_quantized or not self.metadata:
            return {}
        out: dict[str, set[str]] = {}
        for name, entry in self.metadata["quantized"].items():
            pname = name.rpartition(".")[2]
            out.setdefault(pname, set()).update(f"{pname}{_st.SEP}{i}" for i in entry["tensors"])
        return {p: sorted(v) for p, v in out.items()}

    def get_new_dtype(self, converter, param, dtype):
        # The inner tensors of a quantized weight keep their stored dtypes (int codes, bf16 qparams).
        if any(isinstance(op, AffineqDeserialize) for op in getattr(converter, "operations", ())):
            return None
        return super().get_new_dtype(converter, param, dtype)

    def _dequantize(self, model, dtype=None):
        """`model.dequantize()`: every quantized weight back to a float Parameter (its act_pre_scale folded in:
        F.linear(x * s, W) == F.linear(x, W * s); activation quantization is dropped with the codes)."""
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if isinstance(p, AffineQuantizedTensor):
                    w = p.dequantize(dtype or p.dtype)
                    pre = p.act_tensors.get("act_pre_scale")
                    if pre is not None:
                        w = w * pre.to(w.dtype)
                    module._parameters[name] = nn.Parameter(w, requires_grad=False)
        return model

    # -- saving -----------------------------------------------------------------------------------------

    def get_state_dict_and_metadata(self, model):
        sd = model.state_dict()
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        skip = frozenset(k for k in tied if isinstance(sd.get(k), AffineQuantizedTensor))
        # checksum_plain=False: transformers may rename or convert plain tensors on save.
        tensors, meta = _st.flatten_state_dict(sd, checksum_plain=False, skip=skip)
        # the manifest: config.json (written after this) lists the quantized weights a load must find
        self.quantization_config.quantized_weights = sorted(meta["quantized"])
        return tensors, {_st.METADATA_KEY: json.dumps(meta, separators=(",", ":"))}

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _check_paths(model: nn.Module, files: list[str] | None) -> None:
    """ValueError unless every checkpoint file transformers resolved lies, after resolving symlinks, inside
    the model's directory (a local `from_pretrained(path)`), else inside the first file's directory."""
    if not files:
        return
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    root = name if isinstance(name, str) and name and os.path.isdir(name) else os.path.dirname(
        os.path.normpath(os.path.abspath(files[0])))
    for f in files:
        inside(root, os.path.abspath(f), f"checkpoint file {os.path.basename(f)!r} (from the index)")


def _read_checkpoint(files: list[str] | None) -> dict:
    """The merged, validated "affineq" metadata of a pre-quantized checkpoint's safetensors files: every
    quantized entry complete across the files, its spec, inner tensors and checksums checked (ValueError)."""
    if not files:
        raise ValueError("an affineq checkpoint must be stored as .safetensors files (none were found)")
    st = _st._import_safetensors()
    merged: dict | None = None
    found: dict[str, tuple[str, str]] = {}  # key -> file
    for path in files:
        if not str(path).endswith(".safetensors"):
            raise ValueError(f"{path}: affineq checkpoints are .safetensors only (no pickled .bin/.pt files)")
        try:
            with _st.open_file(path) as f:
                meta = _st.parse_metadata(f.metadata(), str(path))
                keys = list(f.keys())
        except st.SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e}): it is truncated or corrupted") from None
        if meta is None:
            raise ValueError(f"{path} has no affineq metadata although config.json says quant_method='affineq'; the "
                             "file was replaced or edited: save the model again with save_pretrained")
        merged = _st.merge_metadata(merged, meta, str(path))
        found.update({k: path for k in keys})
    inner_keys = [f"{n}{_st.SEP}{i}" for n, e in merged["quantized"].items() for i in e["tensors"]]
    _st.check_coverage(inner_keys, merged["checksums"], os.path.dirname(str(files[0])))
    missing = sorted(k for k in merged["checksums"] if k not in found)
    if missing:
        raise ValueError(f"the checkpoint lacks tensors its metadata lists ({missing[:5]}): a shard is missing or "
                         "truncated")
    # Read each quantized entry once to verify checksums and values before anything is loaded into the model.
    handles: dict[str, Any] = {}
    try:
        for name, entry in merged["quantized"].items():
            inner = {}
            for i in entry["tensors"]:
                key = f"{name}{_st.SEP}{i}"
                path = found[key]
                if path not in handles:
                    handles[path] = _st.open_file(path).__enter__()
                inner[i] = handles[path].get_tensor(key)
            _st.verify_checksums({f"{name}{_st.SEP}{i}": t for i, t in inner.items()}, merged["checksums"],
                                 str(found[key]))
            _st.build_entry(name, {k: v for k, v in entry.items() if k not in ("layout",)}, inner, str(found[key]))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return merged


def set_quantization_config(model: nn.Module, quant_config: QuantConfig | AffineqConfig) -> nn.Module:
    """Mark a transformers model quantized by `affineq.quantize_` (outside from_pretrained: calibrated static
    activations, GPTQ, ...) as an affineq model, so `model.save_pretrained(out)` writes its quantized weights
    as safetensors with `quant_config` in config.json and `from_pretrained(out)` restores them."""
    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"set_quantization_config(model=...): model is a {type(model).__name__}, not a transformers "
            "PreTrainedModel; only transformers models have a config.json to record the quantization in. "
            "Save a plain module with affineq.safetensors.save_file(model.state_dict(), path) or torch.save")
    cfg = quant_config if isinstance(quant_config, AffineqConfig) else AffineqConfig(quant_config)
    if not any(isinstance(p, AffineQuantizedTensor) for p in model.parameters()):
        raise ValueError("the model has no quantized weights; run affineq.quantize_(model, config) first")
    model.hf_quantizer = AffineqHfQuantizer(cfg, pre_quantized=True)
    _keep_expert_weight_names(model)
    model.config.quantization_config = cfg
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD
    return model


def _keep_expert_weight_names(model: nn.Module) -> None:
    """save_pretrained writes quantized MoE expert weights under their 3-D names. transformers reverts its load
    conversions on save (Mixtral's `experts.gate_up_proj` back into per-expert `w1` / `w3` weights), which would cut
    the stored tensors of a quantized one (packed codes, scales) as if they were the weight: the converters whose
    target is a quantized 3-D expert weight are dropped from the model's conversions (`_weight_conversions`, what
    save_pretrained reverts), so those weights are saved, and loaded back, as they are. So are the renamings that
    would rename a quantized weight (Mixtral's `.mlp.` -> `.block_sparse_moe.`): the checkpoint keeps the
    transformers 5 names, which from_pretrained reads as they are."""
    params = [(n, p) for n, p in model.named_parameters() if isinstance(p, AffineQuantizedTensor)]
    if not any(p.dim() == 3 for _, p in params):
        return
    quantized = [n for n, _ in params]
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # what save_pretrained computes for a model not loaded by from_pretrained
        from transformers.conversion_mapping import get_model_conversion_mapping

        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]

    def hits(c) -> bool:
        targets = [re.escape(t).replace(r"\*", r"\d+") for t in c._original_target_patterns]
        return any(re.search(t, n) for t in targets for n in quantized)

    model._weight_conversions = [c for c in conversions if not (isinstance(c, (WeightConverter, WeightRenaming))
                                                                 and hits(c))]


def _record_quantization(model: nn.Module, config: QuantConfig) -> None:
    """`quantize_`'s hook: a transformers model quantized outside from_pretrained records `config` as
    `set_quantization_config` does (once; a quantizer already set, affineq's or another, is kept), so
    `save_pretrained` writes what quantize-on-load writes. Never raises: quantize_ has already succeeded."""
    if not isinstance(model, PreTrainedModel) or getattr(model, "hf_quantizer", None) is not None:
        return
    if not any(isinstance(p, AffineQuantizedTensor) for p in model.parameters()):
        return
    try:
        json.dumps(config.to_dict())  # config.json must be able to hold it
    except (TypeError, ValueError, NotImplementedError):
        return
    set_quantization_config(model, config)


def _register() -> None:
    """Register with transformers once (re-importing this module replaces the previous registration)."""
    if QUANT_METHOD in AUTO_QUANTIZATION_CONFIG_MAPPING:
        AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] = AffineqConfig
        AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = AffineqHfQuantizer
        return
    register_quantization_config(QUANT_METHOD)(AffineqConfig)
    register_quantizer(QUANT_METHOD)(AffineqHfQuantizer)


_register()
# one hook per process, this module's latest (re-importing it replaces the previous one, as _register does)
AFTER_QUANTIZE[:] = [h for h in AFTER_QUANTIZE if getattr(h, "__module__", None) != __name__] + [_record_quantization]


def _with_param(cfg: QuantConfig, pname: str) -> QuantConfig:
    """`cfg` restricted to parameter `pname` (one expert weight at a time, as transformers loads them)."""
    import dataclasses

    return dataclasses.replace(cfg, param_names=(pname,))
