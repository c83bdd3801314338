"""Where the embedded default model lives (shipped inside the package)."""

from pathlib import Path

from rt_llm_node.model.errors import CheckpointError

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / 'demo' / 'model'


def default_model_path():
    """Return the embedded demo policy's checkpoint directory; CheckpointError if not shipped."""
    if not (EMBEDDED_DIR / 'config.json').exists():
        raise CheckpointError(EMBEDDED_DIR, 'the embedded demo model is not installed; '
                                            'pass a checkpoint directory explicitly')
    return EMBEDDED_DIR
