"""Build a draft that never agrees with anything: a randomly initialised small Qwen2 model that shares the default
pair's tokenizer, saved as a Hugging Face directory (safetensors). Used to check that a useless draft costs nothing
under `-k auto` (docs/BENCHMARKS.md):

    python scripts/make_random_draft.py /tmp/random-draft
    specdecode bench --draft /tmp/random-draft -k auto --methods specdecode-plain,specdecode ...

Nothing is downloaded: the tokenizer comes from the built-in target's GGUF (prepared like every built-in model).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from specdecode.models.prepare import prepare_gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory to write the model to")
    parser.add_argument("--like", default="qwen2.5-coder-1.5b-instruct", help="built-in model whose tokenizer to use")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    _, tokenizer_dir = prepare_gguf(args.like)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(args.seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32768, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"random draft ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, vocabulary "
          f"{config.vocab_size}) written to {args.out}")


if __name__ == "__main__":
    main()
