"""Launch rt_llm_node as a managed lifecycle node, optionally configured and activated.

Usage: ``ros2 launch rt_llm_node rt_llm.launch.py params_file:=/path/params.yaml
autostart:=true namespace:=robot1 use_sim_time:=false log_level:=info``. Under a namespace
the node is ``/robot1/rt_llm_node`` and its relative topics (``cmd_vel``) are the robot's;
a params file section keyed ``rt_llm_node``, ``/robot1/rt_llm_node`` or ``/**`` applies.
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.actions import EmitEvent
from launch.actions import OpaqueFunction
from launch.actions import RegisterEventHandler
from launch.conditions import IfCondition
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from launch_ros.parameter_descriptions import ParameterValue
from lifecycle_msgs.msg import Transition


def check_arguments(context):
    """Refuse a parameters file that cannot be read before any process starts."""
    path = LaunchConfiguration('params_file').perform(context)
    if not os.path.isfile(path):
        raise RuntimeError(f"launch argument params_file: '{path}' is not a readable file")
    return []


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory('rt_llm_node'), 'config',
                                  'rt_llm.yaml')
    params_file = LaunchConfiguration('params_file')
    autostart = LaunchConfiguration('autostart')
    use_sim_time = ParameterValue(LaunchConfiguration('use_sim_time'), value_type=bool)
    node = LifecycleNode(package='rt_llm_node', executable='rt-llm-node', name='rt_llm_node',
                         namespace=LaunchConfiguration('namespace'), output='screen',
                         parameters=[params_file, {'use_sim_time': use_sim_time}],
                         ros_arguments=['--log-level', LaunchConfiguration('log_level')])
    configure = EmitEvent(event=ChangeState(
        lifecycle_node_matcher=matches_action(node),
        transition_id=Transition.TRANSITION_CONFIGURE), condition=IfCondition(autostart))
    activate = RegisterEventHandler(OnStateTransition(
        target_lifecycle_node=node, start_state='configuring', goal_state='inactive',
        entities=[EmitEvent(event=ChangeState(
            lifecycle_node_matcher=matches_action(node),
            transition_id=Transition.TRANSITION_ACTIVATE))]), condition=IfCondition(autostart))
    return LaunchDescription([
        DeclareLaunchArgument('params_file', default_value=default_params,
                              description='node parameters (ros__parameters YAML)'),
        DeclareLaunchArgument('autostart', default_value='true',
                              choices=['true', 'false', 'True', 'False', '1', '0'],
                              description='configure and activate through lifecycle events'),
        DeclareLaunchArgument('namespace', default_value='',
                              description="the robot's namespace (e.g. robot1)"),
        DeclareLaunchArgument('use_sim_time', default_value='false',
                              choices=['true', 'false', 'True', 'False'],
                              description='take time from /clock (simulation, bag replay)'),
        DeclareLaunchArgument('log_level', default_value='info',
                              choices=['debug', 'info', 'warn', 'error', 'fatal'],
                              description='console log level of the node'),
        OpaqueFunction(function=check_arguments),
        node, activate, configure,
    ])
