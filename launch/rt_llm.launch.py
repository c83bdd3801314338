"""Launch rt_llm_node as a managed lifecycle node, optionally configured and activated.

Usage: ``ros2 launch rt_llm_node rt_llm.launch.py params_file:=/path/params.yaml
autostart:=true``.
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
    node = LifecycleNode(package='rt_llm_node', executable='rt-llm-node', name='rt_llm_node',
                         namespace='', output='screen', parameters=[params_file])
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
        OpaqueFunction(function=check_arguments),
        node, activate, configure,
    ])
