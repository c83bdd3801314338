"""The ROS 2 lifecycle node: parameters, subscriptions, publishers, the control thread.

A thin adapter around ``TickEngine``: no model math here. ``on_configure`` loads,
compiles, allocates, warms up and calibrates; ``on_activate`` only starts the
control thread; ``on_deactivate`` stops it and sends the fallback action;
``on_cleanup``/``on_shutdown`` release everything.
"""

import argparse
from collections import Counter
from collections import deque
from collections import OrderedDict
from functools import partial
import gc
import os
import sys
import threading
import time
from typing import Optional

from builtin_interfaces.msg import Duration as DurationMsg
from diagnostic_msgs.msg import DiagnosticArray
from diagnostic_msgs.msg import DiagnosticStatus
from diagnostic_msgs.msg import KeyValue
from geometry_msgs.msg import Twist
from geometry_msgs.msg import TwistStamped
from geometry_msgs.msg import Vector3
from nav_msgs.msg import Odometry
from rcl_interfaces.msg import FloatingPointRange
from rcl_interfaces.msg import IntegerRange
from rcl_interfaces.msg import ParameterDescriptor
from rcl_interfaces.msg import SetParametersResult
from rclpy.duration import Duration
from rclpy.lifecycle import LifecycleNode
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy
from rclpy.qos import qos_profile_sensor_data
from rclpy.qos import QoSProfile
from rclpy.qos import ReliabilityPolicy
from sensor_msgs.msg import Imu
from sensor_msgs.msg import JointState
from sensor_msgs.msg import LaserScan
from std_msgs.msg import Header
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory
from trajectory_msgs.msg import JointTrajectoryPoint

try:  # Jazzy and later
    from rclpy.event_handler import PublisherEventCallbacks
    from rclpy.event_handler import SubscriptionEventCallbacks
except ImportError:  # Humble
    from rclpy.qos_event import PublisherEventCallbacks
    from rclpy.qos_event import SubscriptionEventCallbacks

from rt_llm_node.codec import action_message
from rt_llm_node.codec import refusal_values
from rt_llm_node.configure import configure_engine
from rt_llm_node.engine import header_stamp_lag
from rt_llm_node.engine import InputBuffer
from rt_llm_node.files import FileError
from rt_llm_node.files import read_yaml
from rt_llm_node.files import write_atomic
from rt_llm_node.health import ERROR
from rt_llm_node.health import Health
from rt_llm_node.health import LineLimiter
from rt_llm_node.health import OK
from rt_llm_node.health import WARN
from rt_llm_node.params import BY_NAME
from rt_llm_node.params import node_sections
from rt_llm_node.params import PARAMETERS
from rt_llm_node.params import unknown_names
from rt_llm_node.params import validate
from rt_llm_node.qos import INSTRUCTION_QOS
from rt_llm_node.qos import INSTRUCTION_VOLATILE_QOS
from rt_llm_node.spin import spin_until_shutdown

MESSAGE_CLASSES = {
    'sensor_msgs/msg/LaserScan': LaserScan,
    'nav_msgs/msg/Odometry': Odometry,
    'sensor_msgs/msg/Imu': Imu,
    'sensor_msgs/msg/JointState': JointState,
    'geometry_msgs/msg/Twist': Twist,
    'geometry_msgs/msg/TwistStamped': TwistStamped,
    'std_msgs/msg/String': String,
    'trajectory_msgs/msg/JointTrajectory': JointTrajectory,
}


def _descriptor(p):
    # dynamic typing: a YAML 'rate_hz: 30' (an int) is accepted for a float parameter, and
    # every value is then checked by params.validate, with a message naming it and its range
    d = ParameterDescriptor(description=p.description, dynamic_typing=True)
    if p.choices:
        d.additional_constraints = 'one of: ' + ', '.join(p.choices)
    if p.low is not None and isinstance(p.default, float):
        d.floating_point_range = [FloatingPointRange(from_value=float(p.low),
                                                     to_value=float(p.high))]
    elif p.low is not None:
        d.integer_range = [IntegerRange(from_value=int(p.low), to_value=int(p.high))]
    return d


_ACTION_CLASSES = {
    'geometry_msgs/msg/Twist': Twist, 'geometry_msgs/msg/Vector3': Vector3,
    'geometry_msgs/msg/TwistStamped': TwistStamped, 'std_msgs/msg/Header': Header,
    'std_msgs/msg/String': String, 'trajectory_msgs/msg/JointTrajectory': JointTrajectory,
    'trajectory_msgs/msg/JointTrajectoryPoint': JointTrajectoryPoint,
    'builtin_interfaces/msg/Duration': DurationMsg,
}


def to_message(action, action_type, period_s, stamp=None, frame_id=''):
    """Return the ROS message of an Action (values already limited by the guard)."""
    return action_message(action, action_type, period_s,
                          lambda name, **fields: _ACTION_CLASSES[name](**fields),
                          stamp=stamp, frame_id=frame_id)


LATCHED_FETCH_S = 2.0   # how long a latched subscription is kept to fetch a kept message
DEDUPE_MESSAGES = 256   # instructions remembered meanwhile, to receive each once
_LEVELS = {OK: DiagnosticStatus.OK, WARN: DiagnosticStatus.WARN, ERROR: DiagnosticStatus.ERROR}


def _first_words(msg, words=8, chars=60):
    """Return the first words of an instruction message, for a log line."""
    text = ' '.join(str(getattr(msg, 'data', msg)).split()[:words])
    return repr(text if len(text) <= chars else text[:chars] + '...')


class RtLlmNode(LifecycleNode):
    """Every tick: snapshot inputs, admit or refuse, decode an action before the deadline."""

    def __init__(self, node_name='rt_llm_node', **kwargs):
        super().__init__(node_name, **kwargs)
        self._engine = None
        self._action_pub = None
        self._refusal_pub = None
        self._diagnostics_pub = None
        self._diagnostics_timer = None
        self._subscriptions_ = []
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._buffer = InputBuffer()
        # instruction topics: the last few (message, arrival) for de-duplication (a message
        # from a latched publisher reaches both subscriptions while both exist), and the
        # latched subscription: made when a latched publisher is new, kept while it delivers
        # what that publisher kept, then gone (see _match_latched)
        self._received = {}
        self._instruction_said = {}     # topic -> when its last arrival line was logged
        self._instruction_count = {}    # topic -> its arrival count then
        self._latched = {}              # topic -> (subscription or None, made at)
        self._latched_seen = {}         # topic -> gids of the latched publishers met
        self._graph_timer = None
        self._instruction_topics = set()
        self._lines = LineLimiter(1.0)
        self._input_problems = {}       # topic -> its state as last logged (fresh, stale...)
        self._deciding = 'action'       # what the ticks do as last logged: 'action' or a reason
        self._values = {}
        self._failed = False
        self._active = False            # between on_activate and leaving the active state
        self._publish_lock = threading.Lock()   # one publisher of actions at a time
        self._realtime = False          # the control thread runs under SCHED_FIFO
        self.last_error = ''
        self._stats_lock = threading.Lock()
        self._reset_stats()
        for p in PARAMETERS:
            self.declare_parameter(p.name, p.default, _descriptor(p))
        self.add_on_set_parameters_callback(self._on_set_parameters)
        overrides = getattr(self, '_parameter_overrides', {})
        for message in unknown_names(overrides):
            self.get_logger().warning(message)
        for message in validate(self._current_values()):
            self.get_logger().error(f'invalid parameter: {message} (configure will fail)')

    # -- parameters ---------------------------------------------------------------------
    def _current_values(self, overrides=()):
        values = {p.name: self.get_parameter(p.name).value for p in PARAMETERS}
        values.update(dict(overrides))
        for name, value in values.items():
            if isinstance(value, tuple) or (hasattr(value, 'tolist')):
                values[name] = value = list(value)
            if (isinstance(BY_NAME[name].default, float) and isinstance(value, int)
                    and not isinstance(value, bool)):
                values[name] = float(value)   # 'rate_hz: 30' means 30.0
        return values

    def _on_set_parameters(self, params):
        changes = {}
        for p in params:
            value = p.value
            if hasattr(value, 'tolist'):
                value = value.tolist()
            changes[p.name] = list(value) if isinstance(value, tuple) else value
        errors = validate(self._current_values(changes))
        if errors:
            return SetParametersResult(successful=False, reason='; '.join(errors))
        if self._engine is not None and set(changes) - {'on_refusal'}:
            return SetParametersResult(successful=False, reason='node is configured: '
                                       'clean up before changing parameters')
        if 'on_refusal' in changes:
            before = self._values.get('on_refusal', BY_NAME['on_refusal'].default)
            self._values['on_refusal'] = changes['on_refusal']
            if before != changes['on_refusal']:
                self.get_logger().info(f"on_refusal: {before} -> {changes['on_refusal']}")
        return SetParametersResult(successful=True)

    # -- lifecycle ----------------------------------------------------------------------
    def on_configure(self, state):
        self._values = self._current_values()
        self.get_logger().info('configuring: loading the model, warming up, calibrating')
        try:
            self._engine = self._at_control_priority(
                lambda: configure_engine(self._values,
                                         log=lambda text: self.get_logger().info(text),
                                         warn=lambda text: self.get_logger().warning(text)))
        except Exception as exc:  # every failure is reported, never raised into rclpy
            self.last_error = f'configure failed: {exc}'
            self.get_logger().error(self.last_error)
            self._engine = None
            return TransitionCallbackReturn.FAILURE
        v = self._values
        if v['cost_model_path']:  # the robot's own calibration, for replays of its bags
            try:
                write_atomic(v['cost_model_path'], self._engine.admission.model.to_json(),
                             'cost_model_path')
                self.get_logger().info(f"cost model written to {v['cost_model_path']}")
            except FileError as exc:
                self.get_logger().warning(f'cost model not written: {exc}')
        period = 1.0 / v['rate_hz']
        # a missed QoS deadline is a period with no action on the wire: 1.5 periods, since a
        # tick publishes anywhere in its period and the next one as early as the next
        action_qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                                deadline=Duration(seconds=1.5 * period))
        callbacks = PublisherEventCallbacks(deadline=self._on_deadline_missed)
        self._action_pub = self.create_lifecycle_publisher(
            MESSAGE_CLASSES[v['action_type']], v['action_topic'], action_qos,
            event_callbacks=callbacks)
        self._refusal_pub = self.create_lifecycle_publisher(DiagnosticArray, '~/refusal', 10)
        self._diagnostics_pub = self.create_lifecycle_publisher(DiagnosticArray,
                                                                '/diagnostics', 10)
        for spec in self._engine.inputs:
            cls = MESSAGE_CLASSES[spec.msg_type]
            if spec.kind != 'instruction':
                self._subscriptions_.append(self.create_subscription(
                    cls, spec.topic, partial(self._receive, spec.topic),
                    qos_profile_sensor_data))
                continue
            # a default publisher (ros2 topic pub: reliable, volatile) reaches the volatile
            # subscription; a latched one that spoke before this node started needs a latched
            # subscription, which a volatile publisher cannot match (and would be told that
            # no messages will be sent to it): so that one exists only while a latched
            # publisher does
            self._instruction_topics.add(spec.topic)
            self._subscriptions_.append(self.create_subscription(
                cls, spec.topic, partial(self._receive_instruction, spec.topic),
                INSTRUCTION_VOLATILE_QOS, event_callbacks=SubscriptionEventCallbacks(
                    incompatible_qos=partial(self._on_incompatible_qos, spec.topic))))
            self._latched[spec.topic] = (None, 0.0)
            self._latched_seen[spec.topic] = set()
            self._received[spec.topic] = OrderedDict()
        if self._latched:
            self._match_latched()
            self._graph_timer = self.create_timer(0.5, self._match_latched)
        kept = self._buffer.snapshot()
        if kept:
            self.get_logger().info('instruction kept from before cleanup: ' + '; '.join(
                f'{topic}: {_first_words(entry[0])}' for topic, entry in kept.items()))
        self.get_logger().info(f'configured: {len(self._engine.inputs)} inputs, action on '
                               f"{v['action_topic']} at {v['rate_hz']} Hz")
        return TransitionCallbackReturn.SUCCESS

    def _receive(self, topic, msg):
        """Keep an input message with its arrival time and how old its header stamp was."""
        now = time.monotonic()
        lag = header_stamp_lag(msg, self.get_clock().now().nanoseconds / 1e9)
        self._buffer.put(topic, msg, now, lag)
        self._health.arrival(topic, now)

    def _receive_instruction(self, topic, msg):
        """Keep an instruction: the latest wins, and each message once.

        Kept lean, since a flood of instructions keeps the executor's thread busy and that
        thread shares the interpreter with the control thread. While a latched subscription
        fetches what a latched publisher kept (``_match_latched``), a message of that
        publisher reaches both subscriptions: one equal to a message received in the last
        second is that copy. Coalesced by the buffer (the latest per topic), a flood places
        at most one instruction a tick.
        """
        now = time.monotonic()
        if self._latched[topic][0] is not None:
            recent = self._received[topic]   # message text -> when it arrived
            key = getattr(msg, 'data', None)
            key = key if isinstance(key, str) else repr(msg)
            if now - recent.get(key, -2.0) < 1.0:
                return
            recent[key] = now
            while len(recent) > DEDUPE_MESSAGES:
                recent.popitem(last=False)
        self._buffer.put(topic, msg, now, None)
        self._health.arrival(topic, now)
        if now - self._instruction_said.get(topic, -1.0) >= 1.0:   # at most a line a second
            held = self._health.counts[topic] - self._instruction_count.get(topic, 0) - 1
            self._instruction_said[topic] = now
            self._instruction_count[topic] = self._health.counts[topic]
            more = f' ({held} more since the last line)' if held > 0 else ''
            self.get_logger().info(f'instruction on {topic}: {_first_words(msg)}{more}')

    def _on_incompatible_qos(self, topic, event):
        self.get_logger().warning(
            f'{topic}: a publisher offers a QoS this node cannot receive (policy '
            f'{event.last_policy_kind}): publish instructions reliable, as ros2 topic pub '
            'does by default; transient local lets a restarted node get the last one')

    def _match_latched(self):
        """Fetch what a new latched instruction publisher kept; otherwise one subscription.

        A latched publisher that spoke before this node subscribed has its message only for
        a latched subscription, which a volatile publisher cannot match. So one is made when a
        latched publisher is met for the first time, and destroyed once it had the time to
        deliver (``LATCHED_FETCH_S``): its live messages reach the volatile subscription, so
        each message is received once, not twice.
        """
        now = time.monotonic()
        for topic, (sub, made) in list(self._latched.items()):
            if sub is not None:
                if now - made >= LATCHED_FETCH_S:
                    self.destroy_subscription(sub)
                    self._latched[topic] = (None, 0.0)
                continue
            try:
                infos = self.get_publishers_info_by_topic(topic)
            except Exception:   # the graph is not readable now: try on the next timer
                continue
            latched = {tuple(i.endpoint_gid) for i in infos
                       if i.qos_profile.durability == DurabilityPolicy.TRANSIENT_LOCAL}
            new = latched - self._latched_seen[topic]
            if not new:
                continue
            self._latched_seen[topic] |= new
            spec = next(s for s in self._engine.inputs if s.topic == topic)
            # a volatile publisher beside the latched one reaches the volatile subscription:
            # that this one cannot match it is no news
            self._latched[topic] = (self.create_subscription(
                MESSAGE_CLASSES[spec.msg_type], topic, partial(self._receive_instruction, topic),
                INSTRUCTION_QOS, event_callbacks=SubscriptionEventCallbacks(
                    incompatible_qos=lambda event: None)), now)

    def on_activate(self, state):
        self._reset_stats()
        self._stop.clear()
        self._active = True
        self._thread = threading.Thread(target=self._control_loop, name='rt_llm_control',
                                        daemon=True)
        self._diagnostics_timer = self.create_timer(1.0, self._publish_diagnostics)
        self._engine.guard.reset()
        self._input_problems = {}
        self._deciding = 'action'
        result = super().on_activate(state)
        self._thread.start()
        self.get_logger().info(f"activated: ticking at {self._values['rate_hz']:g} Hz, actions "
                               f'on {self._action_pub.topic_name}')
        return result

    def on_deactivate(self, state):
        self._leave_active()
        self._save_state()
        if self._diagnostics_timer is not None:
            self.destroy_timer(self._diagnostics_timer)
            self._diagnostics_timer = None
        if self._failed:  # repeated backend errors: go through ErrorProcessing
            return TransitionCallbackReturn.ERROR
        self.get_logger().info('deactivated: the stop was published, no more ticks')
        return super().on_deactivate(state)

    def on_cleanup(self, state):
        self._leave_active()
        self._save_state()
        self._release()
        self.get_logger().info('cleaned up: model released (the last instruction is kept)')
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state):
        self._leave_active()
        self._save_state()
        self._release()
        self.get_logger().info('shut down')
        return TransitionCallbackReturn.SUCCESS

    def _save_state(self):
        """Keep the system prompt's KV state in state_dir (a failure is a warning)."""
        engine = self._engine
        if engine is None or engine.state is None:
            return
        try:
            engine.save_state(*engine.state)
        except Exception as exc:   # a full disk must not stop a transition
            self.get_logger().warning(f'state not saved to {self._values["state_dir"]}: {exc}')

    def on_error(self, state):
        self.get_logger().error(f'error processing ({self.last_error}): releasing the model')
        self._leave_active()
        self._release()
        self._failed = False
        return TransitionCallbackReturn.SUCCESS

    def _release(self):
        if self._graph_timer is not None:
            self.destroy_timer(self._graph_timer)
            self._graph_timer = None
        for sub in [*self._subscriptions_, *(sub for sub, _ in self._latched.values())]:
            if sub is not None:
                self.destroy_subscription(sub)
        self._subscriptions_ = []
        self._latched = {}
        self._latched_seen = {}
        for pub in (self._action_pub, self._refusal_pub, self._diagnostics_pub):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self._action_pub = self._refusal_pub = self._diagnostics_pub = None
        self._engine = None
        # the robot's task outlives a reconfigure: a one-shot instruction is not lost by it
        kept = {topic: entry for topic, entry in self._buffer.snapshot().items()
                if topic in self._instruction_topics}
        self._buffer.clear()
        for topic, entry in kept.items():
            self._buffer.put(topic, *entry)
        self._instruction_topics = set()
        self._received.clear()
        gc.collect()

    def _stop_loop(self):
        """Stop the control thread and wait for it: no tick publishes after this returns."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)
            if thread.is_alive():   # a tick stuck in the backend: it publishes nothing now
                self.get_logger().error('the control thread did not stop within 10 s')
        gc.enable()

    def _leave_active(self):
        """Every way out of the active state: stop the loop, then publish the stop action once.

        Deactivate, cleanup, shutdown, error processing, SIGINT and SIGTERM all come here, so a
        robot never keeps driving on the last command of a node that stopped acting.
        """
        self._stop_loop()
        if self._active:
            self._active = False
            self._publish_stop()
            # the publisher (and, on a signal, the process) may go away next: wait until the
            # subscribers have the stop, briefly (the middleware sends from its own threads)
            try:
                if self._action_pub is not None:
                    self._action_pub.wait_for_all_acked(Duration(seconds=0.5))
            except Exception as exc:   # best effort: the stop was published either way
                self.get_logger().warning(f'stop action not acknowledged: {exc}')

    # -- the control loop ---------------------------------------------------------------
    def _reset_stats(self):
        with self._stats_lock:
            self._stats = Counter()
            self._refusals = Counter()
            self._latencies = deque(maxlen=3000)
            self._cache_occupancy = 0.0
            self._admission_scale = 1.0
            window = self._values.get('diagnostics_window_s',
                                      BY_NAME['diagnostics_window_s'].default)
            before = getattr(self, '_health', None)
            self._health = Health(window)
            if before is not None:   # input rates span activations
                self._health.counts, self._health.last = before.counts, before.last

    def _on_deadline_missed(self, event):
        with self._stats_lock:
            self._stats['qos_deadline_missed'] += event.total_count_change

    def _at_control_priority(self, work):
        """Run ``work()`` on a thread at the control thread's priority; return its result.

        Configure's calibration times the backend: timed on the executor's normal-priority
        thread beside busy processes it came out several times too slow, and the node then
        refused every tick (its probes cannot recover a model that far off). With
        ``realtime_priority`` 0 (or no permission) it runs here, as before.
        """
        priority = self._values['realtime_priority']
        if not priority:
            return work()
        outcome = {}

        def run():
            try:
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
            except (AttributeError, OSError):
                pass   # the control thread will say so; calibrate at normal priority
            try:
                outcome['value'] = work()
            except BaseException as exc:   # re-raised on the caller's thread
                outcome['error'] = exc
        thread = threading.Thread(target=run, name='rt_llm_configure')
        thread.start()
        thread.join()
        if 'error' in outcome:
            raise outcome['error']
        return outcome['value']

    def _set_realtime(self, priority):
        """SCHED_FIFO for this (the control) thread; True when it took effect."""
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        except (AttributeError, OSError) as exc:   # not Linux, or not permitted
            self.get_logger().warning(
                f'realtime_priority {priority}: SCHED_FIFO refused ({exc}); the control '
                'thread runs at normal priority (grant CAP_SYS_NICE or an rtprio limit)')
            return False
        self.get_logger().info(f'control thread: SCHED_FIFO priority {priority}')
        return True

    def _control_loop(self):
        engine = self._engine
        priority = self._values['realtime_priority']
        self._realtime = bool(priority) and self._set_realtime(priority)
        period = 1.0 / self._values['rate_hz']
        margin = self._values['deadline_margin_ms'] / 1e3
        gc.disable()  # collected between ticks when there is time, never inside one
        # other Python threads (executor callbacks) may hold the GIL for the whole switch
        # interval, 5 ms by default: far too long inside a 33 ms tick
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)
        next_start = time.monotonic() + period
        consecutive_errors = 0
        while not self._stop.is_set():
            delay = next_start - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
                if self._stop.is_set():
                    break
            start = next_start
            next_start += period
            now = time.monotonic()
            deadline = start + period - margin
            if now >= deadline:  # woken after this tick's deadline: nothing can be on time
                skipped = int((now - start) / period) + 1
                next_start = start + skipped * period
                with self._stats_lock:
                    self._stats['skipped_periods'] += skipped
                continue
            ros_start = self.get_clock().now() - Duration(seconds=now - start)
            snapshot = self._buffer.snapshot()
            result = engine.tick(snapshot, start, deadline)
            finished = time.monotonic()
            try:
                self._publish_result(result, ros_start, snapshot)
            except Exception as exc:   # e.g. the context was shut down under the loop
                if not self._stop.is_set():
                    self.get_logger().error(f'control loop stopped: cannot publish ({exc})')
                break
            rec = result.record
            if rec.late:   # rare, and what a field engineer needs to see why
                self.get_logger().warning(
                    f'tick {rec.tick} ran {1e3 * (finished - deadline):.1f} ms past its deadline, '
                    f'its action withheld: predicted {rec.predicted_ms:.1f} of '
                    f'{rec.available_ms:.1f} ms available; render {rec.render_ms:.1f}, evict '
                    f'{rec.evict_ms:.1f}, prefill {rec.prefill_ms:.1f} ({rec.n_prefill} tokens), '
                    f'decode {rec.decode_ms:.1f} ms ({rec.n_decode} steps)')
            consecutive_errors = consecutive_errors + 1 if rec.reason == 'backend_error' else 0
            with self._stats_lock:
                self._stats['ticks'] += 1
                self._stats['actions' if result.action else 'refusals'] += 1
                if result.refusal:
                    self._refusals[result.refusal.reason] += 1
                self._stats['late'] += int(rec.late)
                self._stats['probes'] += int(rec.probe)
                if result.action:
                    self._stats['forward_passes'] += 1 + rec.n_decode
                self._stats['drafted'] += rec.drafted
                self._stats['drafts_kept'] += rec.accepted
                self._stats['verify_passes'] += rec.verify_passes
                self._stats['fused_passes'] += int(rec.fused)
                if rec.instruction:   # a new instruction placed: prefilled or restored
                    self._stats['instructions_' + rec.instruction] += 1
                self._admission_scale = engine.admission.scale
                self._latencies.append((time.monotonic() - start) * 1e3)
                self._cache_occupancy = rec.cache_length / max(1, rec.capacity)
                self._health.tick(start, '' if result.action else result.refusal.reason,
                                  rec.late)
            self._log_inputs(engine, snapshot, start)
            self._log_decision(result, start)
            if consecutive_errors >= self._values['backend_error_limit']:
                self.last_error = (f'{consecutive_errors} consecutive backend errors, the last: '
                                   f'{result.refusal.detail}')
                self.get_logger().error(self.last_error)
                self._publish_stop()
                self._failed = True
                self._request_deactivate()
                break
            if next_start - time.monotonic() > 0.5 * period:
                gc.collect(0)
        sys.setswitchinterval(switch_interval)
        gc.enable()

    def _request_deactivate(self):
        """Request deactivate from outside the control thread.

        Deactivate (then, failed, ErrorProcessing) from outside the control thread, which the
        transition joins: on the node's executor, where it runs as transitions requested over the
        lifecycle services do; a subscription destroyed by another thread while the executor builds
        its wait set raises InvalidHandle in the executor and stops it (ros2/rclpy#1284). A node on
        no executor gets a thread of its own.
        """
        executor = self.executor
        if executor is not None:
            executor.create_task(self.trigger_deactivate)
        else:
            threading.Thread(target=self.trigger_deactivate, daemon=True).start()

    def _log_inputs(self, engine, snapshot, now):
        """Say when a required input goes missing or stale, and when it recovers.

        A line when an input's state (fresh, missing, stale, stamped ahead) differs from the
        one last said, at most one a second an input: a flapping input cannot flood the
        console, and its last state is still said within a second.
        """
        problems = engine.input_problems(snapshot, now)
        for spec in engine.inputs:
            problem = problems.get(spec.topic, '')
            state = ('fresh' if not problem else 'missing' if problem.startswith('no message')
                     else 'ahead' if 'future' in problem else 'stale')
            if self._input_problems.get(spec.topic, 'fresh') == state:
                continue
            if self._lines.allow(('input', spec.topic), now) is None:
                continue
            self._input_problems[spec.topic] = state
            if not problem:
                self.get_logger().info(f'{spec.topic}: ' + (
                    'fresh again' if spec.kind == 'observation' else 'in force'))
                continue
            hint = (' (publish one: see the README, "Instructions")'
                    if spec.topic in self._instruction_topics else '')
            self.get_logger().info(f'{spec.topic}: {problem}, refusing ticks{hint}')

    def _log_decision(self, result, now):
        """Say when the ticks go from acting to refusing for a reason other than the inputs.

        And back. At most a line a second: a deadline refusal says what admission predicted
        against the time there was (a model too slow for this rate on this device refuses every
        tick, on time, and this line says why). Input refusals have their own lines.
        """
        refusal = result.refusal
        state = 'action' if refusal is None else refusal.reason
        if state == self._deciding or state == 'stale_input':
            return
        if self._lines.allow(('decision',), now) is None:
            return
        self._deciding = state
        if refusal is None:
            self.get_logger().info('acting again')
        elif refusal.reason == 'deadline':
            self.get_logger().info(
                f'refusing ticks: deadline (the tick would take {refusal.predicted_ms:.1f} ms, '
                f'{refusal.available_ms:.1f} ms are left of the period after the margin: the '
                'model is too slow for rate_hz on this device, or the inputs too long)')
        else:
            detail = f': {refusal.detail}' if refusal.detail else ''
            self.get_logger().info(f'refusing ticks: {refusal.reason}{detail}')

    def _publish_result(self, result, ros_start, snapshot):
        with self._publish_lock:
            if self._stop.is_set():   # leaving active: the stop action is the last one
                return
            self._publish_result_locked(result, ros_start, snapshot)

    def _publish_result_locked(self, result, ros_start, snapshot):
        guard = self._engine.guard
        if result.action is not None:
            self._publish_action(result.action)
            guard.on_action(result.action, time.monotonic())
            return
        r = result.refusal
        stamp = ros_start.to_msg()
        # the tick's deadline is the end of its period; the engine stopped work
        # deadline_margin_ms before it (r.deadline) to leave that time for publishing
        deadline_ros = ros_start + Duration(seconds=1.0 / self._values['rate_hz'])
        status = DiagnosticStatus(level=DiagnosticStatus.WARN,
                                  name=self.get_fully_qualified_name(), message=r.reason,
                                  hardware_id='rt_llm_node')
        published = self.get_clock().now().nanoseconds
        status.values = [KeyValue(key=key, value=value) for key, value in
                         refusal_values(r, deadline_ros.nanoseconds, published)]
        array = DiagnosticArray(status=[status])
        array.header.stamp = stamp
        self._refusal_pub.publish(array)
        fallback = guard.on_refusal(self._values.get('on_refusal', 'stop'), time.monotonic(),
                                    snapshot)
        if fallback is not None:
            self._publish_action(fallback)
        if published > deadline_ros.nanoseconds:
            # the process lost the CPU between deciding and publishing (a VM's stolen time,
            # RT throttling, a normal-priority control thread beside busy processes): the
            # refusal and the fallback still go out, as the robot's stop matters more late
            # than never, and the count shows it
            with self._stats_lock:
                self._stats['late_refusals'] += 1

    def _publish_action(self, action):
        v = self._values
        self._action_pub.publish(to_message(action, v['action_type'], 1.0 / v['rate_hz'],
                                            self.get_clock().now().to_msg(),
                                            v['action_frame_id']))

    def _publish_stop(self):
        """Publish the stop on the way out of the active state: always, never zeros for joints."""
        if self._action_pub is None or self._engine is None:
            return
        try:
            self._publish_action(self._engine.guard.on_exit(self._buffer.snapshot()))
        except Exception as exc:   # the context is gone (shut down from outside): say so
            self.get_logger().error(f'could not publish the stop action: {exc}')

    def _publish_diagnostics(self):
        if self._diagnostics_pub is None:
            return
        with self._stats_lock:
            stats = dict(self._stats)
            refusals = dict(self._refusals)
            latencies = sorted(self._latencies)
            occupancy = self._cache_occupancy
            scale = self._admission_scale

        def pct(q):
            return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies \
                else 0.0
        status = DiagnosticStatus(level=DiagnosticStatus.OK,
                                  name=self.get_fully_qualified_name(), message='running',
                                  hardware_id='rt_llm_node')
        pairs = {'ticks': stats.get('ticks', 0), 'actions': stats.get('actions', 0),
                 'refusals': stats.get('refusals', 0),
                 'admitted_but_late': stats.get('late', 0),
                 'late_refusals_published': stats.get('late_refusals', 0),
                 'qos_deadline_missed': stats.get('qos_deadline_missed', 0),
                 'skipped_periods': stats.get('skipped_periods', 0),
                 'realtime_scheduling': str(self._realtime).lower(),
                 'tick_ms_p50': f'{pct(0.5):.2f}', 'tick_ms_p99': f'{pct(0.99):.2f}',
                 'tick_ms_max': f'{latencies[-1] if latencies else 0.0:.2f}',
                 'cache_occupancy': f'{occupancy:.3f}',
                 'admission_scale': f'{scale:.3f}',
                 'admission_probes': stats.get('probes', 0),
                 # speculative decoding: forward passes an action (its prefill included),
                 # tokens drafted and kept, verify passes (those beside a prefill too)
                 'forward_passes_per_action':
                     f"{stats.get('forward_passes', 0) / max(1, stats.get('actions', 0)):.2f}",
                 'drafted_tokens': stats.get('drafted', 0),
                 'drafted_tokens_kept': stats.get('drafts_kept', 0),
                 'verify_passes': stats.get('verify_passes', 0),
                 'fused_passes': stats.get('fused_passes', 0),
                 # instruction cache: new instructions placed by a prefill or a copy
                 'instructions_prefilled': stats.get('instructions_prefilled', 0),
                 'instructions_restored': stats.get('instructions_restored', 0)}
        pairs.update({f'refusals_{k}': v for k, v in refusals.items()})
        now = time.monotonic()
        self._health.sample(now)
        with self._stats_lock:
            level, message = self._health.level(now)
        status.level = _LEVELS[level]
        status.message = message
        pairs['window_s'] = f'{self._health.window_s:g}'
        status.values = [KeyValue(key=k, value=str(v)) for k, v in pairs.items()]
        array = DiagnosticArray(status=[status, *self._input_statuses(now)])
        array.header.stamp = self.get_clock().now().to_msg()
        self._diagnostics_pub.publish(array)

    def _input_statuses(self, now):
        """One status an input: its rate and age over the window, as topic monitors show them."""
        engine, statuses = self._engine, []
        if engine is None:
            return statuses
        snapshot = self._buffer.snapshot()
        problems = engine.input_problems(snapshot, now)
        for spec in engine.inputs:
            last = self._health.last_arrival(spec.topic)
            kept = snapshot.get(spec.topic)
            problem = problems.get(spec.topic, '')
            level = OK if not problem else WARN if spec.kind == 'instruction' else ERROR
            status = DiagnosticStatus(
                level=_LEVELS[level], name=f'{self.get_fully_qualified_name()}: {spec.topic}',
                message=problem or ('fresh' if spec.kind == 'observation' else 'in force'),
                hardware_id='rt_llm_node')
            values = {'type': spec.msg_type, 'kind': spec.kind,
                      'frequency_hz': f'{self._health.rate_hz(spec.topic):.2f}',
                      'age_s': ('never' if kept is None else f'{now - kept[1]:.3f}'),
                      'max_age_s': f'{spec.max_age_s:g}',
                      'last_arrival_s_ago': '' if last is None else f'{now - last:.3f}'}
            status.values = [KeyValue(key=k, value=v) for k, v in values.items()]
            statuses.append(status)
        return statuses

    def shut_down(self):
        """Leave whatever state the node is in through the lifecycle's shutdown transition.

        Used by ``rt-llm-node`` on SIGINT and SIGTERM, before the context goes away: an active
        node publishes its stop action first.
        """
        try:
            self.trigger_shutdown()
        except Exception as exc:   # already finalized, or a transition in flight
            self.get_logger().warning(f'shutdown transition: {exc}')
            self._leave_active()

    def stats(self):
        """Return a copy of the counters (for tests and the demo)."""
        with self._stats_lock:
            return dict(self._stats), dict(self._refusals), list(self._latencies)


def apply_params_files(node, ros_args):
    """Honour every --params-file section for this node, and say when none applied.

    rcl applies ``/ns/node``, ``/**`` and ``/**/node``; a section keyed by the bare node name
    applies only outside a namespace there, though that is how people write it: under a
    namespace this applies it too (a section rcl applied wins over it). A file with no
    section for the node is a warning naming the keys looked for and those found.
    """
    files = [ros_args[i + 1] for i, a in enumerate(ros_args[:-1]) if a == '--params-file']
    fqn = node.get_fully_qualified_name()
    for path in files:
        try:
            data = read_yaml(path, 'parameters file')
        except FileError as exc:
            node.get_logger().warning(str(exc))
            continue
        values, matched, looked_for = node_sections(data, fqn)
        if not matched:
            keys = ', '.join(map(str, data)) if isinstance(data, dict) else 'none'
            node.get_logger().warning(
                f'{path} set no parameter of {fqn}: looked for a section keyed '
                f'{", ".join(looked_for)}; the file has: {keys}')
            continue
        bare = [k for k in matched if k.strip().lstrip('/') == node.get_name()
                and fqn != '/' + node.get_name()]
        if not bare:
            continue   # rcl applied these sections already
        applied = getattr(node, '_parameter_overrides', {}) or {}
        for key in bare:
            section = data[key]['ros__parameters']
            params = [Parameter(n, value=v) for n, v in section.items()
                      if n in BY_NAME and n not in applied]
            for param, result in zip(params, node.set_parameters(params)):
                if not result.successful:
                    node.get_logger().error(f'{path}: {param.name}: {result.reason}')
            node.get_logger().info(f'{path}: section {key!r} applied to {fqn}')


def main(args=None):
    """rt-llm-node [--autostart] [--ros-args --params-file FILE ...]."""
    argv = list(sys.argv if args is None else args)
    ros_args = argv[argv.index('--ros-args'):] if '--ros-args' in argv else []
    own = argv[1:len(argv) - len(ros_args)] if args is None else argv[:len(argv) - len(ros_args)]
    parser = argparse.ArgumentParser(prog='rt-llm-node')
    parser.add_argument('--autostart', action='store_true',
                        help='configure and activate at start (no lifecycle manager needed)')
    options = parser.parse_args(own)

    def autostart(node):
        apply_params_files(node, ros_args)
        if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
            node.get_logger().error(f'autostart: {node.last_error}')
            return 2
        node.trigger_activate()
        return 0

    def check(node):
        apply_params_files(node, ros_args)
        return 0

    return spin_until_shutdown('rt-llm-node', ros_args, RtLlmNode,
                               start=autostart if options.autostart else check,
                               finish=lambda node: node.shut_down())


if __name__ == '__main__':
    sys.exit(main())
