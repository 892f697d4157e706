"""Verifiable reward: is the completion's final answer equal to the reference?

    r(completion, reference) = 1.0 if math_verify.verify(parse(reference), parse(answer)) else 0.0

where ``answer`` is picked from the completion by this **matching policy**:

1. The last complete ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces matched by a
   linear scan; a truncated box (never closed) is ignored.
2. Else the text after the last GSM8K-style ``#### `` marker, up to the line end.
3. Else, leniently, the last ``TAIL_CHARS`` characters of the completion: math-verify
   takes the last expression there, the right-hand side of an equation
   ("12 + 7 = 9" -> 9) and phrases like "The answer is 19." This is for
   SmolLM2-135M-Instruct, which rarely boxes; the tail bounds the parsing cost.

The reference is parsed as ``$reference$`` unless already delimited (math-verify extracts only the first
number from an unwrapped "1,-2" or "(3, \\frac{\\pi}{2})"). Two guards against false
positives:

* **Numeric references need numeric answers.** When the reference is a plain number
  (arith, GSM8K, most MATH integers), an answer whose text is an unevaluated
  arithmetic expression ("47 + 18", "2^{10}") scores 0: math-verify would evaluate it
  and accept it, so a policy could earn reward by restating "What is 47 + 18?".
* Answers longer than ``MAX_ANSWER_CHARS`` score 0 without parsing.

math-verify is lenient by design: "1,234" equals 1234, "25\\%" equals 25 (both ways),
"\\dfrac" equals "\\frac", "0.5" equals "\\frac{1}{2}", and units in ``\\text{}`` are dropped.

Bounded time from any thread: math-verify's own timeouts use ``signal.alarm``, which
works only in a process's main thread, and a C-level big-integer power can ignore it
anyway. So :class:`MathVerifyReward` runs :func:`score` in worker processes (in their
main thread, with math-verify's soft timeouts of ``timeout_s / 2``) and the parent
enforces a hard wall-clock ``timeout_s`` per answer: a worker past it is killed and
replaced, and that answer scores 0.0. Workers are plain ``python -c`` subprocesses
rather than ``multiprocessing`` children, so they never re-import the trainer's
``__main__`` (torch, vLLM); they start lazily, are reused across calls, and die with
:meth:`close`, garbage collection, interpreter exit, or the parent (EOF on their pipe).
"""
from __future__ import annotations

import functools
import json
import logging
import re
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any, Optional

from math_verify import parse, verify
from math_verify.errors import TimeoutException

TAIL_CHARS = 300  # lenient mode: characters at the end of the completion that are parsed
MAX_ANSWER_CHARS = 1000  # longer extracted answers score 0 without parsing
STARTUP_TIMEOUT_S = 120.0  # a worker not ready by then is a broken environment, not a bad answer

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
_NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?|[-+]?\.\d+")
# a digit (or closing bracket) joined by an arithmetic operator to another operand
_COMPOUND = re.compile(r"[\d)}]\s*(?:[-+*×·÷^]|\\times|\\cdot|\\div)\s*[-({]?\s*\d")


def extract_answer(completion: str) -> Optional[str]:
    """The answer text math-verify should parse, by the module's matching policy; None if empty."""
    last_box = None
    stack: list[tuple[bool, int]] = []  # (opened by \boxed, content start) per open brace
    for m in _BOX_OPEN.finditer(completion):
        if m.group() == "}":
            if stack:
                boxed, start = stack.pop()
                if boxed:
                    last_box = completion[start:m.start()]
        else:
            stack.append((m.group() != "{", m.end()))
    if last_box is not None:
        return "\\boxed{" + last_box + "}" if last_box.strip() else None
    if "####" in completion:
        answer = completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        return answer or None
    tail = completion[-TAIL_CHARS:].strip()
    return tail or None


@functools.lru_cache(maxsize=4096)
def _parse_reference(reference: str, soft_timeout: Optional[int]) -> list:
    text = reference.strip()
    if not re.search(r"(?<!\\)\$|\\boxed", text):  # not yet delimited ("\$36" is a dollar sign)
        text = f"${text}$"
    return parse(text, parsing_timeout=soft_timeout)


def score(completion: str, reference: str, timeout_s: float = 5.0) -> float:
    """1.0 if ``completion``'s answer verifies against ``reference``, else 0.0; never raises.

    Pure and in-process: math-verify's soft timeouts (``timeout_s / 2``, at least 1 s,
    per parse and per comparison) apply only in a main thread; elsewhere they are off
    and only :class:`MathVerifyReward`'s hard timeout bounds the time.
    """
    soft = max(1, int(timeout_s / 2)) if threading.current_thread() is threading.main_thread() else None
    try:
        answer = extract_answer(completion)
        if answer is None or len(answer) > MAX_ANSWER_CHARS:
            return 0.0
        gold = _parse_reference(reference, soft)
        pred = parse(answer, parsing_timeout=soft)
        if not gold or not pred:
            return 0.0
        if _NUMBER.fullmatch(reference.strip()) and any(
            isinstance(p, str) and _COMPOUND.search(p) for p in pred
        ):
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=soft) else 0.0
    except (Exception, TimeoutException):
        return 0.0


# --- bounded-time worker pool -------------------------------------------------------

_BOOT = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from experiments.rl.rewards import _worker_loop; _worker_loop(sys.argv[2], int(sys.argv[3]))"
)
_READY = "ready"


def _worker_loop(fn_ref: str, fd: int) -> None:
    """Worker main: import ``module:function``, say ready, then answer ``args -> fn(*args)``."""
    import importlib
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warnings echo 100k-char inputs
    conn = Connection(fd)
    module, name = fn_ref.split(":")
    fn = getattr(importlib.import_module(module), name)
    conn.send(_READY)
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):  # parent closed the pipe or died
            return
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - report, keep serving
            result = e if isinstance(e, Exception) else RuntimeError(repr(e))
        try:
            conn.send(result)
        except OSError:  # parent gone
            return
        except Exception as e:  # noqa: BLE001 - the result did not pickle
            conn.send(RuntimeError(f"unpicklable result: {e!r}"))


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    started: float
    ready: bool = False


def _spawn(fn_ref: str) -> _Worker:
    parent, child = Pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", _BOOT, json.dumps(sys.path), fn_ref, str(child.fileno())],
        pass_fds=[child.fileno()], stdin=subprocess.DEVNULL,
    )
    child.close()
    return _Worker(proc, parent, time.monotonic())


def _kill(worker: _Worker) -> None:
    worker.conn.close()
    if worker.proc.poll() is None:
        worker.proc.kill()
    worker.proc.wait()


def _kill_all(workers: list[_Worker]) -> None:
    while workers:
        _kill(workers.pop())


class _Died:
    """Sentinel: the worker's pipe hit EOF (it crashed or was killed)."""


class BoundedPool:
    """Runs ``fn(*args)`` for many ``args`` in reusable worker processes, each call capped
    at ``timeout_s`` wall-clock seconds; a call past it gets ``default`` and its worker is
    killed and replaced. So does a call that raises or kills its worker.

    ``fn_ref`` is ``"module:function"``, importable from the parent's ``sys.path``.
    Thread-safe (calls are serialized); ``kills`` counts hard timeouts and crashes.
    """

    def __init__(self, fn_ref: str, timeout_s: float, workers: int = 2, default: Any = None):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.fn_ref, self.timeout_s, self.num_workers, self.default = fn_ref, timeout_s, workers, default
        self.kills = 0
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)  # GC and exit

    def map(self, calls: list[tuple]) -> list:
        """``[fn(*args) for args in calls]``, order preserved, ``default`` for failures."""
        with self._lock:
            while len(self._workers) < self.num_workers:
                self._workers.append(_spawn(self.fn_ref))
            return self._run(calls)

    def _run(self, calls: list[tuple]) -> list:
        results = [self.default] * len(calls)
        todo = deque(range(len(calls)))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (call index, deadline)
        while todo or busy:
            for k, w in enumerate(self._workers):
                if todo and w.ready and k not in busy:
                    i = todo.popleft()
                    try:
                        w.conn.send(calls[i])
                    except OSError:  # died while idle: retry the call on its replacement
                        todo.appendleft(i)
                        self._replace(k)
                        continue
                    busy[k] = (i, time.monotonic() + self.timeout_s)
            deadlines = [d for _, d in busy.values()] + [
                w.started + STARTUP_TIMEOUT_S for w in self._workers if not w.ready
            ]
            pending = [w.conn for k, w in enumerate(self._workers) if k in busy or not w.ready]
            readable = wait(pending, timeout=max(0.0, min(deadlines) - time.monotonic()))
            for k, w in enumerate(self._workers):
                if w.conn not in readable:
                    continue
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    msg = _Died
                if not w.ready:
                    if msg != _READY:
                        raise RuntimeError(f"reward worker for {self.fn_ref} died at startup; see its stderr")
                    w.ready = True
                    continue
                i, _ = busy.pop(k)
                if msg is _Died:
                    self._replace(k)
                elif not isinstance(msg, Exception):
                    results[i] = msg
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                if k in busy and now >= busy[k][1]:
                    busy.pop(k)
                    self._replace(k)
                elif not w.ready and now >= w.started + STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"reward worker for {self.fn_ref} not ready after {STARTUP_TIMEOUT_S} s")
        return results

    def _replace(self, k: int) -> None:
        self.kills += 1
        _kill(self._workers[k])
        self._workers[k] = _spawn(self.fn_ref)

    def close(self) -> None:
        """Kill all workers; a later :meth:`map` starts fresh ones."""
        with self._lock:
            _kill_all(self._workers)


class MathVerifyReward:
    """Batched, thread-safe, time-bounded :func:`score`: 1.0 per correct completion, else 0.0."""

    def __init__(self, timeout_s: float = 5.0, workers: int = 2):
        self.timeout_s = timeout_s
        self.pool = BoundedPool(f"{__name__}:score", timeout_s, workers, default=0.0)

    def __call__(self, completions: list[str], references: list[str]) -> list[float]:
        if len(completions) != len(references):
            raise ValueError(f"{len(completions)} completions but {len(references)} references")
        calls = [(str(c), str(r), self.timeout_s) for c, r in zip(completions, references)]
        return [float(v) for v in self.pool.map(calls)]

    @property
    def timeouts(self) -> int:
        """Answers that hit the hard timeout (or crashed a worker) so far."""
        return self.pool.kills

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "MathVerifyReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
