"""The node's parameters: names, defaults, descriptions, ranges and validation. No ROS here.

``PARAMETERS`` is the single source: the node declares from it, the YAML files
are checked against it by a test, and ``validate`` is used both by the node's
on-set-parameters callback and at configure.
"""

from dataclasses import dataclass
import math

from rt_llm_node.backends import BACKENDS
from rt_llm_node.backends import DECODE_STEPS
from rt_llm_node.backends import KV_DTYPES
from rt_llm_node.codec import normalize_type
from rt_llm_node.kvcache import POLICIES

ON_REFUSAL = ('stop', 'hold', 'none')
ACTION_TYPES = ('geometry_msgs/msg/Twist', 'geometry_msgs/msg/TwistStamped',
                'std_msgs/msg/String', 'trajectory_msgs/msg/JointTrajectory')
FALLBACK_REPEATS = ('once', 'every_tick')


@dataclass(frozen=True)
class Param:
    name: str
    default: object
    description: str
    low: float = None
    high: float = None
    choices: tuple = ()


PARAMETERS = (
    Param('model_path', '', 'HF-layout checkpoint directory or .gguf file; empty: the '
          'embedded demo model'),
    Param('adapter_path', '', 'LoRA adapter folder as PEFT saves it (adapter_config.json, '
          'adapter_model.safetensors), merged into the weights at configure; empty: none'),
    Param('weight_format', 'native', "weights at run time: native (as stored; a GGUF's "
          'quantized tensors stay quantized), int8 or int4 (float matrices quantized on load, '
          'round to nearest, groups of 32)', choices=('native', 'int8', 'int4')),
    Param('kv_dtype', 'native', 'KV cache values: native (fp32) or int8 (a scale per token '
          'and kv head: about a quarter of the bytes)', choices=KV_DTYPES),
    Param('backend', 'auto', 'inference backend', choices=BACKENDS),
    Param('cuda_decode_step', 'auto', "the CUDA backend's decode step: auto (the faster of "
          'the two, timed at configure), kernels (a kernel a phase) or persistent (one '
          'cooperative launch); numpy ignores it', choices=DECODE_STEPS),
    Param('rate_hz', 30.0, 'control rate (ticks per second)', 1.0, 200.0),
    Param('deadline_margin_ms', 3.0, 'safety margin kept before each tick deadline (ms)',
          0.0, 100.0),
    Param('kv_capacity_tokens', 512, 'KV cache size in tokens (fixed, preallocated)',
          32, 131072),
    Param('eviction_policy', 'meaning', 'what the full cache forgets first',
          choices=tuple(POLICIES)),
    Param('system_prompt', '', 'text prefilled once and pinned in the cache'),
    Param('on_refusal', 'stop', 'fallback after a refusal: stop (a Twist: zeros; joint '
          'targets: the measured positions), hold (the last action, for at most '
          'hold_timeout_s, then stop) or none (publish nothing)', choices=ON_REFUSAL),
    Param('hold_timeout_s', 0.5, 'on_refusal hold: how long the last action is repeated '
          'after it was published; then the stop', 0.0, 60.0),
    Param('fallback_repeat', 'once', 'once: the fallback stop goes out once on entering a '
          'refusal state, then silence until the next action (a command multiplexer can hand '
          'over); every_tick: a stop every refused tick (bases without a command timeout)',
          choices=FALLBACK_REPEATS),
    Param('input_topics', ['/scan', '/odom'], 'subscribed topics, in rendering order'),
    Param('input_types', ['sensor_msgs/msg/LaserScan', 'nav_msgs/msg/Odometry'],
          'message type of each input topic'),
    Param('input_max_age_s', [0.2, 0.2], 'max age of each input before stale_input (s)'),
    Param('input_kinds', ['observation', 'observation'],
          'observation (rendered when new) or instruction (pinned, once per message)'),
    Param('input_prefixes', ['', ''], 'text put before each input line (e.g. det, task)'),
    Param('input_max_tokens', [32, 32], 'token cap of each input line', ),
    Param('input_min_valid', [0.1], 'LaserScan inputs: the least share (0..1) of beams with '
          'a valid return, below which the scan is an input_error refusal; one value for '
          'every input, or one per input', ),
    Param('input_stamp_tolerance_s', 0.5, "clock offset allowed between a message's header "
          'stamp and this host: older than its max age plus this, or stamped further ahead '
          'than this, is stale_input (messages without a stamp: by arrival)', 0.0, 3600.0),
    Param('scan_sectors', 8, 'LaserScan sectors rendered (min range each)', 4, 36),
    Param('action_topic', 'cmd_vel', 'topic of the published action'),
    Param('action_type', 'geometry_msgs/msg/Twist', 'type of the action message (a '
          'JointTrajectory needs a sensor_msgs/msg/JointState input: its positions bound '
          'each target and are the stop)', choices=ACTION_TYPES),
    Param('action_frame_id', 'base_link', "TwistStamped actions: the header's frame_id"),
    Param('action_fields', ['linear.x', 'angular.z'],
          "Twist fields, or joint names for JointTrajectory; a name '_...' is a plan "
          'field: decoded and recorded, never published'),
    Param('action_keys', ['v', 'w'], 'short text key of each field in the action grammar'),
    Param('action_min', [-0.2, -1.5], 'lower limit of each published field (SI units): '
          'the decoded value is clamped to it'),
    Param('action_max', [0.8, 1.5], 'upper limit of each published field (SI units): '
          'the decoded value is clamped to it'),
    Param('action_grammar_min', [], "lower end of each field's range in the action grammar "
          '(the range the model was trained on); empty: action_min'),
    Param('action_grammar_max', [], "upper end of each field's range in the action grammar; "
          'empty: action_max'),
    Param('action_step', [0.1, 0.25], 'quantization step of each field'),
    Param('action_spelling', 'digits', 'how action values are written: digits (the number, '
          "e.g. 'v+0.40') or compact (a letter a value, e.g. 'v g': one chosen token a field "
          "with a pretrained model's tokenizer; for a model trained to it)",
          choices=('digits', 'compact')),
    Param('joint_max_step', [0.05], 'JointTrajectory actions: the farthest a published '
          'target may lie from the measured position, per tick (rad or m); one value for '
          'every joint, or one per field'),
    Param('action_max_tokens', 16, 'std_msgs/String actions: max tokens', 1, 256),
    Param('action_stop_text', '\n', 'std_msgs/String actions: text that ends the action'),
    Param('admission_window_ticks', 60, 'ticks over which measured/predicted ratios are '
          'kept', 1, 100000),
    Param('admission_quantile', 0.9, "quantile of the window's measured/predicted ratios "
          'that scales the cost model (1: the worst; lower ignores rare stalls)', 0.5, 1.0),
    Param('admission_probe_ticks', 30, 'deadline refusals in a row after which one tick '
          'runs as a probe of a cost model calibrated on a slow host (0: never)', 0, 100000),
    Param('admission_min_scale', 0.25, 'the least fraction of the calibrated cost a probe '
          'may teach admission to expect', 0.01, 1.0),
    Param('speculative_tokens', 0, 'speculative action decoding: tokens drafted (from the '
          'last action, the cache, the grammar) and verified in one pass; the action stays '
          'exactly the greedy one (both backends verify row-exactly; on CUDA the decode step '
          'is then the per-kernel, unstaged one that a verify row repeats); 0: off', 0, 16),
    Param('instruction_cache_entries', 8, 'instructions whose KV state is kept in host '
          'memory: a new instruction is placed right after the system prompt (what followed '
          'it is dropped) and one seen before is restored by copy, not prefilled; 0: '
          'instructions are appended like observations and evicted by meaning', 0, 10000),
    Param('instruction_cache_mb', 64, 'size bound of the instruction cache in host memory '
          '(least recently used entries go first)', 1, 1_000_000),
    Param('calibration_repeats', 5, 'timings per calibration grid point', 2, 50),
    Param('state_dir', '', "folder where the node keeps the system prompt's KV state and its "
          'calibrated cost model across restarts (used again only on an exact match of '
          'model, formats, backend and host); empty: off'),
    Param('state_max_mb', 256, 'size bound of state_dir (least recently used entries go '
          'first)', 1, 1_000_000),
    Param('cost_model_path', '', 'configure writes the calibrated cost model here (JSON, '
          'for rt-llm-replay --cost-model); empty: not written'),
    Param('diagnostics_window_s', 5.0, '/diagnostics levels and input rates are judged over '
          'this many recent seconds', 0.5, 3600.0),
    Param('backend_error_limit', 5, 'consecutive backend errors before ErrorProcessing',
          1, 1000),
    Param('realtime_priority', 0, 'SCHED_FIFO priority of the control thread and of '
          "configure's calibration (Linux; 0: normal scheduling); needs CAP_SYS_NICE or an "
          'rtprio limit, else a warning', 0, 98),
)
BY_NAME = {p.name: p for p in PARAMETERS}
LISTS = {'input_topics': str, 'input_types': str, 'input_max_age_s': float,
         'input_kinds': str, 'input_prefixes': str, 'input_max_tokens': int,
         'input_min_valid': float,
         'action_fields': str, 'action_keys': str, 'action_min': float,
         'action_max': float, 'action_grammar_min': float, 'action_grammar_max': float,
         'action_step': float, 'joint_max_step': float}


def check(name, value):
    """Error message for one value, or '' if it is acceptable on its own."""
    p = BY_NAME.get(name)
    if p is None:
        return f'unknown parameter {name!r}'
    if name in LISTS:
        kind = LISTS[name]
        if not isinstance(value, (list, tuple)):
            return f'{name} = {value!r} must be a list'
        for item in value:
            if kind is float and (isinstance(item, bool) or not isinstance(item, (int, float))
                                  or not math.isfinite(item)):
                return f'{name}: {item!r} is not a finite number'
            if kind is int and (isinstance(item, bool) or not isinstance(item, int) or item < 1):
                return f'{name}: {item!r} is not a positive integer'
            if kind is str and not isinstance(item, str):
                return f'{name}: {item!r} is not a string'
        if name == 'input_types':
            for item in value:
                try:
                    normalize_type(item)
                except ValueError as exc:
                    return str(exc)
        if name == 'input_max_age_s' and any(v <= 0 for v in value):
            return 'input_max_age_s must be positive'
        if name == 'input_kinds' and any(v not in ('observation', 'instruction') for v in value):
            return 'input_kinds must be observation or instruction'
        if name == 'input_min_valid' and any(not 0.0 <= v <= 1.0 for v in value):
            return 'input_min_valid: each value must be in [0, 1]'
        if name == 'action_step' and any(v <= 0 for v in value):
            return 'action_step must be positive'
        if name == 'joint_max_step' and any(v <= 0 for v in value):
            return 'joint_max_step must be positive'
        return ''
    where = f' in [{p.low:g}, {p.high:g}]' if p.low is not None else ''
    if isinstance(p.default, float) and (isinstance(value, bool) or not isinstance(
            value, (int, float)) or not math.isfinite(value)):
        return f'{name} = {value!r} must be a finite number{where}'
    if isinstance(p.default, int) and not isinstance(p.default, bool) and (
            isinstance(value, bool) or not isinstance(value, int)):
        return f'{name} = {value!r} must be an integer{where}'
    if isinstance(p.default, str) and not isinstance(value, str):
        return f'{name} = {value!r} must be a string'
    if p.low is not None and not p.low <= value <= p.high:
        return f'{name} = {value} is outside [{p.low:g}, {p.high:g}]'
    if p.choices and value not in p.choices:
        return f'{name} = {value!r} is not one of {", ".join(p.choices)}'
    return ''


def unknown_names(names):
    """Messages for parameter names that are not the node's, with the nearest known name."""
    import difflib
    messages = []
    for name in sorted(set(names) - set(BY_NAME) - {'use_sim_time'}):
        near = difflib.get_close_matches(name, list(BY_NAME), n=1)
        messages.append(f'{name!r} is not a parameter of this node'
                        + (f' (did you mean {near[0]!r}?)' if near else '') + '; ignored')
    return messages


def validate(values):
    """Errors of a whole parameter set (each value and their consistency)."""
    errors = [e for e in (check(k, v) for k, v in values.items()) if e]
    if errors:
        return errors
    n = len(values['input_topics'])
    for key in ('input_types', 'input_max_age_s', 'input_kinds', 'input_prefixes',
                'input_max_tokens'):
        if len(values[key]) != n:
            errors.append(f'{key} has {len(values[key])} entries, input_topics has {n}')
    if len(values['input_min_valid']) not in (1, n):
        errors.append(f"input_min_valid has {len(values['input_min_valid'])} entries: give one "
                      f'for every input, or one per input ({n})')
    if values['action_type'] != 'std_msgs/msg/String':
        m = len(values['action_fields'])
        keys = ('action_min', 'action_max', 'action_step')
        keys += ('action_keys',) if 'Twist' in values['action_type'] else ()
        for key in keys:
            if len(values[key]) != m:
                errors.append(f'{key} has {len(values[key])} entries, action_fields has {m}')
        for key in ('action_grammar_min', 'action_grammar_max'):
            if len(values[key]) not in (0, m):
                errors.append(f'{key} has {len(values[key])} entries: none (the action_min '
                              f'and action_max range) or one per action field ({m})')
        if len(values['joint_max_step']) not in (1, m):
            errors.append(f"joint_max_step has {len(values['joint_max_step'])} entries: one "
                          f'for every joint, or one per action field ({m})')
        if not errors and any(lo > hi for lo, hi in zip(values['action_min'],
                                                        values['action_max'])):
            errors.append('action_min must not exceed action_max')
        if not errors and any(lo > hi for lo, hi in zip(*grammar_range(values))):
            errors.append('action_grammar_min must not exceed action_grammar_max')
    if (values['speculative_tokens'] and values['backend'] != 'numpy'
            and values['cuda_decode_step'] == 'persistent'):
        errors.append("speculative_tokens needs cuda_decode_step 'auto' or 'kernels': a "
                      'verify pass repeats the per-kernel decode step bit for bit')
    return errors


def grammar_range(values):
    """(minimum, maximum) of each action field in the grammar: the model's own range."""
    return (list(values['action_grammar_min'] or values['action_min']),
            list(values['action_grammar_max'] or values['action_max']))


def _key_matches(key, fqn, name):
    """Tell whether a params-file key applies to the node ``fqn`` (its name ``name``).

    rcl's rules (``/ns/node``, ``/**``, ``/**/node``, ``*`` for one name) and one more: a key
    that is the node's bare name applies under any namespace, as people write it.
    """
    import re
    key = str(key).strip()
    if key in (name, '/' + name):
        return True
    key = key if key.startswith('/') else '/' + key
    pattern = ''.join('.*' if part == '**' else '[^/]*' if part == '*' else re.escape(part)
                      for part in re.split(r'(\*\*|\*)', key))
    return re.fullmatch(pattern, fqn) is not None


def node_sections(data, fqn, any_namespace=False):
    """Return (values, keys matched, keys looked for) of a params file for node ``fqn``.

    Sections apply in file order, a later one overriding an earlier one, as rcl applies
    them; ``data`` is the parsed YAML. ``any_namespace``: a key for the node's name under
    any namespace applies too (a replay, which runs no namespace of its own).
    """
    name = fqn.rsplit('/', 1)[-1]
    values, matched = {}, []
    for key, entry in (data.items() if isinstance(data, dict) else ()):
        if not isinstance(entry, dict) or not isinstance(entry.get('ros__parameters'), dict):
            continue
        if _key_matches(key, fqn, name) or (
                any_namespace and str(key).strip().rstrip('/').rsplit('/', 1)[-1] == name):
            values.update(entry['ros__parameters'])
            matched.append(str(key))
    looked_for = [f'/NAMESPACE/{name}' if any_namespace else fqn, name, '/**',
                  f'/**/{name}']
    return values, matched, looked_for
