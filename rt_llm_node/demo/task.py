"""The demo task's interface: inputs, action schema and system prompt.

The same definitions render the training data, drive the evaluation and fill
``config/demo.yaml``; a test checks that the YAML and this module agree.
"""

import os
from pathlib import Path

from rt_llm_node.codec import ActionField
from rt_llm_node.codec import InputSpec
from rt_llm_node.codec import twist_grammar
from rt_llm_node.demo.world import COLOURS
from rt_llm_node.demo.world import SHAPES

SYSTEM_PROMPT = 'go to the object in the task'
RATE_HZ = 30.0

INPUTS = (
    InputSpec('/instruction', 'std_msgs/msg/String', kind='instruction', prefix='task',
              max_age_s=1e9, max_tokens=16),
    InputSpec('/scan', 'sensor_msgs/msg/LaserScan', max_age_s=0.2, max_tokens=24,
              options={'sectors': 12}),
    InputSpec('/odom', 'nav_msgs/msg/Odometry', max_age_s=0.2, max_tokens=24),
    InputSpec('/detections', 'std_msgs/msg/String', prefix='det', max_age_s=0.2, max_tokens=40),
)

TWIST_FIELDS = (
    {'name': 'linear.x', 'key': 'v', 'min': -0.2, 'max': 0.8, 'step': 0.1},
    {'name': 'angular.z', 'key': 'w', 'min': -1.5, 'max': 1.5, 'step': 0.25},
)

# The plan field of an aiming policy (training/train.py --aim): decoded before v and
# w, never published. Its value is the instructed object's bearing, quantized to 15 deg and
# held within +-165; +180 says "not in sight" (the expert then turns on the spot).
AIM_FIELD = {'name': '_aim', 'key': 'a', 'min': -165.0, 'max': 180.0, 'step': 15.0}
AIM_UNSEEN = 180.0


REQUIRED_TOPICS = ('/instruction', '/scan', '/detections')   # what the expert reads


def demo_inputs(topics=None, required=REQUIRED_TOPICS):
    """Restrict ``INPUTS`` to ``topics`` (in ``INPUTS`` order; None: all of them).

    A policy may be trained on fewer inputs than the world publishes (e.g. without /odom,
    whose measured turn rate the shipped policy copies); the ``required`` ones stay (by
    default the expert's own inputs; training/lookup_stage.py asks only for the instruction
    and the detections).
    """
    if topics is None:
        return INPUTS
    topics = list(topics)
    known = [spec.topic for spec in INPUTS]
    unknown = [t for t in topics if t not in known]
    if unknown:
        raise ValueError(f'unknown demo input(s) {unknown}: the demo has {known}')
    missing = [t for t in required if t not in topics]
    if missing:
        raise ValueError(f'the demo policy needs {missing} (the expert it imitates reads them)'
                         if required == REQUIRED_TOPICS else f'{missing} are needed here')
    return tuple(spec for spec in INPUTS if spec.topic in topics)


def model_inputs(model_dir):
    """Return the demo inputs a checkpoint was trained on.

    The topics its ``training.json`` records under "inputs" (training/train.py --inputs), else all
    of ``INPUTS``. Feeding a policy inputs it was not trained on loses most goals
    (docs/history.md).
    """
    return demo_inputs(_training_record(model_dir).get('inputs'))


def _training_record(model_dir):
    """Return a checkpoint's ``training.json`` as a dict ({} where it has none)."""
    from rt_llm_node.files import FileError
    from rt_llm_node.files import read_json
    path = Path(model_dir) / 'training.json'
    if not os.path.lexists(path):
        return {}
    try:
        record = read_json(path, 'training record', 1 << 20)
    except FileError as err:
        raise ValueError(str(err)) from None
    if not isinstance(record, dict):
        raise ValueError(f'{path}: unreadable (not a JSON object)')
    return record


def action_fields(aim=False):
    """Return the demo's action fields: v and w, after the plan field '_aim' with ``aim``."""
    return ((AIM_FIELD,) if aim else ()) + TWIST_FIELDS


def action_grammar(tokenizer, aim=False):
    """Return the demo's Twist grammar for ``tokenizer`` (with the '_aim' plan field first)."""
    return twist_grammar(tokenizer, action_fields(aim))


def model_aim(model_dir):
    """Whether a checkpoint was trained to state its aim first.

    Its ``training.json`` records "aim" (training/train.py --aim); absent, it was not.
    """
    return bool(_training_record(model_dir).get('aim', False))


def numeric_field(spec):
    """Return the ActionField of one of the demo's field specs (TWIST_FIELDS, AIM_FIELD)."""
    return ActionField(spec['name'], spec['key'], spec['min'], spec['max'], spec['step'])


def model_object_tokens(model_dir):
    """Whether a checkpoint's tokenizer keeps each object name one token.

    Its ``training.json`` records "object_tokens" (training/train.py --object-tokens, or an --init
    from such a checkpoint).
    """
    return bool(_training_record(model_dir).get('object_tokens', False))


def action_words(aim=False):
    """Every word an action can contain (' v+0.3', ' w-1.25', ' a+045', ...), as rendered."""
    fields = [numeric_field(f) for f in action_fields(aim)]
    return [' ' + field.text(value) for field in fields for value in field.values]


def detection_words():
    """Every bearing word a detection can contain (' -62deg', ' 94deg'), as rendered."""
    return [f' {b}deg' for b in range(-180, 181)]


def object_phrases():
    """Every object name a detection or an instruction can contain (' red box', ...).

    A tokenizer trained with ``episodes.train_tokenizer(..., phrases=object_phrases())``
    keeps each one a single token, the same in the instruction and in every detection, so
    finding the instructed object among the detections is matching one token, not a colour
    and a shape that other objects share (training/train.py --object-tokens).
    """
    return [f' {colour} {shape}' for colour in COLOURS for shape in SHAPES]


def whole_words(aim=False):
    """Words the demo tokenizer keeps whole.

    Each action word (one decode step per field) and each bearing (one token for the
    number the policy steers by, alike for either sign).
    """
    return action_words(aim) + detection_words()
