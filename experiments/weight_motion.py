"""How far a run's weights moved, counted in the spacing of their dtype: what bf16 rounding kept.

    python -m experiments.weight_motion runs=runs/bf16/runs/dense-arith-s0-447c092d,runs/bf16/runs/logra-... \
        [out=results/bf16/weight_motion.csv] [sample=1000000]

For each run directory: the model as the run started (its config's model, loaded again: runs start
from the pretrained weights) against the newest checkpoint's ``model.safetensors``. Reported per run,
over every floating-point weight and over the 2-D projections alone (``*_proj.weight``):

- ``changed``: the fraction of elements whose stored value differs from the start. In bf16 an element
  changes only once its accumulated update passes half the spacing of its value (spacing 2^(e-7) for
  |w| in [2^e, 2^(e+1))); in fp32 every element with a non-zero update changes.
- ``moved_ulp_p50``/``p90``: where the checkpoint keeps fp32 master weights (``master_weights`` in
  ``method.pt``: the baselines' ``precision=mixed``), the master's distance from the start in units of
  that spacing — how much motion the bf16 copy the forward uses has not (yet) seen. Median and 90th
  percentile over a uniform sample of ``sample`` elements.

Writes a CSV (with the command and git sha in ``<out>.json``) and prints one line per run.
docs/precision.md ("What bf16 rounding does to a 30-step run") reads these numbers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class WeightMotionArgs:
    runs: str = ""  # run directories, comma-separated (each with config.yaml and a checkpoint)
    out: str = ""  # CSV path (and a .json beside it); empty: print only
    sample: int = 1_000_000  # elements sampled for the master-movement quantiles


def spacing(w: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing (ulp) at each value of ``w``: 2^(e-7) for |w| in [2^e, 2^(e+1)); zeros get the
    spacing of the smallest normal bf16 number."""
    e = torch.floor(torch.log2(w.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)))
    return torch.pow(2.0, e - 7)


def motion(start: dict[str, torch.Tensor], end: dict[str, torch.Tensor], masters: dict[str, torch.Tensor] | None = None,
           sample: int = 1_000_000, seed: int = 0) -> dict[str, float]:
    """The ``changed`` fractions (all weights, projections) and, given fp32 ``masters``, the masters'
    movement from ``start`` in units of the bf16 spacing (p50, p90) — see the module docstring."""
    changed = total = proj_changed = proj_total = 0
    for name, w in end.items():
        if name not in start or not w.is_floating_point():
            continue
        diff = int((w != start[name].to(w.dtype)).sum())
        changed, total = changed + diff, total + w.numel()
        if name.endswith("_proj.weight"):
            proj_changed, proj_total = proj_changed + diff, proj_total + w.numel()
    row = {"elements": total, "changed": changed / max(total, 1), "proj_changed": proj_changed / max(proj_total, 1)}
    if masters:
        ratios = torch.cat([((m.float() - start[n].float()).abs() / spacing(start[n])).flatten()
                            for n, m in masters.items() if n in start])
        g = torch.Generator().manual_seed(seed)
        pick = ratios[torch.randint(ratios.numel(), (min(sample, ratios.numel()),), generator=g)]
        p50, p90 = torch.quantile(pick, torch.tensor([0.5, 0.9])).tolist()
        row.update({"moved_ulp_p50": p50, "moved_ulp_p90": p90, "moved_half_ulp": float((ratios > 0.5).float().mean())})
    return row


def run_motion(run_dir: Path, sample: int) -> dict:
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from experiments.rl.checkpoint import list_checkpoints
    from experiments.rl.models import ModelConfig, load_model

    run_dir = Path(run_dir)
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise SystemExit(f"{run_dir}: no complete checkpoint (checkpoints/step_*/manifest.json)")
    last = checkpoints[-1]
    saved = OmegaConf.load(run_dir / "config.yaml").model  # what the start weights depend on
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved))
    model, _ = load_model(model_cfg)
    start = {k: v.detach() for k, v in model.state_dict().items()}
    end = load_file(str(last / "model.safetensors"))
    state = torch.load(last / "method.pt", map_location="cpu", weights_only=False) if (last / "method.pt").exists() else {}
    masters = state.get("master_weights") if isinstance(state, dict) else None
    return {"run": run_dir.name, "dtype": model_cfg.dtype, "step": int(last.name.split("_")[-1]),
            **motion(start, end, masters, sample)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from experiments.common.cli import fail, parse
    from experiments.common.config import ConfigError
    from experiments.common.provenance import git_sha, write_results

    try:
        args, _, _ = parse(WeightMotionArgs, argv, doc=__doc__)
    except ConfigError as e:
        return fail(e, "experiments.weight_motion")
    runs = [Path(r) for r in str(args.runs).split(",") if r.strip()]
    if not runs:
        return fail(ConfigError("runs=<run dir>[,<run dir>...] is required"), "experiments.weight_motion")
    rows = []
    for run in runs:
        row = run_motion(run, int(args.sample))
        rows.append(row)
        extra = (f", fp32 master moved {row['moved_ulp_p50']:.3f} / {row['moved_ulp_p90']:.3f} bf16 spacings (p50/p90), "
                 f"{row['moved_half_ulp']:.3f} past half a spacing" if "moved_ulp_p50" in row else "")
        print(f"{row['run']} ({row['dtype']}, step {row['step']}): {row['changed']:.4f} of {row['elements']:,} "
              f"elements changed ({row['proj_changed']:.4f} of the projections){extra}", flush=True)
    if args.out:
        out = Path(args.out)
        columns = ["run", "dtype", "step", "elements", "changed", "proj_changed", "moved_ulp_p50", "moved_ulp_p90", "moved_half_ulp"]
        write_results(out.parent, out.stem, rows, {"command": "python -m experiments.weight_motion " + " ".join(argv),
                                                   "git_sha": git_sha(), "rows": rows}, columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
