"""LoGRA as a drop-in optimizer for TRL's ``GRPOTrainer``.

``LoGRA(model, ...)`` is handed to the trainer through ``optimizers=(optimizer, None)``; TRL builds
its usual linear LR schedule around it and never sees a dense gradient for the sketched attention
and MLP projections (they get no ``.grad``; LoGRA updates them from their gradient sketches).

Run (CPU, a few seconds per step on the tiny random Llama)::

    PYTHONPATH=. .venv/bin/python examples/trl_grpo_logra.py --steps 2 --output-dir /tmp/trl-logra
    PYTHONPATH=. .venv/bin/python examples/trl_grpo_logra.py --model smollm2-135m-instruct --steps 5

Needs ``trl`` (``pip install -c constraints.txt "trl>=1.0"``, part of the ``dev`` extra).

Configuration choices (set in :func:`build_trainer`):

* checkpointing off — TRL turns gradient checkpointing on by default. LoGRA would cope (its sketch
  is rebuilt exactly when a checkpointed block is recomputed; reentrant and non-reentrant runs gave
  bit-identical weights), but on a tiny CPU model the recompute only costs time.
* ``bf16=False`` — TRL defaults to bf16 autocast; keep the CPU run in plain fp32.
* ``beta=0.0`` (TRL's default) — no reference model, so TRL never re-loads the model by name,
  which would fail for the registry names ``tiny-llama`` / ``smollm2-135m-instruct``.

Caveat: the Trainer's ``max_grad_norm`` clipping and its logged ``grad_norm`` see only the dense
parameters (embeddings, norms); the sketched projections have no ``.grad`` to clip or measure
(LoGRA's per-row second moment normalises their update instead).
"""

from __future__ import annotations

import argparse
from typing import Optional

from experiments.rl.models import ModelConfig, load_model
from logra_core.optimizer import LoGRA

PROMPTS = [
    "Name a colour.",
    "Say hello.",
    "Count to three.",
    "What is 2 + 2?",
    "Name an animal.",
    "Write one word.",
    "Give me a number.",
    "Say goodbye.",
]


def length_reward(completions, target_chars: int = 24, **kwargs) -> list[float]:
    """Toy reward: how close a completion's text length is to ``target_chars`` (1 = exact, toward 0 = far).

    Random completions differ in length, so the rewards of a group differ and the advantages are non-zero.
    """
    out = []
    for completion in completions:
        text = completion[-1]["content"] if isinstance(completion, list) else completion  # conversational or plain
        out.append(1.0 / (1.0 + abs(len(text) - target_chars) / target_chars))
    return out


def make_dataset(n: Optional[int] = None):
    from datasets import Dataset

    prompts = PROMPTS if n is None else [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})


def build_trainer(model_name: str = "tiny-llama", steps: int = 2, output_dir: str = "trl-grpo-logra",
                  rank: int = 16, lr: float = 1e-5, num_generations: int = 4, max_completion_length: int = 8,
                  seed: int = 0):
    """Return ``(trainer, optimizer)``: a TRL ``GRPOTrainer`` on ``model_name`` that steps with ``LoGRA``."""
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = load_model(ModelConfig(name=model_name))
    optimizer = LoGRA(model, rank=rank, lr=lr)
    # TRL defaults gradient_checkpointing to True; newer transformers renamed it activation_checkpointing
    # (the old name is then a deprecated alias), so switch off whichever this version has.
    no_checkpointing = {"gradient_checkpointing": False}
    if "activation_checkpointing" in GRPOConfig.__dataclass_fields__:
        no_checkpointing = {"activation_checkpointing": False}
    args = GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        learning_rate=lr,  # informational: the optimizer passed in carries its own lr
        per_device_train_batch_size=num_generations,  # one prompt × num_generations completions per step
        gradient_accumulation_steps=1,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        temperature=1.0,
        beta=0.0,  # no reference model
        use_cpu=True,
        bf16=False,
        fp16=False,
        **no_checkpointing,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        optimizers=(optimizer, None),
    )
    return trainer, optimizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="tiny-llama | smollm2-135m-instruct | hub name")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
    parser.add_argument("--output-dir", default="trl-grpo-logra")
    parser.add_argument("--rank", type=int, default=16, help="sketch rank (<= the smallest projection input width)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=8)
    a = parser.parse_args(argv)
    trainer, _ = build_trainer(a.model, a.steps, a.output_dir, a.rank, a.lr, a.num_generations,
                               a.max_completion_length)
    trainer.train()
    for entry in trainer.state.log_history:
        print(entry)
    return trainer


if __name__ == "__main__":
    main()
