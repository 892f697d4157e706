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
