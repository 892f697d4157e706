"""A toy task whose reward a random tiny model can earn (import it from ``tests.toy_task`` only)."""

from experiments.rl.tasks import Problem, Task, register_task


class _LengthParityReward:
    """1 if the completion has an even number of characters: a random model earns it half the time."""

    def __call__(self, completions, references):
        return [float(len(c) % 2 == 0) for c in completions]

    def close(self):
        pass


@register_task("toy")
class Toy(Task):
    def _load(self, split):
        n = 40 if split == "train" else 8
        return [Problem(f"Say something {i}.", "0", f"toy/{split}/{i}") for i in range(n)]

    def reward_function(self):
        return _LengthParityReward()


class _MarkedReward:
    """1 where the reference is "1", whatever the completion: every problem's outcome known in advance."""

    def __call__(self, completions, references):
        return [float(r == "1") for r in references]

    def close(self):
        pass


@register_task("toy_marked")
class ToyMarked(Toy):
    """The toy task whose problems with index ≡ 0 (mod 3) count as solved and the others not (a
    known outcome per problem, to check what is recorded where; no group has a reward spread, so
    nothing is trained)."""

    def _load(self, split):
        return [Problem(p.question, "1" if i % 3 == 0 else "0", p.uid) for i, p in enumerate(super()._load(split))]

    def reward_function(self):
        return _MarkedReward()
