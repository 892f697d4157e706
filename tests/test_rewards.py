"""MathVerifyReward: hand-written verdicts, bounded time on pathological output, hard
kills of stuck workers, use from non-main threads, and cleanup of worker processes."""
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from experiments.rl.rewards import BoundedPool, MathVerifyReward, extract_answer, score

pytestmark = pytest.mark.integration  # math-verify runs in worker processes, with wall-clock bounds

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 2.0
SLACK_S = 3.0  # process replacement + scheduling on a loaded 2-core CI box


@pytest.fixture(scope="module")
def reward():
    with MathVerifyReward(timeout_s=TIMEOUT_S, workers=2) as r:
        yield r


CASES = [  # (completion, reference, expected reward)
    ("So the answer is \\boxed{57}.", "57", 1.0),
    ("So the answer is \\boxed{56}.", "57", 0.0),
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),  # nested braces inside the box
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{3}{4}}", "\\frac{2}{3}", 0.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{-5}", "-5", 1.0),
    ("\\boxed{5}", "-5", 0.0),
    ("The answer is -5.", "-5", 1.0),
    ("So in total she has 1,234 stamps.", "1234", 1.0),  # GSM8K thousands separator
    ("\\boxed{1,234}", "1234", 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72", "72", 1.0),
    ("#### 71", "72", 0.0),
    ("I am not sure how to solve this.", "19", 0.0),
    ("", "19", 0.0),
    ("\u2603\ud83d\ude00\x00\u202e\ud800 \u2211\u222b\u221a \u00bd \ufffd", "19", 0.0),  # garbage incl. a lone surrogate
    ("First \\boxed{3}, no wait: \\boxed{19}", "19", 1.0),  # last box wins
    ("First \\boxed{19}, no wait: \\boxed{3}", "19", 0.0),
    ("So \\boxed{19}. Then \\boxed{2", "19", 1.0),  # a truncated last box is ignored
    ("\\boxed{}", "19", 0.0),
    ("The answer is 19.", "19", 1.0),  # unboxed: lenient tail
    ("12 + 7 = 9", "19", 0.0),  # right-hand side is the answer
    ("47 + 18 = 65", "65", 1.0),
    ("The sum 47 + 18 is", "65", 0.0),  # restating the question earns nothing ...
    ("\\boxed{47+18}", "65", 0.0),  # ... boxed or not
    ("\\boxed{2^{10}}", "1024", 0.0),  # numeric reference wants a number literal
    ("\\boxed{25\\%}", "25", 1.0),  # math-verify: 25% == 25
    ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{(3, \\frac{\\pi}{3})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 0.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{1, -2}", "1,-2", 1.0),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", 1.0),
    ("$\\boxed{x = 5}$", "5", 1.0),
    ("\\fbox{19}", "19", 1.0),
    ("The cost is \\boxed{\\$18}.", "18", 1.0),
    ("The cost is \\boxed{36}.", "\\$36", 1.0),  # MATH reference with an escaped dollar sign
    ("\\boxed{\\$32,\\!348}", "\\$32,\\!348", 1.0),
]


@pytest.mark.parametrize("completion,reference,expected", CASES)
def test_hand_written_cases(reward, completion, reference, expected):
    assert reward([completion], [reference]) == [expected]


def test_batch_preserves_order(reward):
    completions, references, expected = zip(*CASES)
    assert reward(list(completions), list(references)) == list(expected)


@pytest.mark.unit  # string parsing only, in this process
@pytest.mark.parametrize("completion,expected", [
    ("a \\boxed{x^{2}} b", "\\boxed{x^{2}}"),
    ("\\boxed{\\boxed{1}}", "\\boxed{\\boxed{1}}"),  # the outer box closes last
    ("text\n#### 72\nmore", "72"),
    ("no markers " + "y" * 500, ("y" * 300)),
    ("   ", None),
])
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


PATHOLOGICAL = {
    "100k plain chars": "x" * 100_000,
    "100k unboxed sum": "1+" * 50_000 + "1",
    "100k boxed sum": "\\boxed{" + "1+" * 50_000 + "1}",
    "100k nested braces": "\\boxed{" + "{" * 50_000 + "19" + "}" * 50_000 + "}",
    "100k unclosed boxes": "\\boxed{" * 15_000,
    "nested braces under the length cap": "\\boxed{" + "{" * 400 + "19" + "}" * 400 + "}",
    "power tower boxed": "\\boxed{9^{9^{9^{9}}}}",
    "power tower plain": "so it is 9^9^9^9",
    "huge power": "\\boxed{10^{10^{10}}}",
    "deep exponent chain": "\\boxed{" + "x^" * 400 + "2}",
}


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
@pytest.mark.parametrize("reference", ["19", "\\pi"])
def test_pathological_output_is_bounded(reward, name, reference):
    t0 = time.monotonic()
    assert reward([PATHOLOGICAL[name]], [reference]) == [0.0]
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S


def test_long_output_with_answer_at_the_end(reward):
    t0 = time.monotonic()
    assert reward(["blah " * 20_000 + "so \\boxed{19}"], ["19"]) == [1.0]
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S


def test_reward_from_non_main_threads():
    results = {}

    def run(key, reward):  # the second thread also starts the workers from a thread
        results[key] = reward(["\\boxed{\\frac{1}{2}}", "12 + 7 = 9", "\\boxed{9^{9^{9^{9}}}}"], ["0.5", "19", "\\pi"])

    with MathVerifyReward(timeout_s=TIMEOUT_S) as shared:
        threads = [threading.Thread(target=run, args=(k, shared)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert results == {k: [1.0, 0.0, 0.0] for k in range(3)}


def test_score_in_process_off_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(score("\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]


def test_close_reuse_and_length_check():
    r = MathVerifyReward(timeout_s=TIMEOUT_S, workers=1)
    assert r(["\\boxed{1}"], ["1"]) == [1.0]
    r.close()
    assert r(["\\boxed{2}"], ["2"]) == [1.0]  # lazily restarted
    with pytest.raises(ValueError, match="2 completions but 1 references"):
        r(["a", "b"], ["1"])
    r.close()
    assert r([], []) == []


SHARED = Path(os.environ.get("LOGRA_DATA_DIR", ROOT.parent / "shared" / "data"))
SHARED = SHARED if SHARED.is_absolute() else ROOT / SHARED


@pytest.mark.skipif(not (SHARED / "math500" / "test.jsonl").is_file(), reason=f"no benchmark data at {SHARED}")
def test_every_math500_reference_verifies_against_itself(reward):
    from experiments.rl.tasks import TaskConfig, build_task

    task = build_task(TaskConfig(name="math500", data_dir=str(SHARED)))
    refs = [p.reference for p in task.train_split() + task.test_split()]
    scores = reward([f"The answer is $\\boxed{{{r}}}$." for r in refs], refs)
    assert [r for r, s in zip(refs, scores) if s != 1.0] == []


# --- the hard timeout, tested on functions that misbehave on purpose ------------------------

MISBEHAVING = """
import os, time
def slow(x):
    time.sleep(x)
    return x
def boom():
    raise ValueError("boom")
def die():
    os._exit(3)
"""


@pytest.fixture
def misbehaving(tmp_path, monkeypatch):
    (tmp_path / "misbehaving_fns.py").write_text(MISBEHAVING)
    monkeypatch.syspath_prepend(str(tmp_path))  # workers inherit the parent's sys.path
    return "misbehaving_fns"


def test_hard_timeout_kills_and_replaces(misbehaving):
    pool = BoundedPool(f"{misbehaving}:slow", timeout_s=1.0, workers=2, default=-1)
    try:
        assert pool.map([(0,)]) == [0]  # start the workers
        t0 = time.monotonic()
        assert pool.map([(0.1,), (60,), (0.2,), (60,), (0.3,)]) == [0.1, -1, 0.2, -1, 0.3]
        assert time.monotonic() - t0 < 2 * 1.0 + SLACK_S
        assert pool.kills == 2
        assert pool.map([(0.05,)] * 4) == [0.05] * 4  # replacements serve
    finally:
        pool.close()


@pytest.mark.parametrize("fn,kills", [("boom", 0), ("die", 3)])
def test_raising_or_dying_calls_get_default(misbehaving, fn, kills):
    pool = BoundedPool(f"{misbehaving}:{fn}", timeout_s=5.0, workers=1, default="dflt")
    try:
        assert pool.map([(), (), ()]) == ["dflt"] * 3
        assert pool.kills == kills
    finally:
        pool.close()


def test_workers_die_with_the_interpreter():
    code = textwrap.dedent("""
        from experiments.rl.rewards import MathVerifyReward
        r = MathVerifyReward(timeout_s=2, workers=2)
        assert r(["\\\\boxed{3}"], ["3"]) == [1.0]
        print(" ".join(str(w.proc.pid) for w in r.pool._workers))
    """)  # exits without close()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its reaper counts as dead
        return f.read().split(") ")[1][0] != "Z"
