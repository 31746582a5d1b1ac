"""A tiny M3-style tokenizer and chat template, trained on the spot, for synthetic checkpoints.

Same machinery as the real one (byte-level BPE, o200k-style pre-tokenizer regex, the M3 special tokens at the
top of the id range, `]~!b[` emitted once by the chat template rather than by the tokenizer), at a vocabulary
size a tiny config can hold. Trained on Python standard-library sources (always on the machine) so no download
is needed; the result is deterministic for a given Python installation.
"""

from __future__ import annotations

import dataclasses
import json
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

BOS = "]~!b["  # once at the start of a conversation
ROLE = "]~b]"  # starts a turn: ]~b]{role}\n
EOT = "[e~["  # ends a turn; the EOS
PAD = "]!p~["
THINK, END_THINK = "<mm:think>", "</mm:think>"
# A subset of the released added tokens, in the released relative order (ids 200000.. there, V-11.. here).
SPECIAL_TOKENS = (PAD, ROLE, EOT, "]!d~[", BOS, "<think>", "</think>", "<tool_call>", "</tool_call>", THINK,
                  END_THINK)

# The o200k pre-tokenizer split (as in the released tokenizer.json); ByteLevel then maps bytes to symbols.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS
          + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Stable, prose-heavy modules present in every CPython install.
_CORPUS_FILES = ("textwrap.py", "string.py", "difflib.py", "argparse.py", "json/__init__.py", "calendar.py")
_CORPUS_EXTRA = ("system\nuser\nai\ntool\nYou are a helpful assistant.\nHello! How can I help you today?\n"
                 "The quick brown fox jumps over the lazy dog. 0123456789\n")

# M3-style: BOS once, `]~b]{role}\n{content}[e~[\n` per turn, assistant spelled `ai`, generation prompt
# `]~b]ai\n`. (The released template also renders tools, thinking modes and media; tiny tests need none.)
CHAT_TEMPLATE = """{#- Tiny MiniMax-M3-style chat template. -#}
{{- ']~!b[' -}}
{%- for message in messages -%}
{%- set role = 'ai' if message['role'] == 'assistant' else message['role'] -%}
{%- if message['content'] is none -%}
{%- set content = '' -%}
{%- elif message['content'] is string -%}
{%- set content = message['content'] -%}
{%- else -%}
{%- set content = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')
                   | join('') -%}
{%- endif -%}
{{- ']~b]' ~ role ~ '\\n' ~ content ~ '[e~[\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- ']~b]ai\\n' -}}
{%- endif -%}
"""


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    bos: int
    eos: int
    pad: int


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [_CORPUS_EXTRA]
    for name in _CORPUS_FILES:
        path = stdlib / name
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def train_tokenizer(vocab_size: int, texts: Sequence[str] | None = None) -> Tokenizer:
    """Byte-level BPE with exactly `vocab_size` ids, the M3 special tokens being the last ones.

    Trained on `texts` when given (a model trained on a corpus wants its tokenizer fitted to it), else on the
    fixed small stdlib selection above."""
    n_special = len(SPECIAL_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + n_special:
        raise ValueError(f"vocab_size {vocab_size} is below the {len(alphabet)} byte symbols + {n_special} "
                         "special tokens a byte-level tokenizer needs")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_special, initial_alphabet=alphabet,
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(_corpus() if texts is None else list(texts), trainer)
    # A corpus too small for the requested merges leaves a gap; reserved tokens keep the specials at the top.
    gap = vocab_size - n_special - tok.get_vocab_size()
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(gap)] + list(SPECIAL_TOKENS))
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_tokenizer_files(out_dir: Path, vocab_size: int, model_max_length: int,
                          texts: Sequence[str] | None = None) -> SpecialIds:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and chat_template.jinja (the tokenizer
    trained on `texts`, default the fixed small corpus)."""
    tok = train_tokenizer(vocab_size, texts)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # The chat template writes BOS itself; a tokenizer-added one would double it.
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOT,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    special_map = {"bos_token": BOS, "eos_token": EOT, "pad_token": PAD,
                   "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (BOS, EOT, PAD)]}
    _write_json(out_dir / "special_tokens_map.json", special_map)
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return SpecialIds(bos=ids[BOS], eos=ids[EOT], pad=ids[PAD])
