"""Write the GPU checks' model: random init of the qwen2.5-0.5b preset's shape in bf16, with the SmolLM2
tokenizer (scripts/gpu_check_fsdp2.sh, scripts/gpu_check_vllm.sh).

    python scripts/check_model.py OUT_DIR TOKENIZER_DIR
"""

import sys

import torch
import transformers

from experiments.memory.planner import load_model_config


def main(out: str, tok_dir: str) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    _, cfg = load_model_config("qwen2.5-0.5b")
    cfg = {k: v for k, v in cfg.items() if k not in ("source", "model_type")}
    cfg.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)).to(torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print("model", sum(p.numel() for p in model.parameters()) / 1e6, "M parameters ->", out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
