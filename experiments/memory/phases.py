"""The memory planner's phases: what is alive on one GPU in each phase of a GRPO step (docs/memory.md).

The planner (``experiments/memory/planner.py``) derives the training step's candidate peaks from shapes
(the forward/backward and the optimizer step). This module adds the other phases and what sharding
and the rollout engine add to each, and returns every phase's terms; the peak is the largest phase,
with what is alive in it — never a maximum over pieces that coexist.

Per GPU, in every phase: the weights' shard and the method's state (the planner's ``persist``), and
what stays resident beside the trainer — a colocated vLLM engine as built (:func:`vllm_terms`, from
``rollout.vllm.*``: its CUDA graphs' pool and the receiver's precision state always; its weights and KV
cache too unless it sleeps between rollouts), or an ``hf`` engine's whole copy with the receiver's
precision buffers, and on CUDA the context and allocator reserve (``other_gb``, an assumption). Then per
phase:

* ``init`` — the load (experiments/rl/materialize.py): the shards, and the block of rows being read
  (the engine is built after it);
* ``rollout`` — generation: the KV cache and a decode step's logits; with ``engine=shared`` under FSDP
  the trainer's weights gathered whole (what the engine samples from); a vLLM engine's weights, KV
  budget and decode workspace (woken here when it sleeps);
* ``fwd_bwd`` — the largest of the step's candidates (backward, recompute, backward_end) plus, under
  FSDP, the root's parameters gathered (embedding, final norm, head: the chunked head runs inside the
  root's forward), two decoder layers gathered (current and prefetched) and one layer's unsharded
  gradient before its reduce-scatter — all at once, as FSDP2 holds them;
* ``kl_predict`` — step control (experiments/rl/distributed/fsdp2.py, logra_core/layerwise.py): the
  gradients or sketches and the proposed update, the probe's no-grad forward (one layer's working set
  for the probe tokens), the hidden states kept at θ and at the trial, the vocabulary sums, and under
  FSDP one layer gathered with its m × r factors and every rank's probe states all-gathered;
* ``optimizer`` — the step's candidate (on CUDA the method's AdamW temporaries are foreach's: one the size
  of every stepped element, ``_foreach_sqrt`` of the second moments, baselines/memory_terms.py);
* ``sync`` — the payload to the engine (logra_core/sync.py): under FSDP the largest sketched weight's L
  gathered whole (m × r fp32; one at a time: unsharded, the payload reads the trainer's own), the
  largest changed dense tensor gathered whole (one at a time), the digest's work buffer; the gradients or sketches are still alive; a sleeping vLLM engine's weights are woken
  for it (its KV cache is not: verl's order, weights, sync, then KV).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from baselines.memory_terms import Term
from experiments.rl.vllm_config import VLLMConfig, engine_bytes, utilization

PHASES = ("init", "rollout", "fwd_bwd", "kl_predict", "optimizer", "sync")
TRAIN_CANDIDATES = ("backward", "recompute", "backward_end")  # inside fwd_bwd
ENGINES = ("vllm", "hf", "shared", "none")
DIGEST_BUFFER = 4 * 16 * 2**16  # logra_core/digest.py: GROUP_BLOCKS x BLOCK int32 words
VOCAB_BLOCK = 1024  # logra_core/kl_predictor.py: head rows per block of the vocabulary sums
READ_ELEMENTS = 1 << 18  # experiments/rl/materialize.py: elements read from a weight source at once


@dataclass
class Step:
    """What the planner derived for the training step, and the settings the phases need."""

    s: object  # planner.Shapes
    b: int  # weight bytes
    gpus: int
    fsdp: bool  # parameters row-sharded over the GPUs (FSDP)
    persist: list[Term]  # the weights' shard and the method's state
    grads: list[Term]  # gradients / sketches (alive from the backward to the end of the step)
    update: list[Term]  # the method's step terms (the proposed update held until apply)
    candidates: dict[str, list[Term]]  # the training step's candidates (persist included)
    rank: int
    sketched_rows: int  # Σ m over the sketched weights (0: the method sends no low-rank ops)
    sketched_max_rows: int  # the largest m of a sketched weight
    receiver_bytes: int  # bytes per sketched element the engine keeps beside its weights (masters, compensations)
    dense_layer_grads: bool  # a layer's unsharded gradient exists before FSDP's reduce-scatter
    rows: int  # sequences per GPU per step (rollout and training)
    seq_len: int
    completion_len: int
    probe_seqs: int
    cuda: bool
    engine: str
    share_bytes: int
    other_bytes: int
    step_control: bool
    reference: bool = False  # a frozen reference model for a KL penalty (train.kl_coef > 0), placed as the policy
    notes: list[str] = field(default_factory=list)
    vllm: Optional[VLLMConfig] = None  # rollout.vllm.* (engine=vllm; None: its defaults)


def _one_layer_factors(st: Step) -> int:
    s = st.s
    return (sum(m for m, _ in s.proj) // max(1, s.layers)) * st.rank * 4


def phases(st: Step) -> dict[str, list[Term]]:
    """Every phase's terms (see the module docstring); phases that do not occur are left out."""
    s, b, g = st.s, st.b, st.gpus
    sharded = st.fsdp and g > 1
    whole = s.total * b
    root = (s.embed + s.head + s.hidden) * b
    layer = s.layer_params * b
    resident = []
    engine = vllm_terms(st) if st.engine == "vllm" else {}
    asleep = st.engine == "vllm" and (st.vllm or VLLMConfig()).sleep > 0
    for key in ("graphs", "precision", "shadow") + (() if asleep else ("weights", "kv")):
        if key in engine:
            resident.append(engine[key])
    if st.engine == "hf":
        resident.append(Term("rollout", "hf engine copy", whole, "the whole policy in the weight dtype, per GPU"))
    if st.engine == "hf" and st.receiver_bytes and st.sketched_rows:
        resident.append(Term("rollout", "engine's precision buffers", s.n_proj * st.receiver_bytes,
                             "beside the engine's sketched weights (fp32 masters / Kahan compensations), whole"))
    if st.other_bytes:
        resident.append(Term("other", "CUDA context and allocator reserve", st.other_bytes, "assumed (other_gb)"))
    reference = [Term("params", "reference model", whole // (g if st.fsdp else 1), "frozen, sharded as the policy")] \
        if st.reference else []
    resident += reference
    out: dict[str, list[Term]] = {}
    largest = max([s.embed, s.head] + [m * n for m, n in s.proj])
    reading = min(largest // (g if st.fsdp else 1), READ_ELEMENTS)
    out["init"] = [st.persist[0], Term("activations", "the block of rows being read", reading * 4,
                                       f"at most {READ_ELEMENTS:,} elements, as stored (fp32 assumed)")] \
        + [t for t in resident if t.category == "other"] + reference  # the engine starts after the models are built
    kv = st.rows * st.seq_len * s.layers * 2 * s.kv_heads * s.head_dim * b
    gen = [Term("activations", "generation KV cache", kv, f"{st.rows} sequences x {st.seq_len} tokens"),
           Term("activations", "a decode step's logits", 2 * st.rows * s.vocab * 4, "fp32, and their softmax")]
    if st.engine == "shared":
        out["rollout"] = st.persist + ([Term("other", "weights gathered whole for generation", whole - whole // g,
                                              "FSDP: every layer unsharded while sampling")] if sharded else []) + gen + resident
    elif st.engine == "hf":
        out["rollout"] = st.persist + gen + resident
    elif st.engine == "vllm":  # the engine samples: woken if it sleeps, with its decode workspace
        out["rollout"] = st.persist + resident + [engine["workspace"]] + ([engine["weights"], engine["kv"]] if asleep else [])
    gathers = []
    if sharded:
        gathers = [Term("other", "FSDP root gathered", root, "embedding, final norm, head: the chunked head runs in the root's forward"),
                   Term("other", "two decoder layers gathered", 2 * layer, "the current layer and the prefetched one")]
        if st.dense_layer_grads:
            gathers.append(Term("grads", "a layer's unsharded gradient", layer, "before FSDP's reduce-scatter"))
    train = {k: v for k, v in st.candidates.items() if k in TRAIN_CANDIDATES}
    name = max(train, key=lambda k: sum(t.nbytes for t in train[k]))
    out["fwd_bwd"] = train[name] + gathers + resident
    if st.step_control:
        P, Ph = st.probe_seqs * st.seq_len, st.probe_seqs * st.completion_len
        ranks = g if sharded else 1
        probe = [Term("activations", "probe forward: one layer's working set", P * (2 * s.inter + 4 * s.hidden) * b,
                      f"{st.probe_seqs} probe sequences, no grad"),
                 Term("activations", "probe hidden states at θ and at the trial", 2 * ranks * Ph * s.hidden * 4,
                      "fp32, every rank's under FSDP (the vocabulary-parallel sums)"),
                 Term("activations", "vocabulary sums", 5 * ranks * Ph * VOCAB_BLOCK * 4,
                      f"a {VOCAB_BLOCK}-row block of the head for every probe token, fp32")]
        if sharded:
            probe += [Term("other", "one decoder layer gathered", layer, "FSDP2's own forward, one layer at a time"),
                      Term("other", "a layer's low-rank factors gathered", _one_layer_factors(st), "m x r fp32 per projection")]
        else:
            probe.append(Term("activations", "probe's decoder states", P * s.hidden * b, "the residual stream"))
        out["kl_predict"] = st.persist + st.grads + st.update + probe + resident
    out["optimizer"] = list(st.candidates["optimizer"]) + resident  # (CUDA's foreach AdamW temporary: the method's step terms)
    if st.engine in ("hf", "vllm"):
        biggest_dense = max(s.embed, s.head, s.hidden) * b
        payload = [Term("activations", "a low-rank factor gathered", st.sketched_max_rows * st.rank * 4,
                        "the largest sketched weight's L = −η·s·D, m x r fp32, whole; streamed: one at a time")] \
            if st.sketched_rows and sharded else []
        payload += [Term("activations", "a changed dense tensor gathered", biggest_dense, "streamed: one at a time"),
                    Term("activations", "digest work buffer", DIGEST_BUFFER, "int32 products of one block group")]
        woken = [replace_note(engine["weights"], "woken for the sync (sleep mode); its KV cache is not")] if asleep else []
        out["sync"] = st.persist + st.grads + payload + resident + woken
    return out


def replace_note(t: Term, note: str) -> Term:
    return Term(t.category, t.name, t.nbytes, note)


def vllm_terms(st: Step) -> dict[str, Term]:
    """A colocated vLLM engine as the harness builds it (experiments/rl/vllm_engine.py), per GPU, by term:
    its weights (tensor_parallel_size = 1: the whole policy), the KV budget, the decode workspace, the
    CUDA graphs' pool (an assumed constant; graphs are not freed by sleep mode), the receiver's precision
    state (beside vLLM's weights: 4 B per sketched element for fp32 masters, 2 for Kahan compensations,
    none for stochastic rounding or none), and on the CPU build the shadow copy payloads are replayed on.
    The in-place path (CUDA) keeps no shadow copy."""
    s, b, v = st.s, st.b, st.vllm or VLLMConfig()
    seqs, length = v.max_num_seqs or st.rows, v.max_model_len or st.seq_len
    n = engine_bytes(params=s.total, layers=s.layers, kv_heads=s.kv_heads, head_dim=s.head_dim, vocab=s.vocab,
                     hidden=s.hidden, inter=s.inter, dtype_bytes=b, max_num_seqs=seqs, max_model_len=length,
                     kv_cache_bytes=int(v.kv_cache_gb * 2**30), cuda_graphs=st.cuda and v.cuda_graphs)
    sleep = {0: "resident", 1: "asleep: offloaded to host memory", 2: "asleep: dropped"}[v.sleep]
    out = {"weights": Term("rollout", "vLLM weights (tensor_parallel_size=1)", n["weights"],
                           f"the whole policy per GPU, updated in place; outside rollouts {sleep}"),
           "kv": Term("rollout", "vLLM KV cache", n["kv"],
                      f"{seqs} sequences x {length} tokens" if not v.kv_cache_gb else f"rollout.vllm.kv_cache_gb={v.kv_cache_gb}"),
           "workspace": Term("activations", "vLLM decode workspace", n["workspace"],
                             "fp32 logits and softmax of the decoded rows, one layer's prefill chunk")}
    if n["graphs"]:
        out["graphs"] = Term("rollout", "vLLM CUDA graphs' pool", n["graphs"], "assumed; kept while asleep")
    if st.receiver_bytes and st.sketched_rows:
        out["precision"] = Term("rollout", "the receiver's precision state", s.n_proj * st.receiver_bytes,
                                "fp32 masters / Kahan compensations of the sketched weights, beside vLLM's")
    if not st.cuda:
        out["shadow"] = Term("rollout", "the engine's shadow copy (CPU build: weights reloaded)", s.total * b,
                             "the policy the payloads are replayed on")
    return out


def engine_reserve(st: Step, capacity: int) -> int:
    """The bytes vLLM is told it may use (gpu_memory_utilization x the GPU): rollout.vllm's, else what
    the engine needs as built while it samples (weights, KV, workspace, graphs), rounded up to 1 %."""
    v, t = st.vllm or VLLMConfig(), vllm_terms(st)
    fraction = v.gpu_memory_utilization or utilization(sum(t[k].nbytes for k in ("weights", "kv", "workspace", "graphs")
                                                           if k in t), capacity)
    return int(fraction * capacity)


def engine_needs(st: Step, max_model_len: int = 0) -> list[Term]:
    """What a colocated vLLM engine holds while it samples, as built (:func:`vllm_terms`), to compare
    with the share it is handed (:func:`engine_reserve`; the precision state and a CPU shadow lie
    outside vLLM's own allocations)."""
    return list(vllm_terms(st).values())
