"""Make the tiny random-weight Llama the real-engine tests serve, in DIR.

No model can be downloaded here, so the model is made on the spot: a two-layer Llama
with random weights (a fixed seed: the same weights every time) and a word-level
tokenizer built in this file, saved as a Hugging Face model directory that vLLM loads
like any other. Greedy decoding on it gives arbitrary but reproducible token ids.

    .venv-engines/bin/python scripts/engines/make_model.py .engines/model

Idempotent: a directory that already holds a complete model (the marker file written
last) is left as it is. Runs with the engines venv's python (torch, transformers,
tokenizers).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 512
MAX_POSITIONS = 2048
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
MARKER = "tiny-model.json"  # written last: its presence means the directory is complete
# What the model is, in the marker: a directory made by another version of this script
# (another shape) is made again.
SPEC = {
    "seed": SEED,
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention takes 32, 64, 80, ... only
    "max_position_embeddings": MAX_POSITIONS,
}


def words() -> list[str]:
    """The vocabulary: the specials, then two- and three-letter syllables (every id
    decodes to a word, so any generated id is printable)."""
    consonants = "bdfgklmnprstvz"
    vowels = "aeiou"
    syllables = [c + v for c in consonants for v in vowels]  # 70
    pool = syllables + [s + c for s in syllables for c in "nrs"]  # 280 more
    pool += [s + t for s in syllables[:20] for t in syllables[:20]]
    vocab = list(SPECIALS)
    for word in pool:
        if len(vocab) == VOCAB_SIZE:
            break
        vocab.append(word)
    assert len(vocab) == VOCAB_SIZE and len(set(vocab)) == VOCAB_SIZE
    return vocab


def save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(words())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )
    wrapped.save_pretrained(str(directory))


def save_model(directory: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=SPEC["hidden_size"],
        intermediate_size=SPEC["intermediate_size"],
        num_hidden_layers=SPEC["num_hidden_layers"],
        num_attention_heads=SPEC["num_attention_heads"],
        num_key_value_heads=SPEC["num_key_value_heads"],
        head_dim=SPEC["head_dim"],
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Larger logits than the default init's, so that greedy decoding does not sit on
    # one token: a spread of ids, still the same every time.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(str(directory), safe_serialization=True)


def complete(directory: Path) -> bool:
    marker = directory / MARKER
    try:
        return bool(json.loads(marker.read_text()) == SPEC)
    except (OSError, ValueError):
        return False


def make(directory: Path) -> bool:
    """Make the model in `directory` unless it is there already; whether it was made."""
    if complete(directory):
        return False
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_tokenizer(staging)
    save_model(staging)
    (staging / MARKER).write_text(json.dumps(SPEC, indent=1) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    made = make(args.directory.resolve())
    print(f"{'made' if made else 'kept'} {args.directory}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
