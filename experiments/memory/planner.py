"""Memory planner: predicted per-GPU bytes of one GRPO training step, by category, and whether it fits.

    from experiments.memory.planner import plan
    p = plan("gemma-2-27b", "logra", gpus=8, gpu_mem_gb=80, sharding="fsdp", seq_len=1536)
    print(p.table())

``model`` is a preset name (``experiments/memory/presets/<name>.json``: shapes copied from the public
HF ``config.json``, source noted in each file; no weights), an HF config name or local path (read with
``AutoConfig``), or a config dict with the same keys.

How it predicts: from the config's shapes alone it lists the tensors that are alive at each candidate
peak of a training step and takes the largest —

* ``backward``: the start of the last micro-batch's backward, in the LM head: every activation the
  forward saved for backward (per decoder layer, derived from what each op of the HF Llama/Qwen2
  layer saves: norms, q/k/v, SDPA, MLP), the head's chunked-log-prob buffers, the head's fp32
  weight gradient and the hidden-state gradient; beside the parameters, the optimizer state and the
  gradients (or sketches) of the earlier micro-batches;
* ``recompute`` (activation checkpointing only): one layer recomputed inside backward;
* ``backward_end``: the embedding's backward, where a tied head's gradient (held since the head's
  backward) and the embedding lookup's gradient are summed, beside every other gradient;
* ``optimizer``: the step, with the method's own temporaries.

What is particular to a method (its optimizer state, gradients or sketches, what its layers save
for backward, whether the embedding and head get dense gradients, its temporaries at the step)
comes from the method itself: ``Method.memory_terms`` in its own file (``baselines/<method>.py``,
vocabulary in ``baselines/memory_terms.py``); this module names no method.

Each term carries its assumption; ``Plan.table()`` prints them, the candidates and which one won.
The terms follow the code paths of this repository (``experiments/rl/grpo.py``,
``logra_core/chunked_head.py``, ``logra_core/sketch.py``, ``baselines/``) and were checked against
the tensor-accounting profiler (``experiments/memory/profiler.py``, ``python -m
experiments.memory_table``): within 10 % (in fact 0.1 %) for every method on tiny-llama
(``tests/test_planner.py``, also with a padding mask) and SmolLM2-135M (``results/memory_table/``),
fp32 on CPU; on tiny-llama also with ``train.logprob_chunk=0`` (full logits) and activation
checkpointing (where the head is the peak). In bf16 the precision modes (dense ``precision=mixed|bf16``,
logra ``master=fp32|kahan|stochastic|none``, logra with sketched embeddings, lora) were checked the same
way on tiny-llama (``tests/test_planner.py``) and SmolLM2 (``results/memory_table_bf16/``): in bf16 HF's
RMSNorm keeps an fp32 copy of its input, and the head's fp32 weight gradient is cast to bf16 at the end
of its backward. Settings those checks do not cover (fp16, CUDA kernels and CUDA's foreach AdamW, FSDP
gathers, Gemma-2's extra norms and eager attention) are marked UNCHECKED in the printed assumptions. With checkpointing on SmolLM2 (``results/memory_table/checkpointing``)
the peak moves to the embedding's backward (dense, logra: ``backward_end``) or to a recomputed layer (lora).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from baselines.memory_terms import CATEGORIES, PlanContext, Term
from experiments.memory.phases import ENGINES, PHASES, TRAIN_CANDIDATES, Step, engine_needs, engine_reserve
from experiments.memory.phases import phases as phase_terms

PRESET_DIR = Path(__file__).with_name("presets")
SHARDINGS = ("none", "fsdp", "zero2", "zero3")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "bfloat16": 2, "float16": 2, "float32": 4}
CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
OPTIONS = {"gradient_checkpointing", "master_weights", "rollout_share", "logprob_chunk",
           "completion_len", "micro_batches", "attention", "padded", "other_gb", "engine", "device",
           "step_control", "probe_seqs", "phases", "reference_model", "vllm"}  # beside each method's plan_option_names


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_model_config(model) -> tuple[str, dict]:
    """(name, config dict) from a preset name, an HF config name/path, or a dict."""
    if isinstance(model, dict):
        cfg, name = dict(model), str(model.get("name", "custom"))
    elif (PRESET_DIR / f"{model}.json").is_file():
        cfg, name = json.loads((PRESET_DIR / f"{model}.json").read_text()), model
    elif Path(str(model)).is_file():
        cfg, name = json.loads(Path(model).read_text()), str(model)
    elif "/" in str(model):
        try:
            from transformers import AutoConfig
            cfg, name = AutoConfig.from_pretrained(str(model)).to_dict(), str(model)
        except Exception as e:  # noqa: BLE001  (any failure means: not a model we know)
            raise ValueError(f"unknown model {model!r}: not a preset ({', '.join(presets())}), "
                             f"a config.json path, or a loadable HF config ({type(e).__name__}: {e})") from None
    else:
        raise ValueError(f"unknown model {model!r}: not a preset ({', '.join(presets())}), a config.json path, "
                         "or an HF name (org/name)")
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"model config {name!r} lacks {missing}")
    return name, cfg


@dataclass
class Shapes:
    """Parameter counts of a decoder-only transformer from its config."""
    proj: list[tuple[int, int]]  # (out, in) of every attention/MLP projection (the sketched ones)
    embed: int
    head: int  # 0 when tied
    norms: int
    biases: int
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    gemma: bool = False
    softcap: float | None = None

    @property
    def n_proj(self) -> int:
        return sum(m * n for m, n in self.proj)

    @property
    def n_rest(self) -> int:
        return self.embed + self.head + self.norms + self.biases

    @property
    def total(self) -> int:
        return self.n_proj + self.n_rest

    @property
    def tied(self) -> bool:
        return self.head == 0

    @property
    def layer_params(self) -> int:
        return (self.n_proj + self.biases) // self.layers + (self.norms - self.hidden) // self.layers


def shapes(cfg: dict) -> Shapes:
    h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    ff = cfg["intermediate_size"]
    layer = [(nh * hd, h), (kv * hd, h), (kv * hd, h), (h, nh * hd), (ff, h), (ff, h), (h, ff)]
    bias = (nh * hd + 2 * kv * hd) if cfg.get("attention_bias") else 0
    gemma = "gemma" in str(cfg.get("model_type", "")) or str(cfg.get("source", "")).startswith("google/gemma")
    tied = cfg.get("tie_word_embeddings", True)
    return Shapes(proj=layer * L, embed=V * h, head=0 if tied else V * h, norms=L * (4 if gemma else 2) * h + h,
                  biases=L * bias, hidden=h, layers=L, vocab=V, heads=nh, kv_heads=kv, head_dim=hd, inter=ff,
                  gemma=gemma, softcap=cfg.get("final_logit_softcapping"))


@dataclass
class Plan:
    model: str
    method: str
    terms: list[Term]  # what is alive at the predicted peak
    capacity_bytes: int
    assumptions: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    candidates: dict[str, int] = field(default_factory=dict)  # candidate peak -> bytes (fwd_bwd's candidates, the other phases)
    peak_at: str = ""  # the candidate at the peak: a fwd_bwd candidate (backward, recompute, backward_end) or a phase
    phases: dict[str, list[Term]] = field(default_factory=dict)  # every planned phase's terms (experiments/memory/phases.py)
    peak_phase: str = ""
    engine: list[Term] = field(default_factory=list)  # what a colocated vLLM engine needs as built, against its share
    engine_reserve: int = 0  # the share vLLM is handed (gpu_memory_utilization x the GPU)

    def phase_bytes(self) -> dict[str, int]:
        return {name: int(sum(t.nbytes for t in ts)) for name, ts in self.phases.items()}

    @property
    def engine_share(self) -> int:
        return self.engine_reserve

    @property
    def engine_fits(self) -> bool:
        """Whether the engine as built fits its share (no engine to check: True)."""
        return not self.engine or sum(t.nbytes for t in self.engine) <= self.engine_share

    @property
    def categories(self) -> dict[str, int]:
        out = {c: 0 for c in CATEGORIES}
        for t in self.terms:
            out[t.category] += int(t.nbytes)
        return out

    @property
    def total_bytes(self) -> int:
        return int(sum(t.nbytes for t in self.terms))

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    def table(self) -> str:
        gib = 2**30
        unit, scale = ("GiB", gib) if self.total_bytes >= gib else ("MiB", 2**20)
        s = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        lines = [f"{self.model} / {self.method}: {s}", f"  {'category':<12} {unit + ' per GPU':>12}"]
        lines += [f"  {k:<12} {v / scale:>12.2f}" for k, v in self.categories.items()]
        lines.append(f"  {'total':<12} {self.total_bytes / scale:>12.2f}  of {self.capacity_bytes / gib:.1f} GiB -> "
                     + ("fits" if self.fits else "DOES NOT FIT"))
        lines.append(f"  peak at: {self.peak_phase}" + (f" ({self.peak_at})" if self.peak_at != self.peak_phase else "")
                     + " (candidates: " + ", ".join(f"{k} {v / scale:.2f}" for k, v in self.candidates.items()) + f" {unit})")
        if self.phases:
            lines.append(f"  per phase ({unit} per GPU, everything alive in it):")
            lines += [f"    {name:<11} {v / scale:>10.2f}  " + ("fits" if v <= self.capacity_bytes else "DOES NOT FIT")
                      + ("  <- peak" if name == self.peak_phase else "") for name, v in self.phase_bytes().items()]
        if self.engine:
            need = sum(t.nbytes for t in self.engine)
            lines.append(f"  rollout engine as built: {need / scale:.2f} {unit} against its share of {self.engine_share / scale:.2f} "
                         f"{unit} -> " + ("fits" if self.engine_fits else "DOES NOT FIT") + ": "
                         + "; ".join(f"{t.name} {t.nbytes / scale:.2f}" for t in self.engine))
        lines.append("  terms at the peak:")
        lines += [f"    {t.category:<11} {t.nbytes / scale:>10.2f} {unit}  {t.name}" + (f": {t.note}" if t.note else "")
                  for t in self.terms if t.nbytes]
        lines.append("  assumptions:")
        lines += [f"    - {a}" for a in self.assumptions]
        return "\n".join(lines)


def _int(x) -> int:
    return int(math.ceil(x))


def plan(model, method, *, gpus=1, gpu_mem_gb=80.0, micro_batch=1, seq_len=1024, rank=256, sharding="none",
         rollout="colocated", dtype="bf16", **opts) -> Plan:
    """Predicted per-GPU bytes by category at the step's peak (see the module docstring).

    ``seq_len``: prompt + completion tokens of a sequence (padded); ``rank``: LoGRA sketch rank, GaLore
    rank, or LoRA r. opts: ``completion_len`` (tokens per sequence through the LM head; default
    ``seq_len``), ``micro_batches`` (per update, default 2: the gradients of the earlier micro-batches
    are alive during the last one's backward; 1: they are not), ``logprob_chunk`` (the harness'
    ``train.logprob_chunk``, default 256; 0 = full logits), ``gradient_checkpointing`` (default True),
    each method's own options (its ``plan_option_names``, filled from its config section by
    ``Method.plan_options``; other methods ignore them): ``precision`` (dense, galore, lora: ``mixed``
    = fp32 master + fp32 moments, the default, or ``bf16``), logra's ``master`` (``fp32`` | ``kahan`` |
    ``stochastic`` | ``none``: 4, 2, 0, 0 B per sketched element beside a bf16 weight),
    ``dense_precision`` (its AdamW group) and ``embeddings`` (sketch the embedding and a tied head);
    ``master_weights`` (the AdamW precision where a method's options name none: True = mixed, the
    default; False = bf16), ``padded`` (default True: prompts of
    different lengths, so HF passes a padding mask to SDPA and repeats k/v to every head; False: equal
    lengths, no mask), ``attention`` (``sdpa`` or ``eager``;
    default eager for Gemma-2, whose attention softcapping SDPA refuses), ``rollout_share`` (fraction
    of the GPU handed to a colocated vLLM engine as gpu_memory_utilization; default: what it needs as
    built), ``vllm`` (the ``rollout.vllm`` section: sleep level, KV budget, CUDA graphs, sequences;
    experiments/memory/phases.py ``vllm_terms``), ``other_gb`` (CUDA context and allocator slack,
    default 1.0).
    """
    from baselines import METHODS  # the registry: each method's memory terms (imports the methods, and torch)

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(sorted(METHODS))}")
    cls = METHODS[method]
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; known: {', '.join(SHARDINGS)}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    if int(gpus) < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    known = OPTIONS.union(*(m.plan_option_names for m in METHODS.values()))
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ValueError(f"unknown planner option(s) {unknown}; known: {sorted(known)}")
    name, cfg = load_model_config(model)
    s = shapes(cfg)
    b = DTYPE_BYTES[dtype]
    low = b < 4
    gpus, B, T = int(gpus), int(micro_batch), int(seq_len)
    C = int(opts.get("completion_len") or T)
    if not 0 < C <= T:
        raise ValueError(f"completion_len must be in [1, seq_len={T}], got {C}")
    k = int(opts.get("micro_batches", 2))
    if k < 1:
        raise ValueError(f"micro_batches must be >= 1, got {k}")
    ckpt = bool(opts.get("gradient_checkpointing", True))
    master = bool(opts.get("master_weights", low))
    chunk = int(opts.get("logprob_chunk", 256))
    attention = str(opts.get("attention") or ("eager" if s.gemma else "sdpa"))
    padded = bool(opts.get("padded", True))
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention must be sdpa or eager, got {attention!r}")
    r = int(rank)
    h, L, V, ff = s.hidden, s.layers, s.vocab, s.inter
    q = s.heads * s.head_dim
    N, Nh = B * T, B * C  # tokens through the layers / through the LM head
    A: list[str] = [f"{s.total / 1e9:.3f} B parameters ({s.n_proj / 1e9:.3f} B in attention/MLP projections), "
                    f"weights and activations in {dtype} ({b} B each); micro-batch {B} x {T} tokens, "
                    f"{C} completion tokens per sequence through the LM head; {k} micro-batch(es) per update"]
    if low:
        A.append(f"{dtype}: every activation term is the fp32-checked element count times {b} B, except the norms' "
                 "fp32 input copies and the fp32 head buffers (checked in bf16 on CPU); CUDA kernels' workspaces "
                 "are UNCHECKED")
    shard_p = gpus if sharding in ("fsdp", "zero3") else 1
    shard_g = gpus if sharding in ("fsdp", "zero2", "zero3") else 1
    shard_o = gpus if sharding != "none" else 1
    A.append(f"sharding {sharding} over {gpus} GPU(s): params /{shard_p}, grads /{shard_g}, optimizer state /{shard_o}; "
             "activations are per GPU (data parallel)")

    # ---- the method's own part: state, gradients, what it saves (Method.memory_terms) ---------------
    device = str(opts.get("device", "cuda"))
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device!r}")
    ctx = PlanContext(shapes=s, weight_bytes=b, rank=r, micro_batches=k, shard_params=shard_p, shard_grads=shard_g,
                      shard_optimizer=shard_o, options={key: v for key, v in opts.items() if key in cls.plan_option_names},
                      precision="mixed" if master else "bf16", device=device)
    if low:
        A.append("AdamW precision where the method's options name none: " + (
            "mixed (fp32 master + two fp32 moments, 12 B per trained element)" if master
            else f"bf16 (two moments in the weight dtype, {2 * b} B, no master)"))
    try:
        mt = cls.memory_terms(ctx)
    except NotImplementedError as e:
        raise ValueError(str(e)) from None
    A += mt.assumptions
    persist: list[Term] = [Term("params", "weights", s.total * b // shard_p, f"{s.total:,} x {b} B")]  # alive for the whole step
    persist += mt.state
    grads_all = list(mt.grads)  # alive once a micro-batch's backward has run (several micro-batches per update)

    # ---- activations saved by the forward, per decoder layer and token (elements) -------------------
    nh, kv = s.heads, s.kv_heads
    per_layer = []  # (elements per token, bytes per element, what)
    norm_in = 4  # HF's RMSNorm computes in fp32: it keeps x.float() (in fp32 that is x itself)
    per_layer.append((2 * h, norm_in, "residual stream: the layer's input and the mid-layer sum (RMSNorm keeps its "
                                      "input, as fp32: HF's norm upcasts; the bf16 copy is not kept)"))
    if mt.trains_norms:
        per_layer.append((2 * h, b, "two normalized x (the RMSNorm weight's gradient needs them)"))
    if mt.saves_inputs:
        per_layer.append((2 * h, b if mt.input_bytes is None else mt.input_bytes,
                          "two RMSNorm outputs (the q/k/v and gate/up inputs, kept for their weight gradients)"))
    kvd = kv * s.head_dim
    if padded:
        A.append("padded prompts: HF passes a 4-D additive padding mask, so SDPA gets k/v repeated to every head "
                 "(checked on tiny-llama with memory_table pad=16)")
    if padded and kv != nh:
        per_layer.append((4 * q, b, "SDPA's saved q (after RoPE), k and v repeated to every head (HF repeats them "
                                    "when a padding mask is passed), output (also o_proj's input)"))
    else:
        per_layer.append((2 * q + 2 * kvd, b, "SDPA's saved q and k (after RoPE), v, output (also o_proj's input)"
                          + ("; no padding: no mask, SDPA does GQA itself" if kv != nh else "")))
    per_layer.append((nh, 4, "SDPA's log-sum-exp (fp32)"))
    per_layer.append((3 * ff, b, "MLP: gate (SiLU's input), SiLU(gate) and up (the product's inputs)"))
    if mt.saves_inputs:
        per_layer.append((ff, b, "down_proj's input SiLU(gate)*up"))
    per_layer += mt.layer_extra
    if s.gemma:
        per_layer.append((2 * h, b + 4, "Gemma-2: two more norms per layer (post-attention, post-MLP) keep their input "
                                        "and an fp32 normalized x - UNCHECKED"))
    if attention == "eager":
        per_layer.append((2 * nh * T, b, "eager attention: scores and softmax (heads x seq_len per token) - UNCHECKED"))
    layer_bytes = sum(e * by for e, by, _ in per_layer)  # per token
    saved_layers = N * layer_bytes * L
    if not (mt.trains_norms or mt.trains_embedding):
        saved_layers -= N * h * norm_in  # the embedding output needs no gradient: layer 0's norm keeps nothing
    final = N * h * (norm_in + (b if mt.trains_norms else 0))  # the final norm's fp32 input (+ normalized x)
    A.append("saved per layer and token: " + "; ".join(f"{e} x {by} B {w}" for e, by, w in per_layer))
    # padding only: HF's additive 4-D mask in the activation dtype (the profiler sees two of them); RoPE cos/sin
    shared = (2 * B * T * T * b if padded else 0) + 2 * B * T * s.head_dim * b
    acts_fwd: list[Term] = []
    if ckpt:
        ckpt_inputs = N * h * b * L
        acts_fwd.append(Term("activations", "checkpointed layer inputs", ckpt_inputs, f"{L} layers x tokens x h"))
        A.append("activation checkpointing (non-reentrant): each layer keeps only its input; backward recomputes "
                 "one layer at a time (the 'recompute' candidate: one layer's saved set + ~(2 ffn + 2 h) gradient "
                 "elements per token; checked once, SmolLM2 lora with logprob_chunk=16: 1.004)")
    else:
        acts_fwd.append(Term("activations", "saved decoder-layer activations", saved_layers,
                             f"{L} layers x {N} tokens x {layer_bytes} B"))
    acts_fwd.append(Term("activations", "final norm", final, "its input (+ normalized x when trained)"))
    acts_fwd.append(Term("activations", "attention mask + RoPE tables", shared, "once per micro-batch"))

    # ---- the LM head: log-probs of the completion tokens ------------------------------------------
    plain_head = True  # the chunked head applies Gemma-2's final-logit softcap per chunk (logra_core/chunked_head.py)
    head_terms: list[Term] = []
    Nl = Nh  # tokens whose log-prob is taken
    loss_vecs = Nl * 4 * 12
    head_terms.append(Term("activations", "per-token loss tensors", loss_vecs, "~12 fp32 vectors over the completion tokens"))
    hid_grad = Term("activations", "hidden-state gradient", Nl * h * b, "tokens x h")
    if chunk > 0 and plain_head:
        c = min(chunk, Nl)
        n_chunks = -(-Nl // c)
        head_terms.append(Term("activations", "head input", Nl * h * b if B > 1 else N * h * b,
                               "the completion positions' hidden states (a copy; with micro_batch 1 a view of all)"))
        bufs = (3 if n_chunks > 1 else 2) + (1 if s.softcap else 0)  # softcap: the capped z lives on for ∂z/∂u
        head_terms.append(Term("activations", "chunked head logits buffers", bufs * c * V * 4,
                               f"{bufs} fp32 chunk x V buffers in backward (logits, logits - lse, softmax; the previous "
                               f"chunk's gradient is still referenced), chunk {c}, {n_chunks} chunk(s)"))
        head_terms.append(hid_grad)
        A.append(f"LM head: chunked log-probs (train.logprob_chunk={chunk}), logsumexp kept per token")
        if s.softcap:
            A.append("chunked head with final-logit softcapping: one more chunk x V buffer, UNCHECKED against the profiler")
    else:
        why = "final_logit_softcapping" if not plain_head else "logprob_chunk=0"
        kept = (Nl + B) * V * 4 if not low else Nl * V * 4  # fp32: a view keeps the model's C+1 logits; else the fp32 copy
        if s.softcap:
            kept += (Nl + B) * V * b
        head_terms.append(Term("activations", "full logits", kept,
                               "fp32 logits kept by logsumexp" + (" + the softcap's tanh output" if s.softcap else "")))
        head_terms.append(Term("activations", "logsumexp backward buffers", 3 * Nl * V * 4,
                               "three fp32 tokens x V buffers (x - lse, its exp, times the gradient); the peak comes "
                               "before the head's weight gradient exists"))
        A.append(f"LM head: full logits ({why}): the model's own head over {Nl} tokens")
        if low or s.softcap:
            A.append("full-logits head in bf16/fp16 or with softcapping: UNCHECKED against the profiler")
    if mt.head_grad and chunk > 0 and plain_head:
        head_terms.append(Term("activations", "head weight gradient (in flight)", V * h * 4,
                               "fp32 V x h, summed into the embedding's gradient only when backward reaches the embedding"))
        if low:  # the head's backward ends with fp32 grad_w.to(bf16) beside the last chunk's gradient only
            freed = (bufs - 1) * min(chunk, Nl) * V * 4
            head_terms.append(Term("activations", "head weight gradient's cast to the weight dtype",
                                   max(0, V * h * b - freed),
                                   f"V x h x {b} B at the end of the head's backward, less the {bufs - 1} chunk buffer(s) "
                                   "freed by then (the larger of the two moments)"))
    if chunk > 0 and plain_head:
        head_terms += mt.head

    # ---- candidates ---------------------------------------------------------------------------------
    acc = grads_all if k > 1 else []
    cands: dict[str, list[Term]] = {}
    cands["backward"] = persist + acc + acts_fwd + head_terms
    if ckpt:
        one = N * layer_bytes
        trans = N * (2 * ff + h) * b
        cands["recompute"] = persist + acc + acts_fwd[:1] + [
            Term("activations", "one recomputed layer", one, "its saved activations"),
            Term("activations", "gradients flowing in that layer", trans + N * h * b, "~(2 ffn + 2 h) per token"),
        ] + ([Term("activations", "head weight gradient (in flight)", V * h * 4, "")] if mt.head_grad else [])
    # the end of backward: the embedding's gradient meets the tied head's (held since the head's backward)
    if mt.embed_grad:
        n_buf = (3 if s.tied else 1) - (1 if k == 1 else 0)  # with no .grad yet, the sum becomes the gradient
        cands["backward_end"] = persist + grads_all + [
            Term("activations", "embedding gradient buffers", n_buf * V * h * b,
                 ("the head's gradient, the embedding lookup's and their sum" if s.tied else "the embedding lookup's gradient")
                 + " (V x h each); every activation is freed by then")]
    # the optimizer step, with the method's temporaries
    opt_terms = persist + (grads_all if mt.grads_at_step else []) + mt.step
    cands["optimizer"] = opt_terms

    # ---- every phase of the step, with what is resident beside the trainer (experiments/memory/phases.py) ----
    capacity = int(float(gpu_mem_gb) * 2**30)
    engine = str(opts.get("engine") or ("none" if rollout in ("none", None, False, "external") else "vllm"))
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    from experiments.rl.vllm_config import VLLMConfig

    vllm = VLLMConfig(**dict(opts.get("vllm") or {}))  # rollout.vllm.*: the engine as built (phases.vllm_terms)
    fraction = float(rollout) if isinstance(rollout, (int, float)) or str(rollout).replace(".", "", 1).isdigit() \
        else opts.get("rollout_share")
    if engine == "vllm" and fraction is not None:  # a share given by hand is the gpu_memory_utilization vLLM gets
        if not 0.0 <= float(fraction) < 1.0:
            raise ValueError(f"rollout share must be in [0, 1), got {fraction}")
        vllm.gpu_memory_utilization = float(fraction)
    other = int(float(opts.get("other_gb", 1.0 if device == "cuda" else 0.0)) * 2**30)
    A.append(f"rollout engine: {engine}" + (f", rollout.vllm sleep={vllm.sleep}, cuda_graphs={vllm.cuda_graphs}"
                                             if engine == "vllm" else "")
             + (f"; CUDA context and allocator reserve {other / 2**30:.1f} GiB (assumed)" if other else ""))
    control = opts.get("step_control")
    control = cls.step_control_default if control is None else bool(control)
    rows_per_gpu = B * k
    probe = int(opts.get("probe_seqs") or min(rows_per_gpu, max(12, -(-rows_per_gpu // 4))))
    st = Step(s=s, b=b, gpus=gpus, fsdp=sharding in ("fsdp", "zero3"), persist=persist,
              grads=grads_all if mt.grads_at_step else [], update=mt.step, candidates=cands, rank=r,
              sketched_rows=mt.sketched_rows, sketched_max_rows=mt.sketched_max_rows,
              receiver_bytes=mt.receiver_bytes, dense_layer_grads=mt.dense_layer_grads,
              rows=rows_per_gpu, seq_len=T,
              completion_len=C, probe_seqs=probe, cuda=device == "cuda", engine=engine, share_bytes=0,
              other_bytes=other, step_control=control, reference=bool(opts.get("reference_model", False)), vllm=vllm)
    share = engine_reserve(st, capacity) if engine == "vllm" else 0
    st.share_bytes = share
    wanted = opts.get("phases") or PHASES
    by_phase = {name: ts for name, ts in phase_terms(st).items() if name in wanted}
    totals = {name: sum(t.nbytes for t in ts) for name, ts in by_phase.items()}
    peak_phase = max(totals, key=totals.get)
    train = {n: sum(t.nbytes for t in ts) for n, ts in cands.items()}
    fwd = max((n for n in train if n in TRAIN_CANDIDATES), key=train.get)
    peak_at = {"fwd_bwd": fwd}.get(peak_phase, peak_phase)
    candidates = {**{n: v for n, v in train.items() if n in TRAIN_CANDIDATES}, **{n: v for n, v in totals.items() if n != "fwd_bwd"}}
    if sharding in ("fsdp", "zero3") and gpus > 1:
        A.append("FSDP2 holds its root (embedding, final norm, head) and two layers gathered in the forward/backward, one layer "
                 "in the KL prediction (logra_core/layerwise.py); checked on CPU with 2 gloo ranks (results/fsdp2_memory)")
    settings = {"gpus": gpus, "gpu_mem_gb": gpu_mem_gb, "micro_batch": B, "seq_len": T, "completion_len": C,
                "micro_batches": k, "rank": r, "sharding": sharding, "rollout": rollout, "dtype": dtype,
                "gradient_checkpointing": ckpt, "logprob_chunk": chunk, "engine": engine, "step_control": control,
                "device": device}
    engine_terms = engine_needs(st) if engine == "vllm" else []
    if engine == "vllm":
        start = sum(t.nbytes for t in persist) + other + share
        A.append(f"vLLM starts beside the loaded trainer: gpu_memory_utilization {share / capacity:.2f} "
                 f"({share / 2**30:.1f} GiB) + the trainer's resident {(start - share) / 2**30:.1f} GiB = "
                 f"{start / 2**30:.1f} GiB " + ("<=" if start <= capacity else "> (vLLM's start-up check refuses)")
                 + f" {capacity / 2**30:.0f} GiB; weights in place (no shadow copy), tensor_parallel_size=1")
        if vllm.sleep == 1:
            A.append(f"sleep level 1: vLLM's weights ({engine_terms[0].nbytes / 2**30:.1f} GiB) live in pinned host "
                     "memory outside rollouts and syncs, per rank")
    return Plan(name, method, list(by_phase[peak_phase]), capacity, A, settings, candidates, peak_at,
                phases=by_phase, peak_phase=peak_phase, engine=engine_terms, engine_reserve=share)
