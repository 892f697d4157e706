"""Tasks: arith generation (determinism, disjointness, knobs, exact references),
JSONL loading from fixture folders (errors name file and line), format_prompt."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.rl.tasks import (
    MATH500_TRAIN, TASKS, Problem, TaskConfig, arith_value, build_task, format_prompt, held_out,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def arith(**kw) -> TaskConfig:
    return TaskConfig(name="arith", **{"train_size": 300, "test_size": 100, **kw})


def operands_of(question: str) -> list[str]:
    return re.findall(r"\d+", question)


def test_registry_has_the_three_tasks():
    assert {"arith", "gsm8k", "math500"} <= set(TASKS)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        build_task(TaskConfig(name="nope"))


@pytest.mark.integration
def test_arith_is_deterministic_across_processes():
    task = build_task(arith(seed=3, ops="+-*", operands=3))
    code = (
        "from experiments.rl.tasks import *; "
        "t = build_task(TaskConfig(seed=3, ops='+-*', operands=3, train_size=300, test_size=100)); "
        "print(repr([(p.question, p.reference, p.uid) for p in t.train_split()[:20] + t.test_split()[:20]]))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    here = [(p.question, p.reference, p.uid) for p in task.train_split()[:20] + task.test_split()[:20]]
    assert out.strip() == repr(here)
    assert build_task(arith(seed=4, ops="+-*", operands=3)).test_split() != task.test_split()


@pytest.mark.parametrize("seed", [0, 1])
def test_arith_splits_disjoint_unique_and_sized(seed):
    # 2 operands of 1 digit, two ops: 9 * 9 * 2 = 162 problems; 150 + 10 nearly exhausts them
    task = build_task(arith(seed=seed, digits=1, ops="+-", train_size=150, test_size=10))
    train, test = task.train_split(), task.test_split()
    assert len(train) == 150 and len(test) == 10
    assert not {p.question for p in train} & {p.question for p in test}
    task = build_task(arith(seed=seed))
    train, test = task.train_split(), task.test_split()
    assert len(train) == 300 and len(test) == 100
    train_q, test_q = {p.question for p in train}, {p.question for p in test}
    assert len(train_q) == 300 and len(test_q) == 100 and not train_q & test_q
    assert len({p.uid for p in train + test}) == 400


def test_arith_test_split_independent_of_train_size():
    assert build_task(arith(train_size=10)).test_split() == build_task(arith(train_size=200)).test_split()


def test_held_out_order_follows_the_run_seed():
    test = build_task(arith()).test_split()
    orders = {seed: held_out(test, len(test), seed) for seed in range(3)}
    for seed, order in orders.items():
        assert sorted(p.uid for p in order) == sorted(p.uid for p in test)  # the same problems ...
        assert order == held_out(test, len(test), seed)  # ... in a reproducible order
    assert len({tuple(p.uid for p in o) for o in orders.values()}) == 3  # that differs between seeds
    assert all(o != test for o in orders.values())
    assert held_out(test, 10, 1) == orders[1][:10]  # a smaller size takes the head of the seed's order
    assert held_out(test, 10, 1) != held_out(test, 10, 2)
    assert held_out(test, 10**6, 0) == orders[0]  # a size past the split: all of it


def test_arith_too_small_space_raises():
    # 1 digit, 2 operands, one op: 9 * 9 = 81 distinct problems
    with pytest.raises(ValueError, match="only 81 distinct"):
        build_task(arith(digits=1, train_size=80, test_size=2))


@pytest.mark.parametrize("operands,digits,ops", [(2, 1, "+"), (2, 2, "-"), (3, 2, "+-"), (4, 3, "*"), (5, 1, "+-*")])
def test_arith_knobs_respected(operands, digits, ops):
    task = build_task(arith(operands=operands, digits=digits, ops=ops, train_size=50, test_size=20))
    for p in task.train_split() + task.test_split():
        nums = operands_of(p.question)
        assert len(nums) == operands
        assert all(len(n) == digits and n[0] != "0" for n in nums)
        used = re.findall(r" ([-+*]) ", p.question)
        assert len(used) == operands - 1 and set(used) <= set(ops)
        assert p.question.startswith("What is ") and p.question.endswith("?")


def test_arith_references_match_python_precedence():
    task = build_task(arith(operands=4, digits=2, ops="+-*", train_size=200, test_size=50))
    for p in task.train_split() + task.test_split():
        expr = p.question[len("What is "):-1]
        assert re.fullmatch(r"[\d +*-]+", expr)
        assert p.reference == str(eval(expr))  # trusted string built from digits and + - * only
    assert any(p.reference.startswith("-") for p in task.train_split())


def test_arith_value_hand_worked():
    assert arith_value([47, 18, 5], "+-") == 60
    assert arith_value([2, 3, 4], "+*") == 14  # 2 + 12
    assert arith_value([2, 3, 4, 5], "*-*") == -14  # 6 - 20
    assert arith_value([10, 3, 2], "--") == 5


@pytest.mark.parametrize("bad", [dict(ops="/"), dict(ops=""), dict(operands=1), dict(digits=0)])
def test_arith_rejects_bad_knobs(bad):
    with pytest.raises(ValueError):
        build_task(arith(**bad))


GSM_ROWS = [
    {"question": "Q0?", "answer": "2 + 2 = 4\n#### 4"},
    {"question": "Q1?", "answer": "Worked out.\n#### 1,234"},
]


def write_jsonl(path: Path, rows: list, blank_after: int = -1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    if blank_after >= 0:
        lines.insert(blank_after + 1, "   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", GSM_ROWS, blank_after=0)
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", GSM_ROWS[:1])
    rows = [{"problem": f"P{i}", "answer": f" \\frac{{{i}}}{{2}} ", "solution": "", "subject": "Algebra", "level": 1}
            for i in range(MATH500_TRAIN + 3)]
    write_jsonl(tmp_path / "math500" / "test.jsonl", rows)
    return tmp_path


def test_gsm8k_loads_fixture(data_dir):
    task = build_task(TaskConfig(name="gsm8k", data_dir=str(data_dir)))
    assert task.train_split() == [
        Problem("Q0?", "4", "gsm8k/train/0"),
        Problem("Q1?", "1234", "gsm8k/train/1"),  # blank line skipped, comma removed
    ]
    assert task.test_split() == [Problem("Q0?", "4", "gsm8k/test/0")]


def test_data_dir_from_env(data_dir, monkeypatch):
    monkeypatch.setenv("LOGRA_DATA_DIR", str(data_dir))
    assert build_task(TaskConfig(name="gsm8k")).test_split()[0].reference == "4"


def test_math500_first_400_train_last_test(data_dir):
    task = build_task(TaskConfig(name="math500", data_dir=str(data_dir)))
    train, test = task.train_split(), task.test_split()
    assert len(train) == MATH500_TRAIN and len(test) == 3
    assert train[0] == Problem("P0", "\\frac{0}{2}", "math500/test/0")
    assert test[0].uid == f"math500/test/{MATH500_TRAIN}"


@pytest.mark.parametrize("bad_line,message", [
    ('{"question": "Q", "answer": "#### 1"', "invalid JSON"),
    ('{"question": "Q"}', "'answer'"),
    ('{"question": "Q", "answer": "no marker 5"}', "####"),
    ('{"question": "Q", "answer": "#### "}', "empty"),
    ('[1, 2]', "JSON object"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    # line 1 good, line 2 blank, line 3 good, line 4 bad -> 1-based line 4
    path = write_jsonl(tmp_path / "gsm8k" / "train.jsonl", GSM_ROWS + [bad_line], blank_after=0)
    with pytest.raises(ValueError) as err:
        build_task(TaskConfig(name="gsm8k", data_dir=str(tmp_path))).train_split()
    assert f"{path}:4" in str(err.value) and message in str(err.value)


def test_missing_file_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "math500" / "test.jsonl"))):
        build_task(TaskConfig(name="math500", data_dir=str(tmp_path))).test_split()


SHARED = Path(os.environ.get("LOGRA_DATA_DIR", ROOT.parent / "shared" / "data"))
if not SHARED.is_absolute():
    SHARED = ROOT / SHARED


@pytest.mark.skipif(not (SHARED / "gsm8k" / "test.jsonl").is_file(), reason=f"no benchmark data at {SHARED}")
def test_real_data_shapes():
    gsm = build_task(TaskConfig(name="gsm8k", data_dir=str(SHARED)))
    assert len(gsm.test_split()) == 1319 and gsm.test_split()[0].reference == "18"
    assert all(re.fullmatch(r"-?[\d.]+", p.reference) for p in gsm.test_split())
    m = build_task(TaskConfig(name="math500", data_dir=str(SHARED)))
    assert len(m.train_split()) == 400 and len(m.test_split()) == 100


# --- prompts ----------------------------------------------------------------------------------

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_tokenizer(chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "What": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = chat_template
    return fast


PROBLEM = Problem("What is 2 + 3?", "5", "arith/test/0")


def test_format_prompt_uses_chat_template():
    prompt = format_prompt(tiny_tokenizer(CHAT), PROBLEM, "Put the final answer in \\boxed{}.")
    assert prompt == "<|user|>What is 2 + 3? Put the final answer in \\boxed{}.\n<|assistant|>"


@pytest.mark.parametrize("tokenizer", [None, "no-template"])
def test_format_prompt_without_template(tokenizer):
    tok = tiny_tokenizer(None) if tokenizer else None
    assert format_prompt(tok, PROBLEM, "Be brief.") == "What is 2 + 3? Be brief.\n"
    assert format_prompt(tok, PROBLEM, "") == "What is 2 + 3?\n"
