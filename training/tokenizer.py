"""The demo policy's byte-level BPE tokenizer, trained on expert episode texts."""

import re

from tokenizers import decoders
from tokenizers import models
from tokenizers import pre_tokenizers
from tokenizers import Regex
from tokenizers import Tokenizer
from tokenizers import trainers


def train_tokenizer(texts, vocab_size=768, whole_words=(), repeats=3000, phrases=()):
    """Byte-level BPE over whitespace-led words (' word'), so words tokenize independently.

    ``whole_words`` (e.g. every action word) are shown ``repeats`` times more, so that each
    becomes one token: an action then takes one decode step per field. ``phrases`` (e.g.
    ' red box') are kept whole by the pre-tokenizer wherever they stand as words, and
    learned as one token each the same way.
    """
    words = r' ?[^\s]+|\s'
    if phrases:   # tried first at each position; a phrase must end where a word ends
        longest_first = sorted(phrases, key=len, reverse=True)
        alternatives = '|'.join(re.escape(p.strip()) for p in longest_first)
        words = rf' ?(?:{alternatives})(?=[\s;,.]|$)|' + words
        whole_words = list(whole_words) + [p if p.startswith(' ') else ' ' + p
                                           for p in phrases]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(words), behavior='isolated'),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=['<|endoftext|>'], show_progress=False)
    texts = list(texts) + [''.join(whole_words)] * (repeats if whole_words else 0)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
