"""The demo: the demo world and rt_llm_node (demo profile), autostarted.

Usage: ``ros2 launch rt_llm_node demo.launch.py``.
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch_ros.actions import Node


def generate_launch_description():
    share = get_package_share_directory('rt_llm_node')
    return LaunchDescription([
        Node(package='rt_llm_node', executable='rt-llm-demo-world', name='rt_llm_demo_world',
             output='screen'),
        IncludeLaunchDescription(
            PythonLaunchDescriptionSource(os.path.join(share, 'launch', 'rt_llm.launch.py')),
            launch_arguments={'params_file': os.path.join(share, 'config', 'demo.yaml'),
                              'autostart': 'true'}.items()),
    ])
