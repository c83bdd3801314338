"""ament_python package: installs with colcon on a ROS distro and with pip anywhere."""

from glob import glob
import os

from setuptools import find_packages
from setuptools import setup

PACKAGE = 'rt_llm_node'
ROS_WHEELS = [
    'ros-rclpy', 'ros-rmw-fastrtps-cpp', 'ros-std-msgs', 'ros-sensor-msgs',
    'ros-geometry-msgs', 'ros-nav-msgs', 'ros-diagnostic-msgs', 'ros-lifecycle-msgs',
    'ros-trajectory-msgs',
]


def model_files():
    """Return the embedded demo model and SmolLM2 adapter, shipped as package data."""
    return [os.path.relpath(p, PACKAGE) for folder in ('model', 'smollm2')
            for p in glob(os.path.join(PACKAGE, 'demo', folder, '*'))]


setup(
    name=PACKAGE,
    version='0.2.0',
    packages=find_packages(include=[PACKAGE, PACKAGE + '.*']),
    package_data={PACKAGE: model_files()},
    data_files=[
        ('share/ament_index/resource_index/packages', ['resource/' + PACKAGE]),
        ('share/' + PACKAGE, ['package.xml']),
        ('share/' + PACKAGE + '/launch', glob('launch/*.launch.py')),
        ('share/' + PACKAGE + '/config', glob('config/*.yaml')),
        ('share/' + PACKAGE + '/cuda', glob('cuda/*.cu') + glob('cuda/*.cuh')),
    ],
    python_requires='>=3.10',
    install_requires=['numpy>=1.24', 'safetensors>=0.4.3', 'tokenizers>=0.15'],
    extras_require={
        'ros': ROS_WHEELS + ['pyyaml'],
        'cuda': ['cupy-cuda13x', 'nvidia-cuda-nvrtc'],
        'cuda12': ['cupy-cuda12x', 'nvidia-cuda-nvrtc-cu12'],
        'demo': ['matplotlib'],
        'replay': ['rosbags>=0.10'],
        'gguf': ['gguf>=0.10'],
        'fleet': ['ray>=2.9', 'rosbags>=0.10', 'matplotlib'],
        'test': ['pytest', 'transformers', 'accelerate', 'peft', 'gguf>=0.10', 'rosbags>=0.10',
                 'ray>=2.9',
                 'matplotlib', 'flake8>=6', 'pyyaml',
                 'flake8-docstrings', 'hypothesis', 'colcon-core', 'colcon-ros',
                 'ros-ament-package', 'osrf-pycommon',
                 'flake8-quotes', 'flake8-import-order', 'flake8-builtins',
                 'flake8-comprehensions', 'cupy-cuda13x', 'nvidia-cuda-nvrtc'],
    },
    zip_safe=False,
    maintainer='rt_llm_node team',
    maintainer_email='team@rt-llm-node.invalid',
    description='Real-time LLM inference inside a ROS 2 control loop',
    license='Apache-2.0',
    entry_points={
        'console_scripts': [
            'rt-llm-generate = rt_llm_node.generate:main',
            'rt-llm-eval = rt_llm_node.demo.evaluate:main',
            'rt-llm-replay-fleet = rt_llm_node.fleet:main',
            'rt-llm-node = rt_llm_node.node:main',
            'rt-llm-demo = rt_llm_node.demo.run:main',
            'rt-llm-demo-world = rt_llm_node.demo.world_node:main',
            'rt-llm-demo-record = rt_llm_node.demo.recorder:main',
            'rt-llm-replay = rt_llm_node.replay:main',
        ],
    },
)
