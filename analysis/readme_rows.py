"""README's headline rows that come from measurement files (memory, planner, sync, cost); the rows
from training runs are in ``readme_runs.py``, the table around them in ``readme.py``.

Each builder reads committed files under ``<repo>/results`` and returns a :class:`Row`: the paper's
claim, what was measured, scale and caveats, the folders, and per input the code version that made
it (full sha). What each reads:

- memory: ``memory_table/memory.csv`` and ``memory_table_bf16/memory.csv`` (columns method, peak_bytes,
  planner_ratio, seq_len, git_sha; rows by ``MEMORY_ROWS``), ``memory_table/memory.json`` (settings.seqs);
- planner: ``PLANNER_CSV`` (columns ``PLANNER_COLUMNS``, rows ``PLANNER_ROWS``), its ``.txt`` beside it
  (the entries' ``gpus=``, ``sharding=``), the folder README's sha; ``gpu_check/gpu_memory.log``
  (``planner/measured`` of dense);
- sync: ``sync/sync_bench.txt`` (``step payload … = ratio`` per variant), its README's sha;
- cost: ``time_table/<folder>/time.csv`` + ``time.json`` of ``TIME_TABLES`` (median_s, x_dense, git_sha;
  per-repeat samples for the KL predictor's share).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from analysis import names, provenance

MIB = 2**20


@dataclass
class Row:
    """One row of README's headline table; ``versions``: what input -> the shas that made it."""

    claim: str
    measured: str
    scale: str
    folders: list[str]
    versions: dict[str, list[str]] = field(default_factory=dict)

    def mixed(self) -> bool:
        return len({s for shas in self.versions.values() for s in shas}) > 1


def _by_method(path: Path) -> pd.DataFrame:
    return pd.read_csv(path).set_index("method")


# role in the row -> (folder, the memory.csv row's method label)
MEMORY_ROWS = {"ref": ("memory_table", "dense"), "lg": ("memory_table", "logra"),
               "lg_emb": ("memory_table", "logra:logra.embeddings=true"),
               "ref_mixed": ("memory_table_bf16", "dense:dense.precision=mixed"),
               "lg_sr": ("memory_table_bf16", "logra:logra.master=stochastic"),
               "lg_sr_emb": ("memory_table_bf16", "logra:logra.master=stochastic logra.embeddings=true")}


def memory(repo: Path) -> Row:
    tables = {f: _by_method(repo / "results" / f / "memory.csv") for f in ("memory_table", "memory_table_bf16")}
    fp, bf = tables["memory_table"], tables["memory_table_bf16"]
    settings = json.loads((repo / "results/memory_table/memory.json").read_text())["settings"]
    p = {role: tables[folder].loc[label, "peak_bytes"] for role, (folder, label) in MEMORY_ROWS.items()}
    off = 100 * max(abs(1 - r) for r in pd.concat([fp["planner_ratio"], bf["planner_ratio"]]))
    return Row(
        "up to 45.7 % lower training memory than dense Adam",
        f"one GRPO step's peak: LoGRA **{p['lg'] / p['ref']:.2f}×** dense AdamW in fp32 ({p['lg'] / MIB:,.0f} vs "
        f"{p['ref'] / MIB:,.0f} MiB; {p['lg_emb'] / p['ref']:.2f}× with the embedding sketched); in bf16, LoGRA with "
        f"stochastic rounding and sketched embeddings **{p['lg_sr_emb'] / p['ref_mixed']:.2f}×** dense AdamW with "
        f"mixed precision ({p['lg_sr_emb'] / MIB:,.0f} vs {p['ref_mixed'] / MIB:,.0f} MiB), "
        f"{p['lg_sr'] / p['ref_mixed']:.2f}× without the embedding sketched",
        f"measured (live-tensor profiler; the planner within {off:.2f} % of every row), SmolLM2 on CPU, one step of "
        f"{settings['seqs']} × {int(fp['seq_len'].iloc[0])} tokens",
        ["memory_table", "memory_table_bf16"],
        {"fp32 table": provenance.versions(fp["git_sha"]), "bf16 table": provenance.versions(bf["git_sha"])})


PLANNER_CSV = "planner_bf16/gemma-2-27b.csv"  # one row per planned method (experiments.plan out=...)
PLANNER_COLUMNS = {"method": "method", "total_gib": "total", "fits": "fits", "capacity_gb": "capacity",
                   "weights_grads_optimizer_gib": "weights_grads_optimizer", "peak_phase": "peak_phase",
                   "engine_fits": "engine_fits", "engine_needs_gib": "engine_needs"}
FSDP2_MEMORY = "fsdp2_memory/memory.csv"  # per-phase planned / measured on 2 CPU ranks (experiments.memory.fsdp2_memory)
PLANNER_ROWS = {"ref": "dense", "lg": "logra:master=stochastic", "lg_lean": "logra:master=stochastic embeddings=true",
                "lg_fp32": "logra:master=fp32"}  # role -> method (lg: the paper profile's logra.master)


def planned_engine(text: str, model: str, method: str) -> dict:
    """The engine as built in one plan of a planner text file: its share, tensor_parallel_size, sleep level
    and whether it keeps a shadow copy (a term of its ``rollout engine as built`` line)."""
    block = re.search(rf"^{re.escape(f'{model} / {method}: ')}.*?(?=\n\n|\Z)", text, re.S | re.M).group(0)
    line = re.search(r"rollout engine as built: .*", block).group(0)
    return {"share": float(re.search(r"its share of ([\d.]+)", line).group(1)),
            "tp": re.search(r"tensor_parallel_size=(\d+)", line).group(1),
            "sleep": re.search(r"rollout\.vllm sleep=(\d)", block).group(1),
            "shadow": "a shadow copy" if "shadow copy" in line else "no shadow copy"}


def planner(repo: Path) -> Row:
    path = repo / "results" / PLANNER_CSV
    c = PLANNER_COLUMNS
    t = pd.read_csv(path).set_index(c["method"])
    r = {k: t.loc[v] for k, v in PLANNER_ROWS.items()}
    text = path.with_suffix(".txt").read_text()
    gpus, sharding = re.search(r"gpus=(\d+)", text).group(1), re.search(r"sharding=(\w+)", text).group(1)
    model = path.stem.replace("gemma-2", "Gemma-2").replace("-27b", "-27B")
    check = re.search(r"dense\s+measured\s+([\d.]+) GiB\s+planner\s+([\d.]+) GiB",
                      (repo / "results/gpu_check/gpu_memory.log").read_text())
    under = float(check.group(1)) / float(check.group(2))
    fits = lambda row: "fits" if str(row[c["fits"]]) == "True" else "does not fit"  # noqa: E731
    ratio = r["lg_lean"][c["weights_grads_optimizer_gib"]] / r["ref"][c["weights_grads_optimizer_gib"]]
    measured = pd.read_csv(repo / "results" / FSDP2_MEMORY)
    worst = float((measured["ratio"] - 1).abs().max())
    eng = planned_engine(text, path.stem, PLANNER_ROWS["lg"])
    gib = lambda row: f"{row[c['total_gib']]:.1f} GiB at its {row[c['peak_phase']]} phase, {fits(row)}"  # noqa: E731
    return Row(
        "a 27B model on one 8-GPU node where dense Adam runs out of memory",
        f"planned per GPU and per phase ({gpus} × {r['ref'][c['capacity_gb']]:.0f} GB, {sharding.upper()}, bf16, the paper "
        f"profile's colocated vLLM engine): {model} dense AdamW (mixed) {gib(r['ref'])}; LoGRA (stochastic rounding, the "
        f"paper profile's) {gib(r['lg'])}, {r['lg_lean'][c['total_gib']]:.1f} GiB with embeddings sketched, "
        f"{r['lg_fp32'][c['total_gib']]:.1f} GiB with fp32 masters ({fits(r['lg_fp32'])}); weights + grads + optimizer "
        f"{ratio:.2f}× dense's at each one's peak; the rollout engine as built (tensor_parallel_size={eng['tp']}, "
        f"{eng['shadow']}, sleep level {eng['sleep']}) {r['lg'][c['engine_needs_gib']]:.1f} GiB in its {eng['share']:.1f} "
        f"GiB share: " + ("fits" if str(r["lg"][c["engine_fits"]]) == "True" else "does not fit"),
        f"a prediction from shapes, not a run; its phases checked on 2 CPU ranks (fsdp2, fp32) within "
        f"{100 * worst:.0f} % of the measured peaks; one CUDA check found an earlier planner {under:.1f}× under a 0.5B "
        "model's measured peak (dense)",
        ["planner", "planner_bf16", "fsdp2_memory", "gpu_check"],
        {"planner": [provenance.folder_sha(path.parent)], "CPU check": [provenance.folder_sha(repo / "results/fsdp2_memory")],
         "CUDA check": [provenance.folder_sha(repo / "results/gpu_check")]})


SYNC_ROWS = ("logra", "logra logra.embeddings=true")  # sync_bench.txt's labels: plain, sketched embeddings


def sync(repo: Path) -> Row:
    text = (repo / "results/sync/sync_bench.txt").read_text()
    found = dict(re.findall(r"^\s+(logra[^(]*?) \(rank \d+\): step payload .*? = ([\d.]+)", text, flags=re.M))
    rank = re.search(r"\(rank (\d+)\)", text).group(1)
    plain, emb = (float(found[label]) for label in SYNC_ROWS)
    return Row("(method) low-rank trainer → engine weight sync",
               f"bytes per step {plain:.3f} of a full sync ({emb:.3f} with the embedding sketched); the engine's copy "
               "checksummed equal to the trainer's after each sync",
               f"SmolLM2, rank {rank}", ["sync"], {"sync bench": [provenance.folder_sha(repo / "results/sync")]})


TIME_TABLES = {"4 × 4": ".", "8 × 8": "step_8x8_c19ea52", "16 × 8": "kl_cost_16x8", "generation": "rollout_only"}
# time.csv's method labels: the reference, LoGRA with and without step control, LoGRA in the generation-only table
REFERENCE, CONTROL, NO_CONTROL = "dense", "logra:step_control.enabled=true", "logra:step_control.enabled=false"
GENERATION = "logra"


def _time(repo: Path, folder: str) -> tuple[pd.DataFrame, dict]:
    where = repo / "results/time_table" / folder
    return pd.read_csv(where / "time.csv").set_index(["method", "phase"]), json.loads((where / "time.json").read_text())


def _kl_share(meta: dict, method: str = CONTROL) -> list[float]:
    """kl_predict / step of each repeat, in %."""
    return [100 * s["kl_predict"] / s["step"] for s in meta["samples"][method]]


def _sequences(meta: dict) -> int:
    """Sequences per step of a time table: its last ``train.prompts_per_step`` × ``train.group_size``."""
    found = dict(o.split("=", 1) for o in meta["settings"]["overrides"] if "=" in o)
    return int(found["train.prompts_per_step"]) * int(found["train.group_size"])


def cost(repo: Path) -> Row:
    t = {k: _time(repo, f) for k, f in TIME_TABLES.items()}
    med = lambda k, m, p: t[k][0].loc[(m, p), "median_s"]  # noqa: E731
    update = lambda k, m: (med(k, m, "fwd_bwd") + med(k, m, "optimizer")) / (  # noqa: E731
        med(k, REFERENCE, "fwd_bwd") + med(k, REFERENCE, "optimizer"))
    share = {k: _kl_share(t[k][1]) for k in ("4 × 4", "8 × 8", "16 × 8")}
    rounds = len(t["generation"][1]["samples"][GENERATION])
    rows = _sequences(t["4 × 4"][1])
    floor = min(rows, int(names.defaults(GENERATION)["step_control.probe_min"]))
    versions = {f"{k} table ({'results/time_table/' + TIME_TABLES[k] if TIME_TABLES[k] != '.' else 'results/time_table'})":
                [provenance.shown(t[k][1]["git_sha"])] for k in TIME_TABLES}
    return Row(
        "(cost) a LoGRA step",
        f"whole GRPO step {t['4 × 4'][0].loc[(CONTROL, 'step'), 'x_dense']:.2f}× dense AdamW's with step control, "
        f"{t['4 × 4'][0].loc[(NO_CONTROL, 'step'), 'x_dense']:.2f}× without (4 × 4); forward/backward + optimizer "
        f"{update('4 × 4', CONTROL):.2f}× ({update('8 × 8', CONTROL):.2f}× at 8 × 8); generation "
        f"{t['generation'][0].loc[(GENERATION, 'rollout'), 'x_dense']:.3f}× ({rounds} rounds); at 8 × 8 sequences "
        f"{t['8 × 8'][0].loc[(CONTROL, 'step'), 'x_dense']:.2f}× with control, its KL predictor "
        f"{statistics.median(share['8 × 8']):.1f} % of the step ({min(share['8 × 8']):.1f}–{max(share['8 × 8']):.1f} % "
        f"over {len(share['8 × 8'])} repeats), {statistics.median(share['16 × 8']):.1f} % at 16 × 8, "
        f"{statistics.median(share['4 × 4']):.1f} % at 4 × 4 (the probe floor reads {floor} of its {rows} rows)",
        "2 CPU cores, SmolLM2, prompts × samples per step: quick (4 × 4), arith_compare's (8 × 8) and 16 × 8; medians "
        "over repeats, methods interleaved in one process",
        ["time_table"], versions)
