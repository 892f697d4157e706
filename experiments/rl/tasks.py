"""Math tasks for GRPO: problems with a verifiable final answer, picked by registry.

A task yields :class:`Problem` s (question text + reference answer) for a train and a
held-out split; the reward (``experiments.rl.rewards``) compares completions with the
reference, and :func:`format_prompt` turns a problem into the model's prompt.

* ``arith``: generated integer arithmetic, e.g. "What is 47 + 18 * 5?" — a knob-driven
  difficulty ladder (operands, digits, operators) on which a 135M model can learn.
* ``gsm8k``: GSM8K (Cobbe et al., 2021), reference = the number after ``####``.
* ``math500``: MATH-500 (Lightman et al., 2023), a 500-problem test set only. Here its
  first ``MATH500_TRAIN`` = 400 problems in file order are the train split and the last
  100 the test split (the file order is already shuffled across subjects and levels).
  uids keep the source row (``math500/test/<row>``) whichever split they fall in.

Data comes from ``cfg.data_dir``, else ``$LOGRA_DATA_DIR``, else the Hugging Face hub.
A local folder holds ``gsm8k/{train,test}.jsonl`` and ``math500/test.jsonl``.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

MATH500_TRAIN = 400  # MATH-500 rows (file order) used as the train split; the rest are test
ARITH_OPS = "+-*"  # operators the arith task can draw


@dataclass
class TaskConfig:
    name: str = "arith"  # registry key: arith | gsm8k | math500
    data_dir: Optional[str] = None  # JSONL folder; None -> $LOGRA_DATA_DIR, else the HF hub
    seed: int = 0  # seeds the generated arith splits
    operands: int = 2  # arith: numbers per problem
    digits: int = 2  # arith: digits per operand (2 -> 10..99, 1 -> 1..9)
    ops: str = "+"  # arith: operators drawn uniformly from these chars, any of "+-*"
    train_size: int = 5000  # arith: generated train problems
    test_size: int = 500  # arith: generated held-out problems (disjoint from train)
    instruction: str = "Put the final answer in \\boxed{}."  # appended to every question
    reward_timeout_s: float = 5.0  # hard wall-clock cap per answer verification
    reward_workers: int = 2  # verification processes


@dataclass(frozen=True)
class Problem:
    question: str  # problem text without instruction/template
    reference: str  # reference final answer (e.g. "57", "\\frac{1}{2}")
    uid: str  # stable id, e.g. "gsm8k/test/17"


TASKS: dict[str, type["Task"]] = {}


def register_task(name: str) -> Callable[[type["Task"]], type["Task"]]:
    """Class decorator: make a :class:`Task` subclass buildable as ``TaskConfig(name=name)``."""

    def deco(cls: type[Task]) -> type[Task]:
        if name in TASKS:
            raise ValueError(f"task {name!r} registered twice")
        cls.name = name
        TASKS[name] = cls
        return cls

    return deco


def build_task(cfg: TaskConfig) -> "Task":
    if cfg.name not in TASKS:
        raise ValueError(f"unknown task {cfg.name!r}; registered: {sorted(TASKS)}")
    return TASKS[cfg.name](cfg)


class Task:
    """A train and a held-out list of problems, loaded once and cached.

    Subclasses implement ``_load(split)`` for ``split`` in {"train", "test"}. The reward is
    math-verify against the reference (:class:`MathVerifyReward`); a task may override
    :meth:`reward_function` with its own verifier.
    """

    name: str = ""

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self._cache: dict[str, list[Problem]] = {}

    def _load(self, split: str) -> list[Problem]:
        raise NotImplementedError

    def _split(self, split: str) -> list[Problem]:
        if split not in self._cache:
            self._cache[split] = self._load(split)
        return list(self._cache[split])

    def train_split(self) -> list[Problem]:
        return self._split("train")

    def test_split(self) -> list[Problem]:
        return self._split("test")

    def reward_function(self):
        """``fn(completions, references) -> list[float]`` with ``fn.close()``; bounded time per answer."""
        from experiments.rl.rewards import MathVerifyReward

        return MathVerifyReward(timeout_s=self.cfg.reward_timeout_s, workers=self.cfg.reward_workers)


def format_prompt(tokenizer, problem: Problem, instruction: str) -> str:
    """The user turn ``question + " " + instruction`` in the tokenizer's chat template
    with the assistant header appended; plain ``"question instruction\\n"`` when the
    tokenizer (or ``None``) has no chat template."""
    content = f"{problem.question} {instruction}" if instruction else problem.question
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    return content + "\n"


def held_out(problems: list[Problem], size: int, seed: int) -> list[Problem]:
    """The problems one run evaluates: the first ``size`` of the held-out split in the order of a
    permutation drawn from ``Random(f"held_out/{seed}")`` (the run's seed). The split's content
    stays fixed by the task; its order, and so which problems a smaller ``size`` takes and how
    they fall into evaluation batches, changes with the seed like sampling and data order do."""
    order = list(problems)
    random.Random(f"held_out/{seed}").shuffle(order)
    return order[:size]


# --- arith ----------------------------------------------------------------------------


def arith_value(numbers: list[int], ops: str) -> int:
    """Exact value of ``n0 op0 n1 op1 ...`` with ``*`` binding tighter than ``+ -``."""
    terms, signs = [numbers[0]], [1]
    for op, x in zip(ops, numbers[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


@register_task("arith")
class Arith(Task):
    """Random ``operands``-term integer expressions; the test split is drawn first from
    ``Random(f"arith/test/{seed}")`` (so it does not depend on ``train_size``), the train
    split from ``Random(f"arith/train/{seed}")`` rejecting test questions and repeats.
    String seeds hash by SHA-512, so splits are identical in every process."""

    def __init__(self, cfg: TaskConfig):
        super().__init__(cfg)
        if not cfg.ops or set(cfg.ops) - set(ARITH_OPS):
            raise ValueError(f"arith ops must be a non-empty subset of {ARITH_OPS!r}, got {cfg.ops!r}")
        if cfg.operands < 2 or cfg.digits < 1:
            raise ValueError(f"arith needs operands >= 2 and digits >= 1, got {cfg.operands}, {cfg.digits}")
        self.lo, self.hi = 10 ** (cfg.digits - 1), 10**cfg.digits - 1
        space = (self.hi - self.lo + 1) ** cfg.operands * len(set(cfg.ops)) ** (cfg.operands - 1)
        if cfg.train_size + cfg.test_size > space:
            raise ValueError(
                f"arith has only {space} distinct problems for operands={cfg.operands}, digits={cfg.digits}, "
                f"ops={cfg.ops!r}; asked for {cfg.train_size} + {cfg.test_size}"
            )

    def _draw(self, split: str, n: int, exclude: set[str]) -> list[Problem]:
        rng, ops = random.Random(f"arith/{split}/{self.cfg.seed}"), sorted(set(self.cfg.ops))
        problems, seen = [], set(exclude)
        while len(problems) < n:
            numbers = [rng.randint(self.lo, self.hi) for _ in range(self.cfg.operands)]
            chosen = "".join(rng.choice(ops) for _ in range(self.cfg.operands - 1))
            expr = " ".join(f"{op} {x}" for op, x in zip(chosen, numbers[1:]))
            question = f"What is {numbers[0]} {expr}?"
            if question not in seen:
                seen.add(question)
                uid = f"arith/{split}/{len(problems)}"
                problems.append(Problem(question, str(arith_value(numbers, chosen)), uid))
        return problems

    def _load(self, split: str) -> list[Problem]:
        test = self._cache.get("test") or self._draw("test", self.cfg.test_size, set())
        if split == "test":
            return test
        return self._draw("train", self.cfg.train_size, {p.question for p in test})


# --- JSONL / hub datasets ---------------------------------------------------------------


def data_root(cfg: TaskConfig) -> Optional[Path]:
    """``cfg.data_dir``, else ``$LOGRA_DATA_DIR``, else None (= the hub). A relative path
    is taken from the current directory, else from the repo root (as CI sets it)."""
    raw = cfg.data_dir or os.environ.get("LOGRA_DATA_DIR")
    if not raw:
        return None
    path = Path(raw).expanduser()
    repo_path = Path(__file__).resolve().parents[2] / path
    return repo_path if not path.is_absolute() and not path.exists() and repo_path.exists() else path


def read_jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    """Yields ``("<path>:<line>", row)`` per non-blank line; bad JSON -> ValueError there."""
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def _field(row: dict, key: str) -> str:
    if not isinstance(row.get(key), str):
        raise ValueError(f"missing or non-string field {key!r}")
    return row[key]


class JsonlTask(Task):
    """A task backed by ``<data_root>/<folder>/<split>.jsonl`` or a hub dataset."""

    folder: str = ""  # sub-folder of the data root
    hub: tuple[str, ...] = ()  # datasets.load_dataset(*hub, split=...)

    def convert(self, row: dict, index: int, source_split: str) -> Problem:
        raise NotImplementedError

    def rows(self, source_split: str) -> list[Problem]:
        """All problems of a source split; a bad row raises ValueError naming where it is."""
        root = data_root(self.cfg)
        if root is not None:
            records: Iterator[tuple[str, dict]] = read_jsonl(root / self.folder / f"{source_split}.jsonl")
        else:
            import datasets  # only on this path: heavy, and needs the network

            ds = datasets.load_dataset(*self.hub, split=source_split)
            records = ((f"{'/'.join(self.hub)}[{source_split}] row {i}", r) for i, r in enumerate(ds))
        problems = []
        for where, row in records:
            try:
                problems.append(self.convert(row, len(problems), source_split))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        return problems


@register_task("gsm8k")
class GSM8K(JsonlTask):
    folder, hub = "gsm8k", ("openai/gsm8k", "main")

    def convert(self, row: dict, index: int, source_split: str) -> Problem:
        answer = _field(row, "answer")
        if "####" not in answer:
            raise ValueError("GSM8K answer has no '####' final-answer marker")
        reference = answer.rsplit("####", 1)[1].replace(",", "").strip()
        if not reference:
            raise ValueError("GSM8K answer is empty after '####'")
        return Problem(_field(row, "question"), reference, f"gsm8k/{source_split}/{index}")

    def _load(self, split: str) -> list[Problem]:
        return self.rows(split)


@register_task("math500")
class Math500(JsonlTask):
    folder, hub = "math500", ("HuggingFaceH4/MATH-500",)

    def convert(self, row: dict, index: int, source_split: str) -> Problem:
        return Problem(_field(row, "problem"), _field(row, "answer").strip(), f"math500/{source_split}/{index}")

    def _load(self, split: str) -> list[Problem]:
        problems = self.rows("test")
        return problems[:MATH500_TRAIN] if split == "train" else problems[MATH500_TRAIN:]
