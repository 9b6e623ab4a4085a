"""A small byte-level BPE tokenizer written at test time (nothing downloaded), for serving the
tiny random models of the engine tests with text prompts through ``vllm serve``.

Byte-level, so that every string encodes and every token id decodes (a random model emits any
id of its vocabulary, and vLLM detokenizes each one). Its vocabulary is exactly the model's
(1024 ids): three special tokens, the 256 bytes, and merges of pairs of common characters up to
the size, so that ordinary text makes fewer tokens than characters, as a real tokenizer does.
"""

from __future__ import annotations

import string
from itertools import product
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: LlamaConfig's default bos 1 and eos 2

#: A plain chat template (vLLM's chat completions need one): each message on its own line.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def write_tiny_tokenizer(directory: Path, *, vocab_size: int = 1024) -> Path:
    """Save a byte-level BPE tokenizer of ``vocab_size`` ids into ``directory`` (the files
    ``AutoTokenizer.from_pretrained`` reads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    as_byte_level = {c: _byte_level(c) for c in " " + string.ascii_letters + string.digits + ".,"}
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(byte_chars):
        vocab[char] = len(vocab)
    merges: list[tuple[str, str]] = []
    for left, right in product(as_byte_level.values(), repeat=2):
        if len(vocab) == vocab_size:
            break
        merges.append((left, right))
        vocab[left + right] = len(vocab)
    assert len(vocab) == vocab_size, len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return directory


def _byte_level(char: str) -> str:
    """``char`` (ASCII) as the byte-level alphabet writes it (a space is ``Ġ``)."""
    from tokenizers import pre_tokenizers

    ((piece, _),) = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(char)
    return piece
