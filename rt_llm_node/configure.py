"""Build a ready TickEngine from parameter values: load, allocate, warm up, calibrate.

No ROS here: the node calls it in ``on_configure``; replay and tests call it too.
"""

import time

from rt_llm_node.admission import Admission
from rt_llm_node.admission import calibrate
from rt_llm_node.admission import check_cost_model
from rt_llm_node.backends import make_backend
from rt_llm_node.backends import verify_limit
from rt_llm_node.codec import InputSpec
from rt_llm_node.codec import joint_trajectory_grammar
from rt_llm_node.codec import StringGrammar
from rt_llm_node.codec import twist_grammar
from rt_llm_node.engine import ModelClock
from rt_llm_node.engine import TickEngine
from rt_llm_node.guard import JOINT_STATE
from rt_llm_node.guard import OutputGuard
from rt_llm_node.instruction_cache import InstructionCache
from rt_llm_node.model import load_model
from rt_llm_node.model.embedded import default_model_path
from rt_llm_node.params import grammar_range
from rt_llm_node.params import validate
from rt_llm_node.state_store import fingerprint
from rt_llm_node.state_store import host_description
from rt_llm_node.state_store import StateStore


class ConfigurationError(ValueError):
    """Parameters that cannot make an engine (the message says which and why)."""


def input_specs(values):
    """Build an InputSpec per configured input topic."""
    specs = []
    for i, topic in enumerate(values['input_topics']):
        min_valid = values['input_min_valid']
        options = ({'sectors': values['scan_sectors'],
                    'min_valid': min_valid[i] if len(min_valid) > 1 else min_valid[0]}
                   if values['input_types'][i].endswith('LaserScan') else {})
        specs.append(InputSpec(topic, values['input_types'][i],
                               max_age_s=values['input_max_age_s'][i],
                               kind=values['input_kinds'][i],
                               prefix=values['input_prefixes'][i],
                               max_tokens=values['input_max_tokens'][i], options=options))
    return specs


def action_grammar(values, tokenizer):
    """Return the action grammar the parameters describe (over the model's own range)."""
    kind = values['action_type']
    low, high = grammar_range(values)
    if 'Twist' in kind:
        fields = [{'name': n, 'key': k, 'min': lo, 'max': hi, 'step': st}
                  for n, k, lo, hi, st in zip(values['action_fields'], values['action_keys'],
                                              low, high, values['action_step'])]
        return twist_grammar(tokenizer, fields, spelling=values['action_spelling'])
    if kind == 'trajectory_msgs/msg/JointTrajectory':
        joints = [{'name': n, 'min': lo, 'max': hi, 'step': st}
                  for n, lo, hi, st in zip(values['action_fields'], low, high,
                                           values['action_step'])]
        return joint_trajectory_grammar(tokenizer, joints, spelling=values['action_spelling'])
    return StringGrammar(tokenizer, values['action_max_tokens'], values['action_stop_text'])


def output_guard(values, specs, grammar):
    """Return the OutputGuard of the parameters: limits, joint steps, fallbacks.

    A joint target needs a joint-state input: its measured positions bound each target and
    are what a stop holds.
    """
    joint_topic = None
    if values['action_type'] == 'trajectory_msgs/msg/JointTrajectory':
        joint_topic = next((s.topic for s in specs if s.msg_type == JOINT_STATE
                            and s.kind == 'observation'), None)
        if joint_topic is None:
            raise ConfigurationError(
                'action_type JointTrajectory needs a sensor_msgs/msg/JointState observation '
                'among input_topics: the measured positions bound each target and are what a '
                'stop holds (a stop is never a move to zero)')
    fields = [] if grammar.kind == 'string' else [f.name for f in grammar.fields]
    steps = values['joint_max_step']
    return OutputGuard(grammar.kind, fields, values['action_min'], values['action_max'],
                       joint_topic, steps * len(fields) if len(steps) == 1 else steps,
                       values['hold_timeout_s'], values['fallback_repeat'])


def check_room(engine, specs, grammar, capacity):
    """Refuse caps the cache cannot hold: the pinned parts plus one tick's worst case.

    Pinned: the system prompt and an instruction of each instruction input at its cap. One
    tick: every observation at its cap and the longest action. Otherwise one long input
    could never be made room for, tick after tick.
    """
    pinned = len(engine.system_ids) + sum(s.max_tokens for s in specs
                                          if s.kind == 'instruction')
    tick = (sum(s.max_tokens for s in specs if s.kind == 'observation')
            + grammar.max_action_tokens())
    if pinned + tick > capacity:
        caps = ', '.join(f'{s.topic} {s.max_tokens}' for s in specs)
        raise ConfigurationError(
            f'kv_capacity_tokens = {capacity} cannot hold the system prompt and instructions '
            f'({pinned} tokens) plus one tick at the input caps ({tick} tokens: '
            f'input_max_tokens {caps}, and the action); lower input_max_tokens or raise '
            'kv_capacity_tokens')


def verify_tokens(speculative, grammar):
    """Return the longest verify pass a backend needs: drafts, or the tokens a grammar forces.

    A chosen token with up to ``speculative`` drafts, or with the tokens the grammar forces
    after it (they ride in its pass); 0: none.
    """
    forced = grammar.max_forced_run()
    return max(speculative + 1 if speculative else 0, forced + 1 if forced else 0)


def build_engine(values, backend, tokenizer, admission, clock=None, guard=None, grammar=None):
    """Return the TickEngine the parameters describe over ``backend`` (not yet started).

    The one place the node, the replay and the fine-tuning data (training/finetune.py) lay
    out the prompt: inputs and renderers, action grammar (``grammar``, where the caller
    built it already), system prompt, eviction policy.
    """
    return TickEngine(backend, tokenizer, input_specs(values),
                      grammar or action_grammar(values, tokenizer), admission,
                      policy=values['eviction_policy'], system_prompt=values['system_prompt'],
                      clock=clock,
                      stamp_tolerance_s=values['input_stamp_tolerance_s'], guard=guard,
                      speculative_tokens=values['speculative_tokens'],
                      instruction_cache=(InstructionCache(values['instruction_cache_entries'],
                                                          values['instruction_cache_mb'] << 20)
                                         if values['instruction_cache_entries'] else None))


def configure_engine(values, clock=None, log=print, cost_model=None, warn=None):
    """Validate, load the model, allocate the backend, warm up, calibrate; return the engine.

    ``cost_model``: use this CostModel instead of calibrating (deterministic replays);
    ``warn``: where lines about a damaged or unwritable ``state_dir`` go (default ``log``).
    """
    errors = validate(values)
    if errors:
        raise ConfigurationError('; '.join(errors))
    started = time.monotonic()
    path = values['model_path'] or default_model_path()
    log(f'loading model from {path}')
    checkpoint = load_model(path, values['adapter_path'], values['weight_format'])
    if values['adapter_path']:
        log(f"adapter {values['adapter_path']} merged into the weights")
    cfg = checkpoint.config
    if values['kv_capacity_tokens'] > cfg.max_position_embeddings:
        raise ConfigurationError(
            f"kv_capacity_tokens = {values['kv_capacity_tokens']} exceeds the model's trained "
            f'length {cfg.max_position_embeddings}')
    log(f'{cfg.family} model: {cfg.n_parameters() / 1e6:.1f}M parameters, '
        f'{cfg.num_layers} layers, vocab {cfg.vocab_size}, '
        f'weights {checkpoint.describe_weights()}')
    speculative = values['speculative_tokens']
    grammar = action_grammar(values, checkpoint.tokenizer)
    backend = make_backend(values['backend'], checkpoint, values['kv_capacity_tokens'],
                           values['cuda_decode_step'], values['kv_dtype'],
                           verify_tokens=verify_tokens(speculative, grammar))
    log(f'backend {backend.name}: KV cache of {backend.capacity} tokens allocated '
        f"({values['kv_dtype']}, {backend.kv_bytes_per_token()} bytes a token)")
    tuning = getattr(backend, 'decode_tuning', None)
    if tuning:   # the CUDA backend's decode step, chosen by its GPU time on this device
        persistent = tuning['persistent']
        log(f"decode step: {tuning['chosen']} (a kernel a phase {tuning['kernels']:.0f} us, "
            + ('one persistent launch n/a)' if persistent is None else
               f'one persistent launch {persistent:.0f} us)'))
    elif backend.name == 'cuda' and verify_limit(backend):
        log('decode step: kernels, unstaged (what a verify pass, of drafts or of the tokens '
            'the grammar forces, repeats bit for bit)')
    elif backend.name == 'cuda':
        log(f"decode step: {values['cuda_decode_step']} (set by cuda_decode_step)")
    specs = input_specs(values)
    guard = output_guard(values, specs, grammar)
    store = fields = None
    if values['state_dir']:
        store = StateStore(values['state_dir'], values['state_max_mb'] << 20, log,
                           warn or log)
        fields = fingerprint(path, backend, values['weight_format'], values['adapter_path'])
    if cost_model is None:
        model = _stored_cost_model(store, fields, backend, cfg, values, log)
        if model is None:
            log('warming up and calibrating the cost model on this device')
            model = calibrate(backend, cfg.vocab_size, repeats=values['calibration_repeats'],
                              log=log)
            if store is not None:
                store.save_cost_model(_cost_fields(fields, backend, values), model)
    else:
        log('using the given cost model (no calibration)')
        model = cost_model
    log(f'cost model: prefill {model.prefill}, decode {model.decode}, '
        f'compact {model.compact}, verify {model.verify}')
    # model time (replay --clock model) is the cost model's own prediction: a probe could
    # only ever measure the model against itself, so there are none
    admission = Admission(model, margin_ms=values['deadline_margin_ms'],
                          window=values['admission_window_ticks'],
                          probe_ticks=(0 if isinstance(clock, ModelClock)
                                       else values['admission_probe_ticks']),
                          min_scale=values['admission_min_scale'],
                          quantile=values['admission_quantile'])
    engine = build_engine(values, backend, checkpoint.tokenizer, admission, clock, guard,
                          grammar)
    check_room(engine, engine.inputs, engine.grammar, backend.capacity)
    if engine.start(store, fields, log):
        log(f'system prompt: {len(engine.system_ids)} tokens of KV state restored from '
            f'{values["state_dir"]}')
    log(f'configured in {time.monotonic() - started:.1f} s')
    return engine


def _cost_fields(fields, backend, values):
    """Return what a stored cost model must match.

    The prefix fields, host, capacity and repeats, and what sets the times of the calls it
    prices: the decode step (CUDA: per kernel or persistent, staged or not) and the longest
    verify pass.
    """
    return {**fields, 'host': host_description(backend), 'capacity': backend.capacity,
            'calibration_repeats': values['calibration_repeats'],
            'decode_step': getattr(backend, 'decode_step', None),
            'staged_decode': getattr(backend, 'staged_decode', None),
            'verify_tokens': verify_limit(backend)}


def _stored_cost_model(store, fields, backend, cfg, values, log):
    """Return the stored cost model if it passes a short check on this device, else None."""
    if store is None:
        return None
    stored = store.load_cost_model(_cost_fields(fields, backend, values))
    if stored is None:
        return None
    started = time.monotonic()
    ok, detail = check_cost_model(backend, stored, cfg.vocab_size,
                                  repeats=values['calibration_repeats'])
    log(f'stored cost model {"kept" if ok else "disagrees with this device"}: {detail}, '
        f'checked in {time.monotonic() - started:.2f} s')
    return stored if ok else None
