"""eval_outcomes.jsonl: what the trainer's run directory writes is what the analysis reads, and a
resumption drops the lines after its checkpoint's step (experiments/rl/run_dir.py, analysis/outcomes.py)."""

import pytest

from analysis import outcomes
from experiments.rl.run_dir import EVAL_OUTCOMES, RunDirectory

pytestmark = pytest.mark.unit


def test_written_outcomes_read_back_by_problem_id_and_truncate_on_resume(tmp_path):
    run = RunDirectory(tmp_path, cfg=None)
    assert outcomes.FILE == EVAL_OUTCOMES
    ids = ["arith/test/7", "arith/test/0", "arith/test/3"]
    run.append_eval_outcomes(0, ids, [False, False, True])
    run.append_eval_outcomes(2, ids, [True, False, True])
    run.append_eval_outcomes(4, ids, [True, True, True])
    assert outcomes.read_step(tmp_path, 2) == {"arith/test/7": 1, "arith/test/0": 0, "arith/test/3": 1}
    assert outcomes.read_step(tmp_path, 3) is None
    assert outcomes.final_outcomes("r", tmp_path, 0, 2, correct=2, problems=3).outcomes is not None
    assert "its metrics 1 of 3" in outcomes.final_outcomes("r", tmp_path, 0, 2, correct=1, problems=3).why_not

    run.truncate_after(2)  # resumed from the checkpoint of step 2: step 4 is redone
    assert outcomes.read_step(tmp_path, 4) is None and outcomes.read_step(tmp_path, 2) is not None
    run.append_eval_outcomes(4, ids, [False, True, True])
    assert outcomes.read_step(tmp_path, 4) == {"arith/test/7": 0, "arith/test/0": 1, "arith/test/3": 1}
    run.truncate_after(-1)  # restarted without a checkpoint: the step-0 evaluation is redone too
    assert (tmp_path / EVAL_OUTCOMES).read_text() == ""
    with pytest.raises(ValueError, match="2 problem ids but 1 outcomes"):
        run.append_eval_outcomes(0, ids[:2], [True])
