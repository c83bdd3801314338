"""The model's input and output language.

- ``observations``: input messages rendered to bounded lines of text and token ids;
- ``actions``: action grammars as token tries, parse and quantize;
- ``messages``: actions and refusals as ROS message fields.
"""

from rt_llm_node.codec.actions import Action  # noqa: F401
from rt_llm_node.codec.actions import ActionField  # noqa: F401
from rt_llm_node.codec.actions import FieldGrammar  # noqa: F401
from rt_llm_node.codec.actions import GrammarError  # noqa: F401
from rt_llm_node.codec.actions import is_plan_field  # noqa: F401
from rt_llm_node.codec.actions import joint_trajectory_grammar  # noqa: F401
from rt_llm_node.codec.actions import StringGrammar  # noqa: F401
from rt_llm_node.codec.actions import TokenTrie  # noqa: F401
from rt_llm_node.codec.actions import twist_grammar  # noqa: F401
from rt_llm_node.codec.messages import action_message  # noqa: F401
from rt_llm_node.codec.messages import refusal_values  # noqa: F401
from rt_llm_node.codec.observations import InputSpec  # noqa: F401
from rt_llm_node.codec.observations import normalize_type  # noqa: F401
from rt_llm_node.codec.observations import ObservationCodec  # noqa: F401
from rt_llm_node.codec.observations import RenderError  # noqa: F401
from rt_llm_node.codec.observations import RENDERERS  # noqa: F401
from rt_llm_node.codec.observations import scan_sectors  # noqa: F401
from rt_llm_node.codec.observations import yaw_from_quaternion  # noqa: F401
