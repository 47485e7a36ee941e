"""ModelSpec: the shape facts of a decoder-only transformer that memory and FLOP models need.

A spec comes from a built-in preset (``presets.py``) or a Hugging Face ``config.json``
(``ModelSpec.from_hf_config``); ``load_spec`` takes either a preset name or a local path.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from memfit.errors import MemfitError, is_count

if TYPE_CHECKING:  # annotations only: the ledger and `memfit plan` run without torch
    import torch

SUPPORTED_TYPES = ("llama", "qwen2", "mistral")
# The linear layers of one Llama-family decoder layer, by Hugging Face module name, in model order.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def dtype_name(name) -> str:
    """Canonical name (``float32``, ``bfloat16``, ``float16``) of a dtype name, alias or torch dtype.

    Name-based so the ledger and the CLI's planning run without importing torch."""
    text = str(name).lower().removeprefix("torch.")
    key = _ALIASES.get(text, text)
    if key not in DTYPE_BYTES:
        raise MemfitError(f"unknown dtype {name!r}: use one of float32, bfloat16, float16")
    return key


def dtype_of(name) -> torch.dtype:
    """torch dtype from its name (``bfloat16``, ``bf16``, ``fp32``...) or a torch dtype."""
    import torch

    return name if isinstance(name, torch.dtype) else getattr(torch, dtype_name(name))


def dtype_bytes(name) -> int:
    return DTYPE_BYTES[dtype_name(name)]


# A sliding-window model's config keys (Mistral: sliding_window; Qwen2: also whether it is used and from which layer),
# kept from config.json so a model built from the spec attends as the source does; an explicit "sliding_window": null
# (Mistral v0.2 on) too: it turns the window off, where a left-out key builds the config class's default.
WINDOW_KEYS = ("sliding_window", "use_sliding_window", "max_window_layers")
# transformers' defaults for the window keys a config.json leaves out (MistralConfig, Qwen2Config)
WINDOW_DEFAULTS = {"sliding_window": 4096, "max_window_layers": 28}
# transformers' num_key_value_heads where a config.json leaves it out (LlamaConfig's None: one per attention head)
KV_HEADS_DEFAULTS = {"llama": None, "qwen2": 32, "mistral": 8}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama-family decoder (Llama, Qwen2, Mistral share the layout)."""

    name: str
    model_type: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    activation: str = "silu"
    dtype: str = "bfloat16"
    # Llama's config keys; Qwen2's and Mistral's biases are fixed by model_type (biased_projections)
    attention_bias: bool = False
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 4096
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def silu_mlp(self) -> bool:
        """Whether the gated MLP's activation is SiLU: what memfit's fused SwiGLU computes."""
        return self.activation == "silu"

    def __post_init__(self):
        for key in ("num_layers", "hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim", "vocab"):
            value = getattr(self, key)
            if not is_count(value):
                raise MemfitError(f"model {self.name!r}: {key} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise MemfitError(
                f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.model_type not in SUPPORTED_TYPES:
            raise MemfitError(f"model {self.name!r}: model_type {self.model_type!r} is not one of "
                              f"{', '.join(SUPPORTED_TYPES)}")
        if self.activation not in ("silu", "gelu", "gelu_pytorch_tanh"):
            raise MemfitError(f"model {self.name!r}: activation {self.activation!r} is not supported (silu, gelu)")
        dtype_name(self.dtype)

    @property
    def sliding_window(self) -> int | None:
        """How many keys a query sees (itself the last) on the sliding-window layers of a model built from this spec,
        or None where every layer attends over all earlier keys. As transformers decides it: Mistral's window on every
        layer, Qwen2's only with use_sliding_window and on the layers from max_window_layers on (WINDOW_DEFAULTS where
        config.json leaves a key out), Llama none."""
        window = self.extra.get("sliding_window", WINDOW_DEFAULTS["sliding_window"])
        if self.model_type == "llama" or window is None:
            return None
        if self.model_type == "qwen2" and not (
                self.extra.get("use_sliding_window")
                and self.num_layers > self.extra.get("max_window_layers", WINDOW_DEFAULTS["max_window_layers"])):
            return None
        return window

    # ---- sizes -------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer in one decoder layer, by HF module name."""
        h, i = self.hidden, self.intermediate
        shapes = ((h, self.q_dim), (h, self.kv_dim), (h, self.kv_dim), (self.q_dim, h), (h, i), (h, i), (i, h))
        return dict(zip(PROJECTIONS, shapes))

    def biased_projections(self) -> tuple[str, ...]:
        """The projections of a decoder layer that have a bias in the model transformers builds from this spec:
        Llama's q/k/v/o with attention_bias and gate/up/down with mlp_bias (modeling_llama.py); Qwen2's q/k/v and
        Mistral's none whatever config.json says (modeling_qwen2.py and modeling_mistral.py fix them)."""
        if self.model_type == "qwen2":
            return PROJECTIONS[:3]
        if self.model_type == "mistral":
            return ()
        return (PROJECTIONS[:4] if self.attention_bias else ()) + (PROJECTIONS[4:] if self.mlp_bias else ())

    def layer_params(self) -> int:
        """Parameters of one decoder layer (linears, their biases, two RMSNorms)."""
        shapes = self.linear_shapes()
        linear = sum(a * b for a, b in shapes.values())
        bias = sum(shapes[name][1] for name in self.biased_projections())
        return linear + bias + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def lm_head_params(self) -> int:
        """Parameters of the output projection that are not shared with the embedding."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def num_params(self) -> int:
        return self.embedding_params() + self.num_layers * self.layer_params() + self.hidden + self.lm_head_params()

    # ---- conversion --------------------------------------------------------------------
    def with_(self, **changes) -> "ModelSpec":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("extra")
        return data

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "model") -> "ModelSpec":
        """Read a Hugging Face ``config.json`` dict of a Llama, Qwen2 or Mistral model."""
        if not isinstance(config, dict):
            raise MemfitError(f"{name}: config.json must hold a JSON object")
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise MemfitError(
                f"{name}: model_type {model_type!r} is not supported; memfit knows {', '.join(SUPPORTED_TYPES)}"
            )
        required = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
        missing = [key for key in required if key not in config]
        if missing:
            raise MemfitError(f"{name}: config.json lacks {', '.join(missing)}")
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        whole = isinstance(hidden, int) and isinstance(heads, int) and heads > 0
        # transformers' LlamaConfig refuses this (its Qwen2Config and MistralConfig take hidden // heads)
        if model_type == "llama" and not config.get("head_dim") and whole and hidden % heads:
            raise MemfitError(f"{name}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}, and "
                              "config.json gives no head_dim")
        head_dim = config.get("head_dim") or (hidden // heads if whole else 0)
        kv_heads = config.get("num_key_value_heads", KV_HEADS_DEFAULTS[model_type])
        if "num_key_value_heads" not in config and kv_heads and whole and heads % kv_heads:
            raise MemfitError(f"{name}: config.json gives no num_key_value_heads, so transformers builds "
                              f"{model_type}'s default {kv_heads}, which does not divide num_attention_heads {heads}")

        def number(key, default, kind):
            value = config.get(key, default)
            try:
                return kind(value)
            except (TypeError, ValueError, OverflowError):
                raise MemfitError(f"{name}: config.json's {key} is {value!r}, not a number") from None

        rope = config.get("rope_parameters")
        rope_theta = rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0
        dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        return cls(
            name=name,
            model_type=model_type,
            num_layers=config["num_hidden_layers"],
            hidden=hidden,
            intermediate=config["intermediate_size"],
            num_heads=heads,
            num_kv_heads=heads if kv_heads is None else kv_heads,
            head_dim=head_dim,
            vocab=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            activation=config.get("hidden_act", "silu"),
            dtype=str(dtype).replace("torch.", ""),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            rms_norm_eps=number("rms_norm_eps", 1e-6, float),     # the config classes' default, where it is left out
            rope_theta=number("rope_theta", rope_theta, float),
            max_position=number("max_position_embeddings", 4096, int),
            extra={k: config[k] for k in ("rope_scaling", *WINDOW_KEYS)
                   if config.get(k) is not None or (k == "sliding_window" and k in config)},
        )

    def to_hf_config(self):
        """A transformers config object for this spec (used to build random-init models)."""
        import transformers

        classes = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}
        kwargs = dict(
            num_hidden_layers=self.num_layers, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            vocab_size=self.vocab, tie_word_embeddings=self.tied_embeddings, hidden_act=self.activation,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, max_position_embeddings=self.max_position,
        )
        if self.model_type == "llama":
            kwargs.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        if self.extra.get("rope_scaling"):
            kwargs["rope_scaling"] = self.extra["rope_scaling"]
        if self.model_type in ("mistral", "qwen2"):      # else the config class's default window (Mistral: 4096)
            kwargs.update({key: self.extra[key] for key in WINDOW_KEYS if key in self.extra})
        config = getattr(transformers, classes[self.model_type])(**kwargs)
        config.dtype = self.dtype  # saved as "dtype" in config.json (transformers >= 4.56)
        return config


COMPRESSED_MARKER = "memfit_compress.json"  # what `memfit compress` writes beside the dense config.json (memfit.compress)


def is_compressed_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory ``memfit compress`` wrote (it holds COMPRESSED_MARKER). Defined here, below
    memfit.compress, so that load_spec can tell one without importing it."""
    return (Path(path) / COMPRESSED_MARKER).is_file()


def refuse_compressed_dir(path: str | Path) -> None:
    """Where a dense Hugging Face model directory is expected (load_spec; plan, verify, finetune, calibrate,
    compress, and generate for a dense model: their argument checks call this), refuse one ``memfit compress``
    wrote, given as the directory or its config.json: that config.json is the dense model's, so load_spec would
    read the dense model's spec and transformers would build the dense model, find the factors unexpected and the
    dense weights missing, and run on random weights. The message says how to run it, load it and plan its jobs."""
    path = Path(path).expanduser()
    if path.is_file():
        path = path.parent
    if not is_compressed_dir(path):
        return
    try:
        meta = json.loads((path / COMPRESSED_MARKER).read_text())
        blocks = "" if meta["method"] == "lowrank" else f" --blr-blocks {meta['blocks']}"
        ratio = meta.get("ratio")          # as asked: the reached linear_ratio, rounded, planned other ranks
        ratio = f"{ratio:g}" if isinstance(ratio, (int, float)) else "RATIO (the --ratio it was compressed with)"
        skip = meta.get("skip")
        near = (f"; it was compressed with --skip {','.join(skip) or 'none'}, and memfit plan --blr keeps the default "
                "kinds dense, so that plan is of a model compressed without it" if skip is not None else "")
        what = (f" ({meta['method']} of {meta['source']}, {meta['linear_ratio']:.1%} of its linear parameters "
                f"kept; plan its jobs with memfit plan --model {meta['source']} --blr {meta['method']}{blocks} "
                f"--blr-ratio {ratio}{near})")
    except (OSError, ValueError, KeyError, TypeError):
        what = ""
    raise MemfitError(f"{path} is a memfit-compressed model{what}: load_spec and memfit's commands other than "
                      f"generate read dense Hugging Face models; memfit generate {path} runs it, and in Python load it "
                      "with memfit.compress.load_compressed")


def load_spec(model: str | Path | ModelSpec) -> ModelSpec:
    """A spec from a preset name, a model directory or a ``config.json`` path; a directory ``memfit compress`` wrote
    is refused (its config.json is the dense model's)."""
    from memfit.models.presets import PRESETS

    if isinstance(model, ModelSpec):
        return model
    text = str(model)
    if text in PRESETS:
        return PRESETS[text]
    if not text.strip():
        raise MemfitError(f"no model given: name a preset ({', '.join(PRESETS)}) or a local directory with config.json")
    path = Path(text).expanduser()
    refuse_compressed_dir(path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise MemfitError(f"{text}: the directory has no config.json")
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            if path.name != "config.json":            # chat.jsonl passed as the model had read as a malformed config
                raise MemfitError(f"{text!r} is a file that is not JSON ({err}): pass a preset, a model directory "
                                  "or its config.json") from None
            raise MemfitError(f"{path}: malformed config.json ({err})") from None
        if path.name != "config.json" and not (isinstance(config, dict) and "model_type" in config):
            raise MemfitError(f"{text!r} is a JSON file but not a model's config.json (it names no model_type): pass "
                              "a preset, a model directory or its config.json")
        # named by its absolute path: a record of the job (plan --json) then reads back from any directory, and a
        # directory named like a preset (./llama-3.2-1b) is not read back as the preset
        return ModelSpec.from_hf_config(config, name=str((path.parent if path.name == "config.json" else path).resolve()))
    hint = " (memfit downloads nothing: save the model locally and pass its directory)" if "/" in text else ""
    raise MemfitError(f"unknown model {text!r}{hint}. Presets: {', '.join(PRESETS)}; or a local directory with config.json")
