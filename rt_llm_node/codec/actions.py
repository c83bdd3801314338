"""Text to actions: grammars whose every decodable token sequence parses to a valid action.

Each field's permitted values, formatted at fixed width, are tokenized with the model's
tokenizer into a token trie at configure, so constrained decoding can only produce a
parsable action. Parsed values are clamped to the configured limits and are never NaN. A
field named ``_...`` is a plan field: decoded and recorded, never published.
"""

from dataclasses import dataclass
from dataclasses import field
import math
from typing import Optional

import numpy as np

from rt_llm_node.codec.observations import _sanitize


class GrammarError(ValueError):
    """An action schema cannot be expressed with this tokenizer, or is invalid."""


# How a field's values are written. ``digits``: the number (readable, and what a model that
# reads numbers in its inputs can copy; with a tokenizer that splits digits, a token a digit);
# ``compact``: one letter word per value (' a'..' Z' are one token each in the vocabularies of
# pretrained models), so an action costs one chosen token a field up to 52 values a field.
SPELLINGS = ('digits', 'compact')
_ALPHABET = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'


def _letters(index, count):
    """Return fixed-width letters of ``index`` among ``count`` values (base 52)."""
    width = 1
    while len(_ALPHABET) ** width < count:
        width += 1
    out = ''
    for _ in range(width):
        index, digit = divmod(index, len(_ALPHABET))
        out = _ALPHABET[digit] + out
    return out


# -- action grammar ---------------------------------------------------------------------
class TokenTrie:
    """Token-id sequences of a finite set of strings, with the value each one spells."""

    def __init__(self):
        self.children = {}
        self.value = None
        self.terminal = False
        self._allowed = None

    def insert(self, ids, value):
        node = self
        for token in ids:
            node = node.children.setdefault(int(token), TokenTrie())
        if node.terminal and node.value != value:
            raise GrammarError(f'two values tokenize identically: {node.value!r}, {value!r}')
        if node.children:
            raise GrammarError(f'{value!r} is a token prefix of another value')
        node.terminal, node.value = True, value

    def shortest(self):
        """Fewest tokens from here to a complete value (cached)."""
        if not hasattr(self, '_shortest'):
            self._shortest = 0 if self.terminal else 1 + min(
                c.shortest() for c in self.children.values())
        return self._shortest

    def fewest_choices(self):
        """Fewest chosen (not forced) tokens from here to a complete value (cached)."""
        if not hasattr(self, '_choices'):
            self._choices = 0 if self.terminal else (len(self.children) > 1) + min(
                c.fewest_choices() for c in self.children.values())
        return self._choices

    def allowed(self):
        """Sorted int64 array of the tokens that may follow here (cached)."""
        if self._allowed is None:
            self._allowed = np.array(sorted(self.children), dtype=np.int64)
        return self._allowed


def _steps(minimum, maximum, step):
    count = int(round((maximum - minimum) / step)) + 1
    if count < 1 or count > 4096 or not math.isclose(minimum + (count - 1) * step, maximum,
                                                     rel_tol=0, abs_tol=step * 1e-6):
        raise GrammarError(f'range [{minimum}, {maximum}] is not a whole number of {step} steps')
    return [minimum + i * step for i in range(count)]


@dataclass
class ActionField:
    """One numeric action field: which message field, limits, quantization, and its text key."""

    name: str            # message field, e.g. 'linear.x' or a joint name
    key: str             # text key, e.g. 'v'
    minimum: float
    maximum: float
    step: float
    spelling: str = 'digits'   # SPELLINGS

    def __post_init__(self):
        for what in ('minimum', 'maximum', 'step'):
            if not math.isfinite(getattr(self, what)):
                raise GrammarError(f'action field {self.name}: {what} must be finite')
        if self.step <= 0 or self.maximum < self.minimum:
            raise GrammarError(f'action field {self.name}: need step > 0 and max >= min')
        if self.spelling not in SPELLINGS:
            raise GrammarError(f'action spelling {self.spelling!r} is not one of {SPELLINGS}')
        self.values = _steps(self.minimum, self.maximum, self.step)
        decimals = next(d for d in range(7)
                        if abs(self.step * 10 ** d - round(self.step * 10 ** d)) < 1e-6)
        self.decimals = decimals
        width = max(len(f'{abs(v):.{decimals}f}') for v in self.values)
        self.width = width

    def text(self, value):
        """Text of one quantized value, never a prefix of another's.

        ``digits``: the number at fixed width, e.g. 'v+0.40'; ``compact``: the key and the
        value's letter, in increasing order (a..z, A..Z, then two letters), e.g. 'v g'.
        """
        if self.spelling == 'compact':
            return f'{self.key} {_letters(self._index(value), len(self.values))}'
        return f'{self.key}{"-" if value < 0 else "+"}{abs(value):0{self.width}.{self.decimals}f}'

    def _index(self, value):
        return int(round((value - self.minimum) / self.step))

    def value_of(self, word):
        """Return the value ``word`` spells (one field's text, e.g. 'v+0.40' or 'v g')."""
        if self.spelling == 'compact':
            key, _, letters = word.partition(' ')
            if key == self.key:
                for i, v in enumerate(self.values):
                    if _letters(i, len(self.values)) == letters:
                        return v
            raise GrammarError(f'expected field {self.key!r}, got {word!r}')
        if not word.startswith(self.key):
            raise GrammarError(f'expected field {self.key!r}, got {word!r}')
        try:
            return self.quantize(float(word[len(self.key):]))
        except ValueError:
            raise GrammarError(f'bad number in {word!r}') from None

    def quantize(self, value):
        """Return the permitted value nearest to ``value`` (clamped; NaN: 0 or the minimum)."""
        if not math.isfinite(value):
            value = 0.0
        value = min(max(value, self.minimum), self.maximum)
        return self.values[self._index(value)]


@dataclass
class Action:
    """A parsed, clamped action: numeric fields by name, or text."""

    kind: str                       # 'twist', 'joint_trajectory' or 'string'
    values: dict = field(default_factory=dict)
    text: str = ''
    token_ids: tuple = ()
    decoded: Optional[dict] = None  # the model's values where the published ones were limited


class FieldGrammar:
    """Actions as ``prefix`` then one fixed-width word per field, then a newline."""

    def __init__(self, tokenizer, kind, fields, prefix='act'):
        if not fields:
            raise GrammarError('an action schema needs at least one field')
        self.tokenizer = tokenizer
        self.kind = kind
        self.fields = list(fields)
        self.prefix = prefix
        self.prefix_ids = tokenizer.encode(prefix).ids if prefix else []
        self.end_ids = tokenizer.encode('\n').ids
        self.tries = []
        for f in self.fields:
            trie = TokenTrie()
            for value in f.values:
                trie.insert(self._word_ids(f.text(value)), value)
            self.tries.append(trie)
        self._check_round_trip()

    def field(self, name):
        """Look up the ActionField named ``name``, a message field or a plan field."""
        for f in self.fields:
            if f.name == name:
                return f
        raise GrammarError(f'the action has no field {name!r}')

    def _word_ids(self, word):
        """Ids of ``' ' + word`` as it appears after the prefix (tokenized in context)."""
        base = self.tokenizer.encode(self.prefix).ids
        both = self.tokenizer.encode(self.prefix + ' ' + word).ids
        if both[:len(base)] != base:
            raise GrammarError(f'tokenizer merges action word {word!r} into the prefix')
        return both[len(base):]

    def _check_round_trip(self):
        """Every field word must tokenize the same inside a whole action as alone."""
        for f in self.fields:
            for value in (f.values[0], f.values[-1], f.values[len(f.values) // 2]):
                words = [g.text(value if g is f else g.values[0]) for g in self.fields]
                whole = self.tokenizer.encode(self.render_words(words)).ids
                parts = list(self.prefix_ids)
                for word in words:
                    parts += self._word_ids(word)
                parts += self.end_ids
                if whole != parts:
                    raise GrammarError(f'action words do not tokenize independently with this '
                                       f'tokenizer (field {f.name}); choose other keys or steps')

    def render_words(self, words):
        return ' '.join([self.prefix, *words]) + '\n' if self.prefix else ' '.join(words) + '\n'

    def render(self, values):
        """Text of an action given field values (quantized first); used to make training data."""
        return self.render_words([f.text(f.quantize(values[f.name])) for f in self.fields])

    def max_action_tokens(self):
        """Return the most tokens an action can take: prefix, the longest words, newline."""
        return (len(self.prefix_ids) + len(self.end_ids)
                + sum(max(len(self._word_ids(f.text(v))) for v in f.values)
                      for f in self.fields))

    def typical_decode_tokens(self):
        """Tokens of an action whose every field takes its median-length value."""
        return sum(sorted(len(self._word_ids(f.text(v))) for v in f.values)[len(f.values) // 2]
                   for f in self.fields)

    def _choices(self, index, ids):
        """Tokens of field ``index``'s word ``ids`` that are chosen (the others are forced)."""
        node, count = self.tries[index], 0
        for token in ids:
            count += len(node.children) > 1
            node = node.children[int(token)]
        return count

    def typical_choices(self):
        """Chosen (not forced) tokens of an action whose every field takes its median value."""
        return sum(sorted(self._choices(i, self._word_ids(f.text(v))) for v in f.values)
                   [len(f.values) // 2] for i, f in enumerate(self.fields))

    def max_forced_run(self):
        """Most tokens the grammar forces in a row after a chosen one (across field ends)."""
        memo = {}

        def run(index, node):   # forced tokens from ``node`` of field ``index`` on
            if index >= len(self.tries):
                return 0
            key = (index, id(node))
            if key not in memo:
                if node.terminal:
                    memo[key] = run(index + 1, self.tries[index + 1]) if (
                        index + 1 < len(self.tries)) else 0
                elif len(node.children) == 1:
                    memo[key] = 1 + run(index, next(iter(node.children.values())))
                else:
                    memo[key] = 0
            return memo[key]

        best = 0
        for index, trie in enumerate(self.tries):
            stack = [trie]
            while stack:
                node = stack.pop()
                if len(node.children) > 1:
                    best = max(best, *(run(index, c) for c in node.children.values()))
                stack.extend(node.children.values())
        return best

    # decoding state: (field index, trie node, chosen values)
    def start(self):
        return (0, self.tries[0], ())

    def allowed(self, state):
        return state[1].allowed()

    def advance(self, state, token):
        index, node, chosen = state
        child = node.children.get(int(token))
        if child is None:
            raise GrammarError(f'token {token} is not allowed here')
        if child.terminal:
            chosen = chosen + (child.value,)
            index += 1
            return (index, self.tries[index] if index < len(self.tries) else None, chosen)
        return (index, child, chosen)

    def done(self, state):
        return state[0] >= len(self.tries)

    def min_remaining(self, state):
        """Fewest tokens still to choose before the action is complete."""
        index, node, _ = state
        if index >= len(self.tries):
            return 0
        return node.shortest() + sum(t.shortest() for t in self.tries[index + 1:])

    def min_choices(self, state):
        """Fewest tokens still to choose that the grammar does not force."""
        index, node, _ = state
        if index >= len(self.tries):
            return 0
        return node.fewest_choices() + sum(t.fewest_choices() for t in self.tries[index + 1:])

    def action(self, state, token_ids=()):
        """Return the clamped Action of a finished state."""
        values = {f.name: float(f.quantize(v)) for f, v in zip(self.fields, state[2])}
        return Action(self.kind, values, token_ids=tuple(token_ids))

    def parse(self, text):
        """Parse action text (e.g. from a log) into a clamped Action; GrammarError if invalid."""
        words = text.split()
        if self.prefix:
            if not words or words[0] != self.prefix:
                raise GrammarError(f'action text does not start with {self.prefix!r}')
            words = words[1:]
        sizes = [len(f.text(f.values[0]).split()) for f in self.fields]
        if len(words) != sum(sizes):
            raise GrammarError(f'expected {len(self.fields)} fields, got {len(words)} words')
        values, at = {}, 0
        for f, size in zip(self.fields, sizes):
            values[f.name] = float(f.value_of(' '.join(words[at:at + size])))
            at += size
        return Action(self.kind, values)


def is_plan_field(name):
    """Tell whether a field is a plan field.

    A field named '_...' is decoded like any other (constrained, before the fields after it) and
    kept in the tick's records, but never published: a plan the policy states first and conditions
    the command on (e.g. the demo's '_aim', the bearing it steers for).
    """
    return name.startswith('_')


def twist_grammar(tokenizer, fields, prefix='act', spelling='digits'):
    """Grammar for geometry_msgs/Twist; ``fields``: dicts with name, key, min, max, step."""
    allowed = {'linear.x', 'linear.y', 'linear.z', 'angular.x', 'angular.y', 'angular.z'}
    specs = []
    for f in fields:
        if f['name'] not in allowed and not is_plan_field(f['name']):
            raise GrammarError(f"Twist has no field {f['name']!r} (one of {sorted(allowed)}, "
                               "or a plan field named '_...')")
        specs.append(ActionField(f['name'], f['key'], float(f['min']), float(f['max']),
                                 float(f['step']), spelling))
    return FieldGrammar(tokenizer, 'twist', specs, prefix)


def joint_trajectory_grammar(tokenizer, joints, prefix='act', spelling='digits'):
    """Grammar for trajectory_msgs/JointTrajectory: one position per joint."""
    specs = [ActionField(j['name'], f'j{i}', float(j['min']), float(j['max']),
                         float(j['step']), spelling) for i, j in enumerate(joints)]
    return FieldGrammar(tokenizer, 'joint_trajectory', specs, prefix)


class StringGrammar:
    """Free text of at most ``max_tokens`` tokens, ended by ``stop_text`` (std_msgs/String)."""

    kind = 'string'

    def __init__(self, tokenizer, max_tokens=16, stop_text='\n', prefix='say'):
        if max_tokens < 1:
            raise GrammarError('max_tokens must be at least 1')
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)
        self.stop_text = stop_text
        self.prefix = prefix
        self.prefix_ids = tokenizer.encode(prefix).ids if prefix else []
        self.end_ids = tokenizer.encode('\n').ids
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        self._all = np.arange(vocab, dtype=np.int64)

    def typical_decode_tokens(self):
        return self.max_tokens

    def typical_choices(self):
        return self.max_tokens

    def max_forced_run(self):
        return 0

    def max_action_tokens(self):
        return len(self.prefix_ids) + self.max_tokens + len(self.end_ids)

    def start(self):
        return ()

    def allowed(self, state):
        return self._all

    def advance(self, state, token):
        return state + (int(token),)

    def min_remaining(self, state):
        return 0 if self.done(state) else 1

    def min_choices(self, state):
        return self.min_remaining(state)

    def done(self, state):
        return (len(state) >= self.max_tokens
                or (self.stop_text and self.stop_text in self.tokenizer.decode(list(state))))

    def action(self, state, token_ids=()):
        text = self.tokenizer.decode(list(state))
        if self.stop_text and self.stop_text in text:
            text = text.split(self.stop_text, 1)[0]
        return Action('string', {}, text=_sanitize(text, 1000), token_ids=tuple(token_ids))

    def render(self, values):
        return f'{self.prefix} {values}{self.stop_text}'
