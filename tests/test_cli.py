"""One command-line front: every ``python -m experiments.*`` tool reads key=value the same way."""

import importlib

import pytest

from experiments.common.cli import parse, parse_methods
from experiments.common.config import ConfigError

pytestmark = pytest.mark.unit

# (module, a near-miss of one of its keys, the key meant)
TOOLS = [
    ("experiments.train", "train.stpes=3", "train.steps"),
    ("experiments.launch", "sweeep=quick", "sweep"),
    ("experiments.plan", "gpuss=2", "gpus"),
    ("experiments.memory_table", "seqss=2", "seqs"),
    ("experiments.memory.step_bench", "micro_bach=2", "micro_batch"),
    ("experiments.memory.sync_bench", "repeatss=1", "repeats"),
    ("experiments.memory.allreduce_bench", "big_rnak=0", "big_rank"),
    ("experiments.memory.gpu_memory", "seq_lenn=8", "seq_len"),
    ("experiments.memory.kl_bench", "completion_lenn=8", "completion_len"),
    ("experiments.publish", "too=results/x", "to"),
    ("experiments.time_table", "repeatss=1", "repeats"),
    ("experiments.memory.kl_probe_study", "drawss=1", "draws"),
    ("experiments.memory.probe_weighting_study", "drawz=1", "draws"),
    ("experiments.memory.step_profile", "topp=3", "top"),
    ("experiments.weight_motion", "sampel=3", "sample"),
]


@pytest.mark.parametrize("module, typo, meant", TOOLS)
def test_every_tool_rejects_an_unknown_key_with_a_suggestion(module, typo, meant, capsys):
    main = importlib.import_module(module).main
    assert main(["bad.key=1"]) == 2
    assert "'bad.key'" in capsys.readouterr().err
    assert main([typo]) == 2
    err = capsys.readouterr().err
    assert f"'{typo.split('=')[0]}'" in err and f"did you mean '{meant}'" in err, err


@pytest.mark.parametrize("module", [t[0] for t in TOOLS])
def test_every_tool_lists_its_keys_with_defaults(module, capsys):
    main = importlib.import_module(module).main
    try:
        assert main(["--help"]) == 0
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.startswith("  ") and "=" in l.split()[0]]
    assert lines and all(len(l.split(None, 1)) == 2 for l in lines), out  # key=default, then its meaning


def test_bad_key_names_the_key(capsys):
    main = importlib.import_module("experiments.memory_table").main
    assert main(["bad.key=1"]) == 2
    assert "unknown key 'bad.key'" in capsys.readouterr().err


def test_a_method_with_overrides_is_spelled_one_way():
    specs = parse_methods("dense, logra:logra.embeddings=true logra.rank=32,lora:lora.targets=[q_proj,v_proj]")
    assert [s.label for s in specs] == ["dense", "logra:logra.embeddings=true logra.rank=32", "lora:lora.targets=[q_proj,v_proj]"]
    assert specs[1].run_overrides() == ["method=logra", "logra.embeddings=true", "logra.rank=32"]
    assert specs[2].overrides == ("lora.targets=[q_proj,v_proj]",)  # a comma inside brackets stays in its entry
    with pytest.raises(ConfigError, match="did you mean 'logra'"):
        parse_methods("dense,lgora", known=["dense", "logra", "galore"])
    with pytest.raises(ConfigError, match="expected <method>"):
        parse_methods("logra:rank")


def test_a_dotted_run_key_is_not_taken_for_a_tool_key_of_the_same_name():
    """memory_table has its own key ``model`` (the model name) and takes run-config overrides: the run key
    ``model.dtype=bfloat16`` goes to the run config, ``model=tiny-llama`` stays the tool's."""
    from experiments.config import run_keys
    from experiments.memory_table import MemoryTableArgs

    args, overrides, _ = parse(MemoryTableArgs, ["model=tiny-llama", "model.dtype=bfloat16", "steps=1"], run_keys=run_keys)
    assert args.model == "tiny-llama" and args.steps == 1 and overrides == ["model.dtype=bfloat16"]
